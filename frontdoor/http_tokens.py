"""vLLM's tokenizer routes, with the served model's own tokenizer (evaluation harnesses use them as a
remote tokenizer; clients count a prompt against `max_model_len` with the ids a request would get).

    POST /tokenize       {"prompt": "text", "add_special_tokens": true}
                         {"messages": [...], "add_generation_prompt": true, "chat_template_kwargs": {}}
                         (rendered as /v1/chat/completions renders them)
                         -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize     {"tokens": [ids]}  -> {"prompt": "text"} (special tokens kept)
    GET  /tokenizer_info -> {"eos_token", "bos_token", "pad_token", "chat_template", "model_max_length", ...}
    GET  /version        -> {"version": "...", "wire": "<the message schema its workers must speak>"}

Fields are checked as the OpenAI routes check them (`model` must be this server's; an unknown field is
accepted and named once). The tokenizer runs off the event loop under admission, like a request's
preparation, and errors have OpenAI's shape.
"""

from __future__ import annotations

import functools

from aiohttp import web

import tandem
from frontdoor import openai_api as oa
from frontdoor.core import FrontDoor
from frontdoor.http_body import read_object
from frontdoor.openai_fields import UnknownFields, boolean, chat_template_kwargs, token_ids, unknown_fields
from tandem.status import InvalidArgument
from tandem.wire import WIRE

_TOKENIZE = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "continue_final_message",
             "chat_template_kwargs", "documents", "return_token_strs"}
_DETOKENIZE = {"model", "tokens"}


def add_token_routes(router, door: FrontDoor) -> None:
    api = TokenRoutes(door)
    router.add_post("/tokenize", api.tokenize)
    router.add_post("/detokenize", api.detokenize)
    router.add_get("/version", api.version)
    router.add_get("/tokenizer_info", api.tokenizer_info)


class TokenRoutes:
    def __init__(self, door: FrontDoor):
        self.served, self.service = door.served, door.service
        self.unknown = UnknownFields()

    async def tokenize(self, request):
        body = await self._read(request, _TOKENIZE, "/tokenize")
        strs, special, generation = (boolean(body, "return_token_strs"), boolean(body, "add_special_tokens", None),
                                     boolean(body, "add_generation_prompt", True))
        tok, limits = self.service.tokenizer, self.service.limits
        if body.get("messages") is not None:
            messages = oa.messages_of(body)
            limits.check_chars(sum(len(m.content) for m in messages))
            encode = functools.partial(tok.encode_chat, list(messages), None, generation,
                                       boolean(body, "continue_final_message"), chat_template_kwargs(body),
                                       bool(special))  # a chat: no BOS of the tokenizer's unless asked
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise InvalidArgument("'prompt' must be a string (or send 'messages')", "prompt")
            limits.check_chars(len(prompt))
            encode = functools.partial(tok.encode, prompt, special is not False)
        ids, texts = await self.service.off_loop(_tokenized, tok, encode, strs)
        return web.json_response({"count": len(ids), "max_model_len": limits.max_context, "tokens": ids,
                                  "token_strs": texts})

    async def detokenize(self, request):
        body = await self._read(request, _DETOKENIZE, "/detokenize")
        if body.get("tokens") is None:
            raise InvalidArgument("'tokens' is required: a list of token ids", "tokens")
        ids, limits = list(token_ids(body, "tokens")), self.service.limits
        limits.check_ids(ids, "tokens")
        if len(ids) > limits.max_prompt_chars:
            raise InvalidArgument(f"{len(ids)} tokens; this server decodes at most {limits.max_prompt_chars}",
                                  "tokens")
        text = await self.service.off_loop(self.service.tokenizer.decode, ids, False)
        return web.json_response({"prompt": text})

    async def version(self, request):
        return web.json_response({"version": tandem.__version__, "wire": WIRE})  # wire: the workers' must match

    async def tokenizer_info(self, request):
        tok = self.service.tokenizer
        return web.json_response({"tokenizer_class": "Tokenizer", "eos_token": tok.eos_token,
                                  "bos_token": tok.bos_token, "pad_token": tok.pad_token,
                                  "chat_template": tok.chat_template,
                                  "model_max_length": self.service.limits.max_context})

    async def _read(self, request, allowed: set[str], route: str) -> dict:
        self.service.refuse_if_closed()
        body = await read_object(request)
        extra = unknown_fields(body, allowed)
        if extra:
            self.unknown.note(extra, route)
        if not self.served.known_openai(body.get("model")):
            raise oa.unknown_model(body.get("model"), self.served.openai_names)
        return body


def _tokenized(tok, encode, strs: bool) -> tuple[list[int], list[str] | None]:
    """`encode()`'s ids and, when asked, each token's text (special tokens kept): tokenizer work, run off
    the event loop."""
    ids = encode()
    return ids, [tok.decode([t], skip_special_tokens=False) for t in ids] if strs else None
