"""Tokenizer: Hugging Face `tokenizers` over `tokenizer.json`, plus the model's chat template.

The chat template is Jinja rendered in a sandbox: templates come with other people's checkpoints.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from engine.chat_template import find_chat_template
from engine.errors import InvalidRequest, ModelLoadError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[dict, ...] = ()  # an assistant's calls, OpenAI's shape: {"id", "type", "function": {...}}
    tool_call_id: str | None = None  # a tool message: the call it answers

    def for_template(self) -> dict:
        """The message as chat templates read it (Hugging Face's keys; tool fields only when set)."""
        out = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class Tokenizer:
    """Encodes text and chat conversations to token ids and decodes them back."""

    def __init__(self, folder: str, chat_template: str | None = None):
        """`chat_template`: an override, a Jinja file or the name of a named template (engine/chat_template.py)."""
        path = os.path.join(folder, TOKENIZER_FILE)
        self.file = path  # tokenizer.json, which engine/guided.py reads too
        if not os.path.isfile(path):
            raise ModelLoadError(f"{folder} has no {TOKENIZER_FILE}; a model folder needs one")
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as e:  # the tokenizers library raises bare Exception on malformed files
            raise ModelLoadError(f"cannot read {path}: {e}") from e
        cfg_path = os.path.join(folder, TOKENIZER_CONFIG_FILE)
        cfg = {}
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        self.chat_template: str | None = find_chat_template(folder, cfg, chat_template)
        self.bos_token: str | None = _token_text(cfg.get("bos_token"))
        self.eos_token: str | None = _token_text(cfg.get("eos_token"))
        self.pad_token: str | None = _token_text(cfg.get("pad_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                  extensions=["jinja2.ext.loopcontrols"])
        self._env.globals["raise_exception"] = _raise_template_error

    def end_ids(self, config_eos_ids) -> frozenset[int]:
        """The tokens a model's answer ends with: its config's eos_token_id(s) and this tokenizer's EOS."""
        return frozenset(config_eos_ids) | ({self.eos_token_id} if self.eos_token_id is not None else set())

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens lets tokenizer.json's post-processor add a BOS where the model wants one."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, continue_final: bool = False,
                    template_kwargs: dict | None = None) -> str:
        """The prompt text for a conversation, by the model's own chat template (`tools`: OpenAI tool
        definitions, given to the template as `tools`, as Hugging Face's apply_chat_template does;
        `template_kwargs`: more variables for it, never one of those it is given here).
        `continue_final` leaves the final message open (the text ends with its content, without the
        end of its turn), so the model continues it; it excludes `add_generation_prompt`."""
        if continue_final and add_generation_prompt:
            raise InvalidRequest("continue_final_message and add_generation_prompt exclude each other: "
                                 "set add_generation_prompt to false to continue the final message")
        if not self.chat_template:
            raise InvalidRequest("this model has no chat template; send a plain prompt instead")
        for m in messages:
            if m.role not in CHAT_ROLES:
                raise InvalidRequest(f"unknown chat role {m.role!r}; allowed: {', '.join(CHAT_ROLES)}")
        template = self._env.from_string(self.chat_template)
        text = template.render(
            **(template_kwargs or {}), messages=[m.for_template() for m in messages],
            add_generation_prompt=add_generation_prompt, tools=tools or None,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        if not continue_final:
            return text
        final = messages[-1].content
        at = text.rfind(final) if final else -1
        if at < 0:
            raise InvalidRequest("continue_final_message needs a final message with content that the chat "
                                 "template writes as it is")
        return text[:at + len(final)]

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final: bool = False,
                    template_kwargs: dict | None = None, add_special_tokens: bool = False) -> list[int]:
        """The conversation's prompt ids. The template already writes any BOS it wants, so the tokenizer
        adds none unless `add_special_tokens` (vLLM's chat default is the same)."""
        text = self.render_chat(messages, add_generation_prompt, tools, continue_final, template_kwargs)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids


def _token_text(tok) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as {"content": ...}.
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _raise_template_error(message: str) -> None:
    # Chat templates call raise_exception() to reject a conversation they cannot format.
    raise InvalidRequest(f"the model's chat template rejected the conversation: {message}")
