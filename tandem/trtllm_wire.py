"""The TensorRT-LLM handoff on Tandem's control channel: its descriptor and its two messages.

TensorRT-LLM moves a request's K/V itself (decode pulls it through its cache transceiver), so the
orchestrator carries no pages, only what a `context_only` request returned: `TrtllmParams`, a typed
copy of the fields of TensorRT-LLM's `DisaggregatedParams` that a `generation_only` request needs
(engine/trtllm/api_surface.json lists them with their source). `opaque_state` is bytes and travels
as base64 in the JSON envelope (tandem/wire.py), never pickled.

  prefill worker:  Prefill (no destination) -> TrtllmPrefilled (first token + TrtllmParams), final
  decode worker:   TrtllmDecode (+ the params) -> Token...   (the tokens after the first)

After the answer the context side's K/V stay inside TensorRT-LLM until a generation side pulls them or
the role YAML's cache_transceiver_config.kv_transfer_timeout_ms passes (TensorRT-LLM's own bound):
Tandem holds nothing for them. The orchestrator drives these messages in control/trtllm_attempt.py.

Like a NIXL pool descriptor, `TrtllmParams` names where the context side's K/V can be read: it only
ever travels on the control channel and is never echoed in an error message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tandem.sampling_params import SamplingParams
from tandem.status import InvalidArgument

SCHEDULE_STYLES = ("CONTEXT_FIRST", "GENERATION_FIRST")  # TensorRT-LLM's DisaggScheduleStyle members


@dataclass(frozen=True)
class TrtllmParams:
    """The context side's answer a generation side needs; field names are TensorRT-LLM's."""

    first_gen_tokens: list[int]  # the token(s) sampled by the context phase (one per beam; Tandem: one)
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None  # the context side's transceiver state (where to read the K/V)
    draft_tokens: list[int] | None = None
    disagg_request_id: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None
    schedule_style: str | None = None  # one of SCHEDULE_STYLES

    def __post_init__(self) -> None:
        if not self.first_gen_tokens or any(t < 0 for t in self.first_gen_tokens):
            raise InvalidArgument(f"first_gen_tokens must hold at least one token id >= 0, got "
                                  f"{self.first_gen_tokens!r}", "first_gen_tokens")
        if self.ctx_request_id is None and self.disagg_request_id is None:
            raise InvalidArgument("a context answer names its request: ctx_request_id or disagg_request_id is "
                                  "required", "ctx_request_id")
        if self.schedule_style is not None and self.schedule_style not in SCHEDULE_STYLES:
            raise InvalidArgument(f"schedule_style must be one of {list(SCHEDULE_STYLES)}, got "
                                  f"{self.schedule_style!r}", "schedule_style")


@dataclass(frozen=True)
class TrtllmDecode:
    """Open a generation_only request on a TensorRT-LLM decode worker; it answers Token... and ends
    with the last one (finish_reason set). Cancel it with Abort(request_id)."""

    TYPE: ClassVar[str] = "trtllm_decode"
    request_id: str
    prompt_ids: list[int]  # what the context side computed: the prompt (+ tokens of a resumed request)
    sampling: SamplingParams  # max_tokens counts the tokens still to come, the first one included
    params: TrtllmParams


@dataclass(frozen=True)
class TrtllmPrefilled:
    """A context phase's answer; the Prefill call ends with it."""

    TYPE: ClassVar[str] = "trtllm_prefilled"
    request_id: str
    token: int
    logprob: float | None
    finish_reason: str | None  # set when the first token already ends the request
    params: TrtllmParams | None  # None when finish_reason is set: nothing left to decode
    compute_seconds: float  # from submission to the context phase's answer (TensorRT-LLM queues inside)
    queue_seconds: float = 0.0  # TensorRT-LLM does not report its queue apart: 0
    kv_bytes: int = 0  # the K/V move inside TensorRT-LLM (its cache transceiver): Tandem sees no bytes
    kv_seconds: float = 0.0
    cached_tokens: int = 0
