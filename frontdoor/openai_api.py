"""OpenAI-compatible request parsing and response shapes (completions and chat completions)."""

from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass

from engine.tokenizer import CHAT_ROLES, ChatMessage
from frontdoor.openai_fields import (CHAT_FIELDS, COMPLETION_FIELDS, MAX_ANSWERS, UnknownFields,
                                     answers_per_prompt, bad_words, boolean, cache_salt, chat_template_kwargs, guide,
                                     logit_bias, number, prompt_logprobs, refuse_unsupported, token_ids, tools,
                                     truncate_prompt_tokens, unknown_fields)
from frontdoor.openai_tokens import Shown
from frontdoor.openai_tools import ToolChoice, tool_choice
from frontdoor.tool_parsers import KEEPS_SPECIAL_TOKENS
from control.requests import DEFAULT_MAX_TOKENS, GenerationRequest
from tandem.request_context import current_id
from tandem.sampling_params import MAX_SEED, MAX_TOP_LOGPROBS
from tandem.status import InvalidArgument, NotFound


def _common(body: dict, allowed: set[str], models: tuple[str, ...], max_tokens_default: int | None,
            unknown: UnknownFields | None, endpoint: str, defaults: dict | None) -> dict:
    """The fields both endpoints share, checked by type. `models`: the names this server answers to,
    the served name first. Unknown fields are ignored and named once through `unknown`. `defaults`: the
    model's sampling defaults of fields the request leaves out (frontdoor/generation_defaults.py)."""
    model = defaults or {}
    extra = unknown_fields(body, allowed)
    if extra and unknown is not None:
        unknown.note(extra, endpoint)
    if body.get("model") is not None and body.get("model") not in models:
        raise unknown_model(body.get("model"), models)
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
    boolean(opts or {}, "continuous_usage_stats")
    return dict(max_tokens=number(body, "max_tokens", max_tokens_default, int),
                default_max_tokens=model.get("max_tokens", DEFAULT_MAX_TOKENS),
                temperature=number(body, "temperature", model.get("temperature", 1.0)),
                top_p=number(body, "top_p", model.get("top_p", 1.0)),
                top_k=number(body, "top_k", model.get("top_k", 0), int),
                min_p=number(body, "min_p", model.get("min_p", 0.0)),
                repetition_penalty=number(body, "repetition_penalty", model.get("repetition_penalty", 1.0)),
                presence_penalty=number(body, "presence_penalty", 0.0),
                frequency_penalty=number(body, "frequency_penalty", 0.0),
                min_tokens=number(body, "min_tokens", 0, int), stop=tuple(stop), seed=number(body, "seed", None, int),
                stop_token_ids=token_ids(body, "stop_token_ids"), ignore_eos=boolean(body, "ignore_eos"),
                logit_bias=logit_bias(body), skip_special_tokens=boolean(body, "skip_special_tokens", True),
                include_stop_str_in_output=boolean(body, "include_stop_str_in_output"), guide=guide(body),
                bad_words=bad_words(body), allowed_token_ids=token_ids(body, "allowed_token_ids", nonempty=True),
                truncate_prompt_tokens=truncate_prompt_tokens(body), cache_salt=cache_salt(body),
                priority=number(body, "priority", 0, int), model=body.get("model"))


def completion_request(body: dict, models: tuple[str, ...], request_id: str, unknown: UnknownFields | None = None,
                       defaults: dict | None = None) -> Parsed:
    """/v1/completions: one request per answer, in the order of the reply's choices (prompt by prompt,
    `n` each). `logprobs` is an integer here (alternatives per token, 0..20, or null: none); `echo`
    repeats the prompt before the answer (with the prompt's logprobs when logprobs is set), and with
    `max_tokens` 0 the answer is the prompt alone: scored, nothing generated shown."""
    common = _common(body, COMPLETION_FIELDS, models, 16, unknown, "/v1/completions", defaults)
    top = number(body, "logprobs", None, int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}] or null, got {top}",
                              "logprobs")
    echo, scored = boolean(body, "echo"), prompt_logprobs(body)
    if echo and common["max_tokens"] == 0:  # the prompt scored, nothing generated (OpenAI's legacy scoring call)
        common.update(max_tokens=1, prompt_only=True)
    reqs = [GenerationRequest(request_id=request_id, prompt=text, prompt_ids=ids, logprobs=top is not None,
                              top_logprobs=max(top or 0, scored or 0),
                              prompt_logprobs=(echo and top is not None) or scored is not None,
                              exclude_input=not echo, add_special_tokens=boolean(body, "add_special_tokens", None),
                              **common) for text, ids in _prompts(body.get("prompt"))]
    return _parsed(reqs, answers_per_prompt(body), boolean(body, "stream"),
                   shown=_shown(body, top or 0, scored, echo and top is not None))


def _prompts(prompt) -> list[tuple[str | None, tuple[int, ...]]]:
    """The prompts of /v1/completions as (text, ()) or (None, token ids): `prompt` is a string, a list
    of token ids, or a non-empty list of strings and lists of token ids (a batch)."""
    if isinstance(prompt, str) or _is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or _is_ids(p) for p in prompt):
        raise InvalidArgument("'prompt' must be a string, a list of token ids, or a non-empty list of strings "
                              "or of token-id lists (a batch)", "prompt")
    return [(p, ()) if isinstance(p, str) else (None, tuple(p)) for p in prompt]


def _is_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


@dataclass(frozen=True)
class Parsed:
    """One OpenAI request as the door serves it: a request per answer, in the order of the reply's
    choices (answer j of prompt i is choice i * n + j), `n` answers per prompt, streamed or not."""

    answers: tuple[GenerationRequest, ...]
    n: int
    stream: bool
    tools: ToolChoice | None = None  # the answers are calls of these tools (chat: openai_tools.py)
    shown: Shown = Shown()

    def usage(self, counts: list[tuple[int, int, int]]) -> dict:
        """The reply's usage from (prompt, completion, cached) tokens per choice: each prompt counts
        once (as its first answer saw it), every answer's completion counts."""
        firsts = counts[::self.n]
        return usage(sum(c[0] for c in firsts), sum(c[1] for c in counts), sum(c[2] for c in firsts))


def _parsed(reqs: list[GenerationRequest], n: int, stream: bool, tools: ToolChoice | None = None,
            shown: Shown = Shown()) -> Parsed:
    """`n` answers of each request. Answer j samples with the request's seed + j (mod 2**64) when it
    has one, so each choice is the answer a single request with that seed gets; without a seed each
    draws its own."""
    if len(reqs) * n > MAX_ANSWERS:
        raise InvalidArgument(f"{len(reqs)} prompts x n={n} asks for {len(reqs) * n} answers; one request "
                              f"takes at most {MAX_ANSWERS}", "n" if n > 1 else "prompt")
    if len(reqs) * n > 1:
        reqs = [dataclasses.replace(r, request_id=f"{r.request_id}-{i * n + j}", seed=_nth_seed(r.seed, j))
                for i, r in enumerate(reqs) for j in range(n)]
    return Parsed(tuple(reqs), n, stream, tools, shown)


def _nth_seed(seed: int | None, j: int) -> int | None:
    """Answer j's seed; one out of range stays as it is, for preparation to refuse."""
    return (seed + j) % MAX_SEED if seed is not None and 0 <= seed < MAX_SEED else seed


def chat_request(body: dict, models: tuple[str, ...], request_id: str, unknown: UnknownFields | None = None,
                 tool_parser: str | None = None, defaults: dict | None = None) -> Parsed:
    """/v1/chat/completions: `n` requests, one per answer. `logprobs` is a boolean here, `top_logprobs`
    (0..20) needs it true. `tool_parser`: the deployment's tool-call parser (tool_choice "auto");
    `defaults`: the model's sampling defaults (frontdoor/generation_defaults.py)."""
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
        body = dict(body, max_tokens=body["max_completion_tokens"])
    common = _common(body, CHAT_FIELDS, models, None, unknown, "/v1/chat/completions", defaults)
    want = boolean(body, "logprobs")
    top = number(body, "top_logprobs", 0, int)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top}",
                              "top_logprobs")
    if top and not want:
        raise InvalidArgument("'top_logprobs' needs \"logprobs\": true", "top_logprobs")
    shown = tools(body)
    calls = tool_choice(body, shown, tool_parser)
    if calls is not None and calls.guide is not None:
        if common["guide"] is not None:
            raise InvalidArgument("a tool call is already structured output: send tool_choice or response_format "
                                  "(or a guided_* field), not both", "tool_choice")
        common["guide"] = calls.guide
    if calls is not None and calls.guide is None and calls.parser in KEEPS_SPECIAL_TOKENS:
        common["skip_special_tokens"] = False  # "auto" reads call markers that are special tokens
    echo = boolean(body, "echo")  # vLLM's: the answer starts with the final message when it is the assistant's
    if echo and calls is not None:
        raise InvalidArgument("echo and tool calls exclude each other (the echoed text would be read as the "
                              "answer's calls): send one of them", "echo")
    scored = prompt_logprobs(body)
    req = GenerationRequest(request_id=request_id, messages=messages_of(body), tools=shown, logprobs=want,
                            exclude_input=not echo,
                            top_logprobs=max(top, scored or 0), prompt_logprobs=scored is not None,
                            add_generation_prompt=boolean(body, "add_generation_prompt", True),
                            continue_final_message=boolean(body, "continue_final_message"),
                            add_special_tokens=boolean(body, "add_special_tokens", None),
                            template_kwargs=chat_template_kwargs(body), **common)
    return _parsed([req], answers_per_prompt(body), boolean(body, "stream"), calls, _shown(body, top, scored))


def _shown(body: dict, top: int, scored: int | None, echo: bool = False) -> Shown:
    return Shown(top, scored, echo, token_ids=boolean(body, "return_token_ids"),
                 as_ids=boolean(body, "return_tokens_as_token_ids"))


def messages_of(body: dict) -> tuple[ChatMessage, ...]:
    """A chat request's `messages`: a non-empty list of {"role", "content"} (content text, or text parts)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("'messages' must be a non-empty list", "messages")
    return tuple(_message(i, m) for i, m in enumerate(messages))


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
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list) or not all(_is_call(c) for c in calls) or (calls and m["role"] != "assistant"):
        raise InvalidArgument(f"messages[{i}].tool_calls must be an assistant's list of {{\"id\", \"type\": "
                              f"\"function\", \"function\": {{\"name\", \"arguments\": a JSON string}}}}", "messages")
    call_id = m.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise InvalidArgument(f"messages[{i}].tool_call_id must be a string", "messages")
    return ChatMessage(m["role"], content, tuple(calls), call_id)


def _is_call(c) -> bool:
    fn = c.get("function") if isinstance(c, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)


def unknown_model(name, names: tuple[str, ...]) -> NotFound:
    """The 404 for a model this server does not serve (OpenAI's and vLLM's wording); `names`: those it
    serves the model as."""
    return NotFound(f"unknown model {name!r:.80}: the model does not exist; this server serves "
                    f"{' or '.join(repr(n) for n in names)}")


def new_id(prefix: str) -> str:
    """`prefix`-<the request's id> (the client's X-Request-Id, frontdoor/request_ids.py), as vLLM names them."""
    return f"{prefix}-{current_id() or secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from a prefix cache, not computed."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(rid: str, model: str, text: str, reason: str | None, usage_: dict | None, chunk: bool,
                    logprobs: dict | None = None, index: int = 0) -> dict:
    choice = {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def whole_body(shape, rid: str, model: str, choices: list[tuple[str, str | None, dict | None]], usage_: dict) -> dict:
    """A reply that is not streamed: its choices as (text, finish reason, logprobs), in order, and usage."""
    body = shape(rid, model, "", None, usage_, chunk=False)
    body["choices"] = [shape(rid, model, text, reason, None, chunk=False, logprobs=lp, index=i)["choices"][0]
                       for i, (text, reason, lp) in enumerate(choices)]
    return body


def chat_body(rid: str, model: str, text: str, reason: str | None, usage_: dict | None, chunk: bool,
              first: bool = False, logprobs: dict | None = None, index: int = 0) -> dict:
    if chunk:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
    else:
        choice = {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "logprobs": logprobs}
    body = {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice]}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
