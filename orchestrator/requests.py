"""A generation request as both front doors describe it, and its validation at the edge.

Validation happens once, here, before any worker is involved: the prompt is tokenized, checked
against the context, and the sampling parameters are checked by the engine's own rules. A bad
request becomes BadRequest (gRPC INVALID_ARGUMENT, HTTP 400) naming the problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequest
from engine.sampling import SamplingParams
from engine.tokenizer import ChatMessage, Tokenizer


# Pages are reserved for the whole answer up front, so an unbounded default would reserve the rest of
# the context for every chat request; OpenAI-style requests without max_tokens get this many at most.
DEFAULT_MAX_TOKENS = 1024


class BadRequest(ValueError):
    """The client's request is invalid. `param` names the field when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Unavailable(RuntimeError):
    """No worker could serve the request (all failed or none is healthy). Retryable by the client."""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    max_tokens: int | None = 16  # None: up to DEFAULT_MAX_TOKENS, within the context
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    end_id: int | None = None
    logprobs: bool = False
    exclude_input: bool = True  # False: non-streamed text also repeats the prompt (Triton ensemble default)
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Prepared:
    """A validated request: token ids and concrete sampling parameters (with a seed if sampling)."""

    request: GenerationRequest
    prompt_ids: list[int]
    params: SamplingParams


def prepare(req: GenerationRequest, tokenizer: Tokenizer, max_context: int) -> Prepared:
    if req.messages:
        if not any(m.content for m in req.messages):
            raise BadRequest("messages are empty; send at least one message with content", "messages")
        try:
            ids = tokenizer.encode_chat(list(req.messages))
        except InvalidRequest as e:
            raise BadRequest(str(e), "messages") from None
    elif req.prompt_ids:
        ids = list(req.prompt_ids)
    else:
        if not req.prompt:
            raise BadRequest("prompt is empty; send the text to complete", "prompt")
        ids = tokenizer.encode(req.prompt)
    if not ids:
        raise BadRequest("prompt is empty after tokenization", "prompt")
    if len(ids) >= max_context:
        raise BadRequest(f"prompt has {len(ids)} tokens but the model's context is {max_context}; "
                         f"shorten it to at most {max_context - 1} tokens", "prompt")
    max_tokens = req.max_tokens if req.max_tokens is not None else min(DEFAULT_MAX_TOKENS, max_context - len(ids))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    if len(ids) + max_tokens > max_context:
        raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's context of "
                         f"{max_context}; ask for at most {max_context - len(ids)} tokens", "max_tokens")
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=float(req.temperature), top_k=int(req.top_k),
                                top_p=float(req.top_p), seed=req.seed, stop=tuple(req.stop),
                                min_tokens=int(req.min_tokens), logprobs=req.logprobs,
                                extra_eos=(req.end_id,) if req.end_id is not None else ()).with_seed()
    except (InvalidRequest, TypeError, ValueError) as e:
        raise BadRequest(str(e)) from None
    return Prepared(req, ids, params)
