"""Which chat template a model uses: the override, `chat_template.jinja`, or tokenizer_config.json's.

Where a template comes from, first match wins:
1. an override (`tandem serve --chat-template`, deployment key `front_door.chat_template`): a path to a
   Jinja file, or the name of one of the model's named templates;
2. `chat_template.jinja` beside the tokenizer (where recent Hugging Face checkpoints keep it);
3. tokenizer_config.json's `chat_template`: a string, or a list of `{"name", "template"}` (the one
   named "default" is used unless the override names another).
No template at all is allowed (plain completions still work; chat requests then get a clear error).
"""

from __future__ import annotations

import os

from engine.errors import ModelLoadError

TEMPLATE_FILE = "chat_template.jinja"


def find_chat_template(folder: str, config: dict, override: str | None = None) -> str | None:
    """The template text for the tokenizer in `folder` (its tokenizer_config.json already read into `config`)."""
    named = _named(folder, config.get("chat_template"))
    if override:
        if os.path.isfile(override):
            return _read(override)
        if override in named:
            return named[override]
        choices = f"; the model's named templates: {', '.join(sorted(named))}" if named else ""
        raise ModelLoadError(f"chat template {override!r} is neither a file nor a named template of {folder}"
                             f"{choices}")
    path = os.path.join(folder, TEMPLATE_FILE)
    if os.path.isfile(path):
        return _read(path)
    if named:
        return named.get("default") or (next(iter(named.values())) if len(named) == 1 else None)
    return config.get("chat_template")


def _named(folder: str, value) -> dict[str, str]:
    """tokenizer_config.json's named templates ({} when it holds one string or none); checks their shape."""
    if value is None or isinstance(value, str):
        return {}
    if not isinstance(value, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                              and isinstance(t.get("template"), str) for t in value):
        raise ModelLoadError(f"{folder}/tokenizer_config.json: chat_template must be a string or a list of "
                             f"{{\"name\": ..., \"template\": ...}}")
    return {t["name"]: t["template"] for t in value}


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read chat template {path}: {e}") from None
