"""The KV page layout both roles must agree on, and the check that refuses a mismatched pair.

A KV pool is one tensor `[layers, 2 (k|v), pages, tokens_per_page, kv_heads, head_dim]`. A prefill
engine writes pages that a decode engine reads, so every field below must be equal on both sides.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from tandem.strict import check_keys

KV_DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class KVLayoutMismatch(ValueError):
    """Two engines cannot hand KV pages to each other; the message names the field and both values."""


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_page: int

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype {self.dtype!r} is not supported; allowed: {', '.join(KV_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_page"):
            if getattr(self, name) < 1:
                raise ValueError(f"KV layout field {name} must be >= 1, got {getattr(self, name)}")

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V): tokens_per_page * kv_heads * head_dim * itemsize."""
        return self.tokens_per_page * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers, K and V."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_page)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KVLayout":
        check_keys(cls, data, "KV layout keys")
        return cls(**data)


def check_kv_compatible(prefill: KVLayout, decode: KVLayout) -> None:
    """Raise KVLayoutMismatch naming the first differing field; return None when pages are interchangeable."""
    for f in fields(KVLayout):
        a, b = getattr(prefill, f.name), getattr(decode, f.name)
        if a != b:
            raise KVLayoutMismatch(
                f"prefill and decode engines disagree on KV layout field '{f.name}': "
                f"prefill has {a!r}, decode has {b!r}; rebuild both roles from the same checkpoint "
                f"with the same --dtype and --tokens-per-page"
            )
