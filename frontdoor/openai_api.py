"""OpenAI-compatible request parsing and response shapes (completions and chat completions)."""

from __future__ import annotations

import secrets
import time

from engine.tokenizer import CHAT_ROLES, ChatMessage
from frontdoor.openai_fields import (CHAT_FIELDS, COMPLETION_FIELDS, UnknownFields, boolean, number,
                                     refuse_unsupported, token_ids, tools, unknown_fields)
from control.requests import GenerationRequest
from tandem.request_context import current_id
from tandem.sampling_params import MAX_TOP_LOGPROBS
from tandem.status import InvalidArgument, NotFound


def _common(body: dict, allowed: set[str], models: tuple[str, ...], max_tokens_default: int | None,
            unknown: UnknownFields | None, endpoint: str) -> dict:
    """The fields both endpoints share, checked by type. `models`: the names this server answers to,
    the served name first. Unknown fields are ignored and named once through `unknown`."""
    extra = unknown_fields(body, allowed)
    if extra and unknown is not None:
        unknown.note(extra, endpoint)
    if body.get("model") is not None and body.get("model") not in models:
        raise NotFound(f"unknown model {body.get('model')!r}: the model does not exist; this server serves "
                       f"{models[0]!r}")
    refuse_unsupported(body)
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidArgument("'stop' must be a string or a list of strings", "stop")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise InvalidArgument(f"'stream_options' must be an object, got {opts!r}", "stream_options")
    boolean(opts or {}, "include_usage")
    return dict(max_tokens=number(body, "max_tokens", max_tokens_default, int),
                temperature=number(body, "temperature", 1.0), top_p=number(body, "top_p", 1.0),
                top_k=number(body, "top_k", 0, int), min_p=number(body, "min_p", 0.0),
                repetition_penalty=number(body, "repetition_penalty", 1.0),
                presence_penalty=number(body, "presence_penalty", 0.0),
                frequency_penalty=number(body, "frequency_penalty", 0.0),
                min_tokens=number(body, "min_tokens", 0, int), stop=tuple(stop), seed=number(body, "seed", None, int),
                stop_token_ids=token_ids(body, "stop_token_ids"), ignore_eos=boolean(body, "ignore_eos"))


def completion_request(body: dict, models: tuple[str, ...], request_id: str,
                       unknown: UnknownFields | None = None) -> tuple[GenerationRequest, bool]:
    """/v1/completions. `logprobs` is an integer here (alternatives per token, 0..20, or null: none);
    `echo` repeats the prompt before the answer (with the prompt's logprobs when logprobs is set)."""
    common = _common(body, COMPLETION_FIELDS, models, 16, unknown, "/v1/completions")
    top = number(body, "logprobs", None, int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}] or null, got {top}",
                              "logprobs")
    echo = boolean(body, "echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    ids = ()
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids, prompt = tuple(prompt), None
    elif not isinstance(prompt, str):
        raise InvalidArgument("'prompt' must be a string, or one list of token ids (one prompt per request)",
                              "prompt")
    req = GenerationRequest(request_id=request_id, prompt=prompt, prompt_ids=ids, logprobs=top is not None,
                            top_logprobs=top or 0, prompt_logprobs=echo and top is not None,
                            exclude_input=not echo, **common)
    return req, boolean(body, "stream")


def chat_request(body: dict, models: tuple[str, ...], request_id: str,
                 unknown: UnknownFields | None = None) -> tuple[GenerationRequest, bool]:
    """/v1/chat/completions. `logprobs` is a boolean here, `top_logprobs` (0..20) needs it true."""
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
        body = dict(body, max_tokens=body["max_completion_tokens"])
    common = _common(body, CHAT_FIELDS, models, None, unknown, "/v1/chat/completions")
    want = boolean(body, "logprobs")
    top = number(body, "top_logprobs", 0, int)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top}",
                              "top_logprobs")
    if top and not want:
        raise InvalidArgument("'top_logprobs' needs \"logprobs\": true", "top_logprobs")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("'messages' must be a non-empty list", "messages")
    req = GenerationRequest(request_id=request_id, messages=tuple(_message(i, m) for i, m in enumerate(messages)),
                            tools=tools(body), logprobs=want, top_logprobs=top, **common)
    return req, boolean(body, "stream")


def _message(i: int, m) -> ChatMessage:
    if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
        raise InvalidArgument(f"messages[{i}] needs a 'role' among {', '.join(CHAT_ROLES)}", "messages")
    content = m.get("content") or ""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise InvalidArgument(f"messages[{i}]: only text content parts are supported", "messages")
        content = "".join(p.get("text", "") for p in content)
    if not isinstance(content, str):
        raise InvalidArgument(f"messages[{i}].content must be a string", "messages")
    return ChatMessage(m["role"], content)


def new_id(prefix: str) -> str:
    """`prefix`-<the request's id> (the client's X-Request-Id, frontdoor/request_ids.py), as vLLM names them."""
    return f"{prefix}-{current_id() or secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from a prefix cache, not computed."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(rid: str, model: str, text: str, reason: str | None, usage_: dict | None, chunk: bool,
                    logprobs: dict | None = None) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chat_body(rid: str, model: str, text: str, reason: str | None, usage_: dict | None, chunk: bool,
              first: bool = False, logprobs: dict | None = None) -> dict:
    if chunk:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "logprobs": logprobs}
    body = {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice]}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
