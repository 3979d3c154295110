"""Pure mappings between Tandem's types and TensorRT-LLM's LLM API (recorded in api_surface.json).

- `sampling_kwargs` / `tandem_sampling`: Tandem SamplingParams <-> keyword arguments of TensorRT-LLM's
  SamplingParams (only fields listed in the surface); `refuse_not_carried` refuses a request that sets
  a Tandem field with no counterpart there. Greedy is `top_k=1`, the one spelling every
  release read understands.
- `wire_params` / `generation_kwargs`: a context_only answer's DisaggregatedParams <-> TrtllmParams
  (tandem/trtllm_wire.py), field by field; opaque_state stays bytes.
- `error_for_exception`: a TensorRT-LLM failure -> the Tandem error whose status the reply carries.

Nothing here imports tensorrt_llm: objects from it are read by attribute, exceptions by class path.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from engine.trtllm.surface import disagg_fields
from tandem.sampling_params import SamplingParams
from tandem.status import (Cancelled, DeadlineExceeded, Internal, InvalidArgument, TandemError, TransferFailed,
                           Unavailable)
from tandem.trtllm_wire import TrtllmParams

CONTEXT_ONLY, GENERATION_ONLY = "context_only", "generation_only"
REQUEST_ERROR = "tensorrt_llm.executor.utils.RequestError"


# -- sampling ---------------------------------------------------------------------------------------

def sampling_kwargs(p: SamplingParams, context: bool = False) -> dict:
    """TensorRT-LLM SamplingParams(**kwargs) for `p`. The context phase is capped at its one token, as
    trtllm-serve's disaggregated server does (min_tokens then only says whether that one may be an end
    token). Token ids only (detokenize=False): Tandem detokenizes at its doors."""
    stop_ids = list(dict.fromkeys((*p.stop_token_ids, *p.extra_eos)))
    min_tokens = min(p.min_tokens, 1) if context else p.min_tokens
    kw = dict(max_tokens=1 if context else p.max_tokens, seed=p.seed,
              stop=list(p.stop) or None, stop_token_ids=stop_ids or None, ignore_eos=p.ignore_eos,
              min_tokens=min_tokens or None, logprobs=1 if p.logprobs else None, detokenize=False)
    if p.greedy:
        kw.update(top_k=1, top_p=None, temperature=None)
    else:
        kw.update(top_k=p.top_k or None, top_p=p.top_p, temperature=p.temperature)
    return kw


def tandem_sampling(kw: dict) -> SamplingParams:
    """The Tandem SamplingParams a TensorRT-LLM SamplingParams' kwargs mean (extra_eos arrives merged
    into stop_token_ids; greedy as temperature 0)."""
    greedy = kw.get("top_k") == 1 and kw.get("temperature") is None
    return SamplingParams(max_tokens=kw["max_tokens"], seed=kw.get("seed"), stop=tuple(kw.get("stop") or ()),
                          stop_token_ids=tuple(kw.get("stop_token_ids") or ()), ignore_eos=kw.get("ignore_eos", False),
                          min_tokens=kw.get("min_tokens") or 0, logprobs=bool(kw.get("logprobs")),
                          temperature=0.0 if greedy else kw["temperature"],
                          top_k=0 if greedy else (kw.get("top_k") or 0),
                          top_p=1.0 if greedy else (kw.get("top_p") or 1.0))


# Tandem fields with no recorded counterpart
NOT_CARRIED = {"top_logprobs": 0, "prompt_logprobs": False, "min_p": 0.0, "repetition_penalty": 1.0,
               "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": (), "guide": None,
               "bad_words": (), "allowed_token_ids": (), "cache_salt": "", "lora": ""}


def refuse_not_carried(p: SamplingParams) -> None:
    """InvalidArgument naming the fields set away from their defaults that the adapter does not map to
    TensorRT-LLM (they would be ignored silently otherwise)."""
    fields = [name for name, default in NOT_CARRIED.items() if getattr(p, name) != default]
    if fields:
        raise InvalidArgument(f"{', '.join(fields)} {'is' if len(fields) == 1 else 'are'} not supported by this "
                              f"deployment's TensorRT-LLM workers; leave {'it' if len(fields) == 1 else 'them'} at "
                              f"the default", fields[0])


def remaining(p: SamplingParams, sent: int) -> SamplingParams:
    """What is left of `p` after `sent` tokens were streamed (a resumed request): at least one token."""
    left = p.max_tokens - sent
    if left < 1:
        raise InvalidArgument(f"a resumed request has streamed {sent} of max_tokens={p.max_tokens} tokens; "
                              f"nothing is left to generate", "max_tokens")
    return replace(p, max_tokens=left, min_tokens=max(0, p.min_tokens - sent))


# -- disaggregated params ---------------------------------------------------------------------------

def wire_params(dp) -> TrtllmParams:
    """The TrtllmParams of a context_only output's `disaggregated_params` (read by attribute)."""
    if dp is None:
        raise Internal("TensorRT-LLM's context_only output carries no disaggregated_params")
    values = {name: getattr(dp, name, None) for name in disagg_fields() if name != "request_type"}
    style = values["schedule_style"]
    values["schedule_style"] = None if style is None else getattr(style, "name", str(style))
    for name in ("first_gen_tokens", "draft_tokens"):
        values[name] = None if values[name] is None else [int(t) for t in values[name]]
    values["first_gen_tokens"] = values["first_gen_tokens"] or []
    if values["opaque_state"] is not None:
        values["opaque_state"] = bytes(values["opaque_state"])
    return TrtllmParams(**values)


def generation_kwargs(params: TrtllmParams, style=lambda name: name) -> dict:
    """DisaggregatedParams(**kwargs) for the generation_only request; `style` turns a schedule-style
    name into TensorRT-LLM's DisaggScheduleStyle member. Fields left None are not set (an older release
    may lack them)."""
    kw = {name: getattr(params, name) for name in disagg_fields() if name != "request_type"}
    if kw["schedule_style"] is not None:
        kw["schedule_style"] = style(kw["schedule_style"])
    return {"request_type": GENERATION_ONLY, **{k: v for k, v in kw.items() if v is not None}}


# -- outputs ----------------------------------------------------------------------------------------

def token_logprob(completion, index: int) -> float | None:
    """The logprob of completion.token_ids[index], when logprobs were asked for."""
    entries = getattr(completion, "logprobs", None) or []
    if index >= len(entries):
        return None
    entry = entries[index]
    if isinstance(entry, dict):  # token id -> Logprob(logprob, rank)
        lp = entry.get(completion.token_ids[index])
        return None if lp is None else float(getattr(lp, "logprob", lp))
    return float(entry)


def finish_reason(reason) -> str | None:
    """TensorRT-LLM's finish reason as Tandem's (stop | length | None: going on); cancelled and timeout
    become errors. "not_finished" is what a context_only request that hands off reports."""
    if reason in (None, "not_finished"):
        return None
    if reason in ("stop", "length"):
        return reason
    if reason == "cancelled":
        raise Cancelled("TensorRT-LLM cancelled the request")
    if reason == "timeout":
        raise DeadlineExceeded("TensorRT-LLM timed the request out")
    raise Internal(f"TensorRT-LLM finished with an unknown reason {reason!r}")


# -- failures ---------------------------------------------------------------------------------------

def _paths(exc: BaseException) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}


def error_for_exception(exc: BaseException, phase: str) -> TandemError:
    """The Tandem error for a failure in `phase`: "submit" (generate_async refused the request),
    "context" (a context_only request) or "generation" (a generation_only request: its K/V pull).

      submit: ValueError/TypeError     -> INVALID_ARGUMENT (TensorRT-LLM refused the parameters)
      RequestError in context          -> UNAVAILABLE      (retry on another prefill worker)
      RequestError in generation       -> TRANSFER_FAILED  (the pull failed: prefill again elsewhere)
      CancelledError                   -> CANCELLED
      TimeoutError                     -> DEADLINE_EXCEEDED
      a CUDA out-of-memory error       -> UNAVAILABLE      (this worker cannot take it now)
      anything else                    -> INTERNAL
    """
    if isinstance(exc, TandemError):
        return exc
    text = f"TensorRT-LLM: {type(exc).__name__}: {exc}"
    if isinstance(exc, asyncio.CancelledError):
        return Cancelled(text)
    if isinstance(exc, TimeoutError):
        return DeadlineExceeded(text)
    paths = _paths(exc)
    if REQUEST_ERROR in paths:
        return TransferFailed(text) if phase == "generation" else Unavailable(text)
    if "torch.OutOfMemoryError" in paths or "torch.cuda.OutOfMemoryError" in paths:
        return Unavailable(text)
    if phase == "submit" and isinstance(exc, (ValueError, TypeError)):
        return InvalidArgument(text)
    return Internal(text)
