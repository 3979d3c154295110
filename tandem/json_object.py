"""Reading a JSON object from a file others wrote (a model's or an adapter's config), with one error."""

from __future__ import annotations

import json


def read_json_object(path: str) -> dict:
    """The JSON object in the file at `path`; ValueError naming the file when it cannot be read, is not
    JSON, or holds something other than an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data
