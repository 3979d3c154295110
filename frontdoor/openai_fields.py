"""Which request fields the OpenAI API door knows, and what it does with each (docs/openai-api.md is the table).

Three kinds, as vLLM treats them: *honoured* fields change the answer; *accepted* fields are read and
ignored (bookkeeping such as `user` or `store`, which change nothing about the tokens); *refused* values
are ones we cannot honour (e.g. `suffix`, or tool_choice "auto" without a tool-call parser:
openai_tools.py): a 400 naming the field and what is allowed, never a silent wrong answer. A field this
door has never heard of is accepted and ignored like vLLM does, and named in one warning per field
name for the life of the server (`UnknownFields`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from tandem.guides import Guide, GuideKind
from tandem.sampling_params import MAX_CACHE_SALT, MAX_TOP_LOGPROBS
from tandem.status import InvalidArgument

log = logging.getLogger("tandem.http")
MAX_ANSWERS = 64  # answers in one request (prompts x n): each reserves pages for its whole answer up front
# structured output: vLLM's request fields, and the keys of its `structured_outputs` object, with their kinds
_VLLM_FIELDS = {"guided_json": GuideKind.JSON_SCHEMA, "guided_regex": GuideKind.REGEX,
                "guided_choice": GuideKind.CHOICE, "guided_grammar": GuideKind.EBNF_GRAMMAR}
_STRUCTURED_KEYS = {"json": GuideKind.JSON_SCHEMA, "regex": GuideKind.REGEX, "choice": GuideKind.CHOICE,
                    "grammar": GuideKind.EBNF_GRAMMAR, "json_object": GuideKind.JSON_SCHEMA}
GUIDE_FIELDS = {"response_format", "structured_outputs", *_VLLM_FIELDS}
_OBJECT = json.dumps({"type": "object"})

_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stream",
             "stream_options", "stop", "stop_token_ids", "ignore_eos", "seed", "n", "min_tokens",
             "presence_penalty", "frequency_penalty", "logprobs", "logit_bias", "best_of", "skip_special_tokens",
             "include_stop_str_in_output", "bad_words", "allowed_token_ids", "truncate_prompt_tokens",
             "add_special_tokens", "use_beam_search", "priority", "spaces_between_special_tokens", "prompt_logprobs",
             "return_token_ids", "return_tokens_as_token_ids", "cache_salt", *GUIDE_FIELDS}
_BOOKKEEPING = {"user", "metadata", "store", "service_tier"}  # accepted, ignored: they change no token
COMPLETION_FIELDS = _SAMPLING | _BOOKKEEPING | {"prompt", "echo", "suffix"}
CHAT_FIELDS = _SAMPLING | _BOOKKEEPING | {"messages", "max_completion_tokens", "top_logprobs",
                                          "tools", "tool_choice", "parallel_tool_calls", "functions",
                                          "function_call", "modalities", "add_generation_prompt",
                                          "continue_final_message", "chat_template_kwargs",
                                          "documents", "echo"}


class UnknownFields:
    """Names each unknown field once in a warning, however many requests carry it."""

    def __init__(self, logger: logging.Logger = log):
        self.seen: set[str] = set()
        self.log = logger

    def note(self, names: Iterable[str], endpoint: str) -> None:
        for name in sorted(set(names) - self.seen):
            self.seen.add(name)
            self.log.warning("%s: ignoring unknown request field %r (accepted, as vLLM does; named once)",
                             endpoint, name)


def unknown_fields(body: dict, allowed: set[str]) -> list[str]:
    return sorted(set(body) - allowed)


def refuse_unsupported(body: dict) -> None:
    """Values we cannot honour: refused with what is allowed, never silently ignored."""
    if body.get("suffix") not in (None, ""):
        raise InvalidArgument("suffix (insertion) is not supported; send the text to complete as the prompt",
                              "suffix")
    if body.get("functions") not in (None, []):
        raise InvalidArgument("functions (the deprecated tool calling) is not supported; send 'tools' with "
                              "tool_choice \"required\" or a named function", "functions")
    if body.get("function_call") not in (None, "none", "auto"):
        raise InvalidArgument("function_call must be \"none\" or \"auto\" (there are no functions here)",
                              "function_call")
    if body.get("modalities") not in (None, ["text"]):
        raise InvalidArgument("modalities: only [\"text\"] is supported", "modalities")
    if body.get("use_beam_search") not in (None, False):
        raise InvalidArgument("use_beam_search: beam search is not supported; every answer is sampled (or greedy "
                              "with temperature 0)", "use_beam_search")
    boolean(body, "spaces_between_special_tokens", True)  # checked; no effect, as in vLLM with a fast tokenizer


def truncate_prompt_tokens(body: dict) -> int | None:
    """vLLM's `truncate_prompt_tokens`: keep the prompt's last k tokens (k >= 1), or -1: the model's
    context; None: no truncation."""
    k = number(body, "truncate_prompt_tokens", None, int)
    if k is not None and not (k == -1 or k >= 1):
        raise InvalidArgument(f"'truncate_prompt_tokens' must be an integer >= 1 (keep the prompt's last that many "
                              f"tokens) or -1 (the model's context), got {k}", "truncate_prompt_tokens")
    return k


MAX_DOCUMENTS = 256
_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception")


def cache_salt(body: dict) -> str:
    """vLLM's `cache_salt`: a non-empty string (at most MAX_CACHE_SALT characters) or null; the request
    shares cached prefix pages only with requests that give the same one ("" when none is given)."""
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT:
        raise InvalidArgument(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT} characters "
                              f"or null, got {salt!r:.80}", "cache_salt")
    return salt


def prompt_logprobs(body: dict) -> int | None:
    """vLLM's `prompt_logprobs`: every prompt token after the first reported with its logprob, its rank and
    k alternatives (0..20); None when not asked. Not with `stream`, as vLLM."""
    k = number(body, "prompt_logprobs", None, int)
    if k is None:
        return None
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"'prompt_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}] or null, got {k} "
                              f"(-1, the whole vocabulary, is not served)", "prompt_logprobs")
    if body.get("stream") is True:
        raise InvalidArgument("prompt_logprobs are not available when stream is true (as in vLLM): send the "
                              "request without streaming", "prompt_logprobs")
    return k


def chat_template_kwargs(body: dict) -> dict:
    """vLLM's `chat_template_kwargs`: more variables for the chat template (e.g. Qwen 3's
    `enable_thinking`), over vLLM's `documents` (the template's `documents`: a list of objects of
    strings, e.g. title and text, for a model that shows them for retrieval-augmented answers). The
    variables the request sets itself stay the request's."""
    v = body.get("chat_template_kwargs")
    docs = body.get("documents")
    if docs is not None and (not isinstance(docs, list) or len(docs) > MAX_DOCUMENTS or not all(
            isinstance(d, dict) and all(isinstance(t, str) for t in d.values()) for d in docs)):
        raise InvalidArgument(f"'documents' must be a list of at most {MAX_DOCUMENTS} objects whose values are strings "
                              f"(e.g. {{\"title\": ..., \"text\": ...}})", "documents")
    if v is None:
        return {"documents": docs} if docs is not None else {}
    if not isinstance(v, dict):
        raise InvalidArgument("'chat_template_kwargs' must be an object of template variables", "chat_template_kwargs")
    if taken := sorted(set(v) & set(_TEMPLATE_OWN)):
        raise InvalidArgument(f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields "
                              f"(messages, tools, add_generation_prompt) give those", "chat_template_kwargs")
    return ({"documents": docs} if docs is not None else {}) | v


def answers_per_prompt(body: dict) -> int:
    """`n`: answers per prompt, 1..MAX_ANSWERS. `best_of` may only repeat it: every sample drawn is
    returned, none is ranked away."""
    n = number(body, "n", 1, int)
    if not 1 <= n <= MAX_ANSWERS:
        raise InvalidArgument(f"'n' must be an integer in [1, {MAX_ANSWERS}], got {n}", "n")
    best = number(body, "best_of", None, int)
    if best is not None and best != n:
        raise InvalidArgument(f"'best_of' must be null or equal n ({n}): this server returns every answer it "
                              f"samples and ranks none away, got {best}", "best_of")
    return n


def boolean(body: dict, key: str, default: bool = False) -> bool:
    """A JSON boolean (or null/absent: the default); anything else is refused, "yes" included."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidArgument(f"'{key}' must be a boolean (true or false), got {v!r}", key)
    return v


def number(body: dict, key: str, default, kind=float):
    """A JSON number (an integer when kind is int), or null/absent: the default."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise InvalidArgument(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {v!r}", key)
    return kind(v)


def tools(body: dict) -> tuple[dict, ...]:
    """The tool definitions, shown to the chat template (openai_tools.py reads what they may be called with)."""
    v = body.get("tools") or []
    if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
        raise InvalidArgument("'tools' must be a list of tool objects", "tools")
    return tuple(v)


def logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: an object mapping token ids (as decimal strings) to numbers, as (id, bias)
    pairs by id; the ranges are SamplingParams' to check (and the vocabulary the request's)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict) or not all(isinstance(k, str) and k.isdecimal() for k in v):
        raise InvalidArgument(f"'logit_bias' must map token ids (as strings, e.g. \"50256\") to numbers in "
                              f"[-100, 100], got {v!r}"[:300], "logit_bias")
    return tuple(sorted((int(k), b) for k, b in v.items()))


def bad_words(body: dict) -> tuple[str, ...]:
    """vLLM's `bad_words`: texts the answer never contains, each banned as written alone and after a
    space (its token ids differ at the start of a text and inside one)."""
    v = body.get("bad_words")
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(w, str) and w.strip() for w in v):
        raise InvalidArgument(f"'bad_words' must be a list of non-empty strings, got {v!r}"[:300], "bad_words")
    return tuple(dict.fromkeys(form for w in v for form in (w.lstrip(), " " + w.lstrip())))


def token_ids(body: dict, key: str, nonempty: bool = False) -> tuple[int, ...]:
    """A list of token ids, or null/absent: (); `nonempty`: a list given must hold one at least."""
    v = body.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise InvalidArgument(f"'{key}' must be a list of token ids (integers), got {v!r}"[:300], key)
    if nonempty and not v:
        raise InvalidArgument(f"'{key}' must name one token at least (or be left out)", key)
    return tuple(v)


# -- structured output: OpenAI's `response_format` and vLLM's guided fields, as one Guide (tandem/guides.py);
# whether it compiles is checked where the request is prepared (control/requests.py), for every door alike

def guide(body: dict) -> Guide | None:
    """The request's guide, or None for free text. Refused (400 naming the field): a malformed value,
    or more than one way of asking."""
    found = [g for g in (_response_format(body.get("response_format")), _structured(body.get("structured_outputs")),
                         *(_vllm(name, body.get(name)) for name in _VLLM_FIELDS)) if g is not None]
    if len(found) > 1:
        raise InvalidArgument(f"send one structured-output request, not {len(found)}: response_format, "
                              f"structured_outputs or one guided_* field", "response_format")
    return found[0] if found else None


def _response_format(v) -> Guide | None:
    """OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}."""
    if v is None or v == {"type": "text"}:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "json_object":
        return Guide(GuideKind.JSON_SCHEMA, _OBJECT)
    if kind == "json_schema":
        spec = v.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidArgument("response_format json_schema needs \"json_schema\": {\"name\": ..., \"schema\": "
                                  "{a JSON schema object}}", "response_format")
        return _made(GuideKind.JSON_SCHEMA, json.dumps(schema), "response_format")
    raise InvalidArgument("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                          "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}, "
                          f"got {v!r}"[:300], "response_format")


def _structured(v) -> Guide | None:
    """vLLM's `structured_outputs` object: exactly one of json, regex, choice, grammar, json_object."""
    if v is None:
        return None
    keys = [k for k in _STRUCTURED_KEYS if isinstance(v, dict) and v.get(k) not in (None, False)]
    if len(keys) != 1:
        raise InvalidArgument(f"structured_outputs must set exactly one of {', '.join(_STRUCTURED_KEYS)}",
                              "structured_outputs")
    if keys[0] == "json_object":
        return Guide(GuideKind.JSON_SCHEMA, _OBJECT)
    return _vllm(f"structured_outputs.{keys[0]}", v[keys[0]], _STRUCTURED_KEYS[keys[0]])


def _vllm(name: str, v, kind: GuideKind | None = None) -> Guide | None:
    """One of vLLM's guided fields: a schema (an object, or its JSON text), a regex, a list of choices
    or a GBNF grammar."""
    if v is None:
        return None
    kind = kind or _VLLM_FIELDS[name]
    if kind is GuideKind.JSON_SCHEMA and isinstance(v, dict):
        v = json.dumps(v)
    elif kind is GuideKind.CHOICE:
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise InvalidArgument(f"'{name}' must be a list of strings", name)
        v = json.dumps(v)
    elif not isinstance(v, str):
        wanted = "a JSON schema (an object)" if kind is GuideKind.JSON_SCHEMA else "a string"
        raise InvalidArgument(f"'{name}' must be {wanted}, got {type(v).__name__}", name)
    return _made(kind, v, name)


def _made(kind: GuideKind, text: str, name: str) -> Guide:
    """Guide(kind, text), its refusal naming the request's field `name`."""
    try:
        return Guide(kind, text)
    except InvalidArgument as e:
        raise InvalidArgument(str(e), name.split(".")[0]) from None
