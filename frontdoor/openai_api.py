"""OpenAI-compatible request parsing and response shapes (completions and chat completions)."""

from __future__ import annotations

import secrets
import time

from engine.tokenizer import CHAT_ROLES, ChatMessage
from frontdoor.requests import GenerationRequest
from tandem.request_context import current_id
from tandem.status import InvalidArgument, NotFound

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stream", "stream_options", "stop", "seed", "n",
           "user", "min_tokens", "presence_penalty", "frequency_penalty", "logprobs"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format"}


def _number(body: dict, key: str, default, kind=float):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise InvalidArgument(f"'{key}' must be a {'integer' if kind is int else 'number'}, got {v!r}", key)
    return kind(v)


def stream_flag(body: dict) -> bool:
    """`stream` is a JSON boolean (or absent/null): "yes" or 1 is refused, not taken as true."""
    v = body.get("stream")
    if v is not None and not isinstance(v, bool):
        raise InvalidArgument(f"'stream' must be true or false, got {v!r}", "stream")
    return bool(v)


def _refuse_unsupported(body: dict) -> None:
    """Fields we accept only at the value that asks for nothing: refused otherwise, never ignored."""
    if _number(body, "n", 1, int) != 1:
        raise InvalidArgument("only n=1 is supported", "n")
    if _number(body, "best_of", 1, int) != 1:
        raise InvalidArgument("only best_of=1 is supported", "best_of")
    if body.get("echo") not in (None, False):
        raise InvalidArgument("echo is not supported; only false", "echo")
    if body.get("suffix") not in (None, ""):
        raise InvalidArgument("suffix is not supported", "suffix")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise InvalidArgument("logprobs are not supported on the OpenAI API (the Triton gRPC front door returns "
                              "them: return_log_probs)", "logprobs")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise InvalidArgument("response_format is not supported; only {\"type\": \"text\"}", "response_format")


def _common(body: dict, allowed: set[str], models: tuple[str, ...], max_tokens_default: int | None) -> dict:
    """`models`: the names this server answers to, the served name first."""
    unknown = set(body) - allowed
    if unknown:
        raise InvalidArgument(f"unsupported fields {sorted(unknown)}", sorted(unknown)[0])
    if body.get("model") is not None and body.get("model") not in models:
        raise NotFound(f"unknown model {body.get('model')!r}; this server serves {models[0]!r}", "model")
    _refuse_unsupported(body)
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, 0.0) != 0.0:
            raise InvalidArgument(f"{key} is not supported (only 0)", key)
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidArgument("'stop' must be a string or a list of strings", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidArgument(f"'seed' must be an integer, got {seed!r}", "seed")
    return dict(max_tokens=_number(body, "max_tokens", max_tokens_default, int) if body.get("max_tokens") is not None
                else max_tokens_default,
                temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
                top_k=_number(body, "top_k", 0, int), min_tokens=_number(body, "min_tokens", 0, int),
                stop=tuple(stop), seed=seed)


def completion_request(body: dict, models: tuple[str, ...], request_id: str) -> tuple[GenerationRequest, bool]:
    common = _common(body, COMPLETION_FIELDS, models, 16)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    ids = ()
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids, prompt = tuple(prompt), None
    elif not isinstance(prompt, str):
        raise InvalidArgument("'prompt' must be a string (or one list of token ids)", "prompt")
    return GenerationRequest(request_id=request_id, prompt=prompt, prompt_ids=ids, **common), \
        stream_flag(body)


def chat_request(body: dict, models: tuple[str, ...], request_id: str) -> tuple[GenerationRequest, bool]:
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
        body = dict(body, max_tokens=body["max_completion_tokens"])
    common = _common(body, CHAT_FIELDS, models, None)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise InvalidArgument(f"messages[{i}] needs a 'role' among {', '.join(CHAT_ROLES)}", "messages")
        content = m.get("content", "")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise InvalidArgument(f"messages[{i}]: only text content parts are supported", "messages")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content must be a string", "messages")
        out.append(ChatMessage(m["role"], content))
    return GenerationRequest(request_id=request_id, messages=tuple(out), **common), stream_flag(body)


def new_id(prefix: str) -> str:
    """`prefix`-<the request's id> (the client's X-Request-Id, frontdoor/request_ids.py), as vLLM names them."""
    return f"{prefix}-{current_id() or secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from a prefix cache, not computed."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(rid: str, model: str, text: str, reason: str | None, usage_: dict | None, chunk: bool) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chat_body(rid: str, model: str, text: str, reason: str | None, usage_: dict | None, chunk: bool,
              first: bool = False) -> dict:
    if chunk:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "logprobs": None}
    body = {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice]}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
