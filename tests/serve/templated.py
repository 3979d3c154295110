"""A chat template of the kind tool-calling models ship (Hermes style, as Qwen's and SmolLM3's): it shows
the tools in a system turn and asks for `<tool_call>` blocks, shows retrieved `documents` in a system
turn (as Command R's and Granite's do), and it reads a variable of its own (`enable_thinking`, as Qwen
3's does) that a request sets through `chat_template_kwargs`. The default
model's own template does neither; the `templated` stack serves this one."""

from __future__ import annotations

import os

from engine.tokenizer import ChatMessage, Tokenizer

TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions: {{ tools | tojson }}
To call one, answer <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% endif %}
{%- if documents %}<|im_start|>system
Answer from these documents:{% for d in documents %}
[{{ loop.index }}] {{ d['title'] }}: {{ d['text'] }}{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def write_template(folder) -> str:
    path = os.path.join(str(folder), "hermes_template.jinja")
    with open(path, "w", encoding="utf-8") as f:
        f.write(TEMPLATE)
    return path


def templated_ids(engines, template: str, messages: list[dict], tools: list[dict] | None = None,
                  **template_kwargs) -> list[int]:
    """The prompt ids the templated stack makes of a chat (the default model's tokenizer, this template)."""
    tok = Tokenizer(os.path.join(str(engines), "prefill"), template)
    return tok.encode_chat([ChatMessage(m["role"], m["content"]) for m in messages], tools,
                           template_kwargs=template_kwargs)
