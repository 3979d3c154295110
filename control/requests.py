"""A generation request as both front doors describe it, and its validation at the edge.

Validation happens once, here, before any worker is involved: the prompt is tokenized, checked
against the context and the request's size limits, and the sampling parameters are checked by their
own type (tandem/sampling_params.py). A bad request is an InvalidArgument naming the problem (gRPC
INVALID_ARGUMENT, HTTP 400). Tokenizing is CPU work: the service runs `prepare` off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from control.adapters import Adapters
from engine.guided import Guides, guides_for
from engine.tokenizer import ChatMessage, Tokenizer
from tandem.guides import Guide
from tandem.sampling_params import SamplingParams
from tandem.status import InvalidArgument

# Pages are reserved for the whole answer up front, so an unbounded default would reserve the rest of
# the context for every chat request; OpenAI-style requests without max_tokens get this many at most.
DEFAULT_MAX_TOKENS = 1024


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] = ()
    tools: tuple[dict, ...] = ()  # tool definitions shown to the chat template (chat requests only)
    add_generation_prompt: bool = True  # chat: the template opens the assistant's turn (vLLM's field)
    continue_final_message: bool = False  # chat: the final message is left open and continued (vLLM's field)
    template_kwargs: dict = field(default_factory=dict)  # chat: more chat-template variables (vLLM's field)
    add_special_tokens: bool | None = None  # the tokenizer adds its special tokens (a BOS) to the prompt text;
    # None: as vLLM does, yes to a text prompt, no to a chat (its template writes any it wants)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the context) (vLLM's field)
    drop_oldest_turns: bool = False  # chat: drop the oldest turns until the prompt fits (Responses' truncation auto)
    prompt_ids: tuple[int, ...] = ()
    max_tokens: int | None = 16  # None: up to default_max_tokens, within the context
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # (the model's generation config may say another)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    end_id: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token (with logprobs)
    prompt_logprobs: bool = False  # the prompt's own logprobs too (OpenAI echo with logprobs)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias): SamplingParams.logit_bias
    guide: Guide | None = None  # structured output: the grammar the answer follows (tandem/guides.py)
    bad_words: tuple[str, ...] = ()  # texts the answer never contains, each tokenized as it is given
    allowed_token_ids: tuple[int, ...] = ()  # the only tokens the answer may hold (vLLM's); () = any
    cache_salt: str = ""  # cached prefix pages are shared only among requests with the same salt (vLLM's)
    priority: int = 0  # lower waits less for a pass (vLLM's); non-zero needs Limits.priority_scheduling
    exclude_input: bool = True  # False: the answer starts with its input (prepare: Prepared.echo)
    skip_special_tokens: bool = True  # False: the answer's text keeps special tokens (vLLM's field)
    include_stop_str_in_output: bool = False  # True: the text ends with the stop string that ended it (vLLM's)
    prompt_only: bool = False  # the answer shows no generated token (an echoed prompt scored: max_tokens 0)
    timeout_s: float | None = None  # the client's own deadline for this request (None: the deployment's)
    model: str | None = None  # the name the request asked for: a LoRA adapter's is answered with it (Limits.adapters)
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Prepared:
    """A validated request: token ids and concrete sampling parameters (with a seed if sampling)."""

    request: GenerationRequest
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int] = frozenset()  # tokens that end the answer: the model's ends (unless ignored), stop ids
    truncated: bool = False  # prompt_ids are the prompt's last tokens only (truncate_prompt_tokens)
    echo: str = ""  # the text the answer starts with (_echo)

    def shown(self, token: int, finish_reason: str | None) -> bool:
        """Whether generated `token` belongs in the answer. A token that ended the answer by being an end
        or stop token does not, unless the request keeps its stop (as vLLM renders them); none does in
        a prompt-only answer."""
        req = self.request
        ended_by_it = finish_reason == "stop" and token in self.stop_ids and not req.include_stop_str_in_output
        return not (req.prompt_only or ended_by_it)


@dataclass(frozen=True)
class Limits:
    max_context: int
    vocab_size: int
    max_prompt_chars: int = 1 << 20  # refused before tokenizing: a 10 MB prompt never reaches the tokenizer
    end_ids: tuple[int, ...] = ()  # the tokens the model's answers end with (engine.tokenizer.Tokenizer.end_ids)
    adapters: Adapters = field(default_factory=Adapters)  # LoRA adapters a request's `model` may name
    priority_scheduling: bool = False  # the server honours priorities (`scheduling_policy: priority`)

    def check_chars(self, chars: int) -> None:
        """Refuse text of more characters than this server tokenizes."""
        if chars > self.max_prompt_chars:
            raise InvalidArgument(f"prompt has {chars} characters; this server takes at most {self.max_prompt_chars}",
                                  "prompt")

    def check_ids(self, ids, param: str) -> None:
        """Refuse token ids outside the vocabulary, naming the field `param` that holds them."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}", param)


def prepare(req: GenerationRequest, tokenizer: Tokenizer, limits: Limits) -> Prepared:
    if req.priority and not limits.priority_scheduling:  # vLLM refuses it too unless started with priority scheduling
        raise InvalidArgument("priority: this server serves requests first come, first served; only 0 is accepted "
                              "(start it with --scheduling-policy priority to honour priorities)", "priority")
    ids = prompt_ids(req, tokenizer, limits)
    max_context = limits.max_context
    if req.drop_oldest_turns and not _fits(ids, req, max_context):
        ids = _fitted_turns(req, ids, tokenizer, max_context)
    keep = max_context if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
    truncated = keep is not None and len(ids) > keep
    if truncated:  # the prompt's last `keep` tokens, as vLLM truncates
        ids = ids[-keep:]
    if len(ids) >= max_context:
        raise InvalidArgument(f"prompt has {len(ids)} tokens but the model's context is {max_context}; "
                              f"shorten it to at most {max_context - 1} tokens", "prompt")
    max_tokens = req.max_tokens if req.max_tokens is not None else min(req.default_max_tokens, max_context - len(ids))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidArgument(f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    if len(ids) + max_tokens > max_context:
        raise InvalidArgument(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                              f"of {max_context}; ask for at most {max_context - len(ids)} tokens", "max_tokens")
    params = SamplingParams(max_tokens=max_tokens, temperature=float(req.temperature), top_k=req.top_k,
                            top_p=float(req.top_p), seed=req.seed, stop=tuple(req.stop), min_tokens=req.min_tokens,
                            logprobs=req.logprobs, top_logprobs=req.top_logprobs,
                            prompt_logprobs=req.prompt_logprobs, min_p=float(req.min_p),
                            repetition_penalty=float(req.repetition_penalty), ignore_eos=req.ignore_eos,
                            presence_penalty=float(req.presence_penalty),
                            frequency_penalty=float(req.frequency_penalty),
                            stop_token_ids=tuple(req.stop_token_ids), logit_bias=tuple(req.logit_bias), guide=req.guide,
                            bad_words=_bad_words(req.bad_words, tokenizer),
                            allowed_token_ids=tuple(sorted(set(req.allowed_token_ids))), cache_salt=req.cache_salt,
                            priority=req.priority, extra_eos=(req.end_id,) if req.end_id is not None else (),
                            lora=limits.adapters.key_of(req.model)).with_seed()
    limits.check_ids([t for t, _ in params.logit_bias], "logit_bias")
    limits.check_ids(params.allowed_token_ids, "allowed_token_ids")
    if params.guide is not None:  # compiled here once, so a bad schema is the client's 400, never a worker's fault
        guides(tokenizer, limits).check(params.guide)
    ends = () if params.ignore_eos else (*limits.end_ids, *params.extra_eos)
    return Prepared(req, ids, params, frozenset((*ends, *params.stop_token_ids)), truncated,
                    _echo(req, ids, truncated, tokenizer))


def _fits(ids: list[int], req: GenerationRequest, max_context: int) -> bool:
    """Whether the prompt leaves the context room for the answer: its max_tokens, or at least one token."""
    return len(ids) + (req.max_tokens or 1) <= max_context


def _fitted_turns(req: GenerationRequest, whole: list[int], tokenizer: Tokenizer, max_context: int) -> list[int]:
    """The prompt ids of the chat (`whole`: all of it) without its oldest turns, as few dropped as make
    it fit (OpenAI's truncation "auto"). The leading system messages stay; a turn begins at a user
    message, so a tool's answer is never kept without the call it answers. Where even the last turn
    alone does not fit, that shortest prompt's ids (prepare then refuses it, naming its length)."""
    messages = req.messages
    head = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    cuts = [i for i in range(head + 1, len(messages)) if messages[i].role == "user"]

    def ids(cut: int) -> list[int]:
        kept = [*messages[:head], *messages[cut:]]
        return tokenizer.encode_chat(kept, list(req.tools) or None, req.add_generation_prompt,
                                     req.continue_final_message, req.template_kwargs, bool(req.add_special_tokens))
    lo, hi = 0, len(cuts) - 1  # fewer tokens the later the cut: the earliest cut that fits, by bisection
    if not cuts:
        return whole
    best = ids(cuts[-1])
    if not _fits(best, req, max_context):
        return best
    while lo < hi:
        mid = (lo + hi) // 2
        got = ids(cuts[mid])
        if _fits(got, req, max_context):
            hi, best = mid, got
        else:
            lo = mid + 1
    return best


def _echo(req: GenerationRequest, ids: list[int], truncated: bool, tokenizer: Tokenizer) -> str:
    """The text an answer starts with: none when the request excludes its input; a chat's final message
    when it is the assistant's, the turn the answer continues (vLLM's chat echo); else the prompt (its
    ids decoded when it was given as ids or cut by truncate_prompt_tokens)."""
    if req.exclude_input:
        return ""
    if req.messages:
        return req.messages[-1].content if req.messages[-1].role == "assistant" else ""
    if req.prompt is not None and not truncated:
        return req.prompt
    return tokenizer.decode(ids)


def guides(tokenizer: Tokenizer, limits: Limits) -> Guides:
    """The guide compiler of this model's tokenizer and vocabulary (engine/guided.py), one per process."""
    return guides_for(tokenizer.file, limits.vocab_size, tuple(sorted(limits.end_ids)))


def _bad_words(words: tuple[str, ...], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids, as the tokenizer writes the text alone (no special tokens), once each."""
    if not all(isinstance(w, str) and w for w in words):
        raise InvalidArgument("bad_words must be non-empty strings", "bad_words")
    return tuple(dict.fromkeys(tuple(tokenizer.encode(w, add_special_tokens=False)) for w in words))


def prompt_ids(req: GenerationRequest, tokenizer: Tokenizer, limits: Limits) -> list[int]:
    """The ids the request's prompt (text, ids or chat with its tools) is, before any truncation."""
    limits.check_chars(len(req.prompt or "") + sum(len(m.content) for m in req.messages))
    if req.messages:
        if not any(m.content for m in req.messages):
            raise InvalidArgument("messages are empty; send at least one message with content", "messages")
        # an InvalidRequest from the template names the problem
        ids = tokenizer.encode_chat(list(req.messages), list(req.tools) or None, req.add_generation_prompt,
                                    req.continue_final_message, req.template_kwargs, bool(req.add_special_tokens))
    elif req.prompt_ids:
        ids = list(req.prompt_ids)
        limits.check_ids(ids, "prompt")
    else:
        if not req.prompt:
            raise InvalidArgument("prompt is empty; send the text to complete", "prompt")
        ids = tokenizer.encode(req.prompt, req.add_special_tokens is not False)
    if not ids:
        raise InvalidArgument("prompt is empty after tokenization", "prompt")
    return ids
