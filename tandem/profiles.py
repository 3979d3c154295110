"""Role profiles: the tuning that makes a prefill engine and a decode engine different.

Every knob carries a one-line reason (shown by `tandem build` and stored in the manifest), so the
next engineer can see why a number is what it is. Profiles are frozen; a build may override fields
(e.g. --weight-quant int8 for decode) and the result is validated again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from tandem.roles import Role
from tandem.strict import check_keys

WEIGHT_QUANT = ("none", "int8", "int8-dynamic")


@dataclass(frozen=True)
class RoleProfile:
    role: Role
    max_batch_size: int
    max_num_tokens: int
    max_queue_delay_us: int
    packed_batches: bool
    cuda_graph_batch_sizes: tuple[int, ...]
    weight_quant: str = "none"
    kv_pool_bytes: int = 0
    cpu_pass_tokens: int = 0  # prefill on CPU: tokens per packed pass (0: max_num_tokens)
    reasons: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_num_tokens < 1:
            raise ValueError("max_batch_size and max_num_tokens must be >= 1")
        if self.weight_quant not in WEIGHT_QUANT:
            raise ValueError(f"weight_quant {self.weight_quant!r} not supported; allowed: {', '.join(WEIGHT_QUANT)}")
        if self.role is Role.PREFILL and self.weight_quant != "none":
            raise ValueError("weight quantization is a decode-role option: prefill is compute-bound and keeps "
                             "full-precision weights (and exact first tokens)")
        if any(b < 1 or b > self.max_batch_size for b in self.cuda_graph_batch_sizes):
            raise ValueError(f"cuda_graph_batch_sizes must lie in [1, max_batch_size={self.max_batch_size}]")

    def with_overrides(self, **kw) -> "RoleProfile":
        return replace(self, **kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["role"] = self.role.value
        d["cuda_graph_batch_sizes"] = list(self.cuda_graph_batch_sizes)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "RoleProfile":
        check_keys(cls, data, "profile keys")
        data = dict(data, role=Role.parse(data["role"]),
                    cuda_graph_batch_sizes=tuple(data.get("cuda_graph_batch_sizes", ())))
        return cls(**data)


PREFILL_REASONS = {
    "max_batch_size": "prompts are long; a few per pass already saturate the arithmetic units",
    "max_num_tokens": "large packed passes amortise weight reads over thousands of prompt tokens",
    "max_queue_delay_us": "wait briefly so prompts arriving together share one packed pass, not longer (TTFT)",
    "packed_batches": "variable-length prompts are concatenated, not padded: no compute spent on padding",
    "cuda_graph_batch_sizes": "none: shapes vary with every prompt and launch overhead is negligible per token",
    "weight_quant": "full precision: prefill is compute-bound, fewer weight bytes would not help",
    "kv_pool_bytes": "no pool of its own: K/V are written straight into pages the decode worker reserved",
    "cpu_pass_tokens": "on a CPU a pass takes time in proportion to its tokens, and a few hundred already amortise "
                       "the weight reads: bigger passes only delay the first prompts' first tokens",
}
DECODE_REASONS = {
    "max_batch_size": "each step reads all weights once; more sequences per step share that read",
    "max_num_tokens": "one new token per sequence per step, so the token budget equals the batch size",
    "max_queue_delay_us": "a decode request joins the running batch at the next step; no batching wait",
    "packed_batches": "every sequence contributes exactly one token per step",
    "cuda_graph_batch_sizes": "on GPU, replaying graphs at padded batch sizes removes per-step launch overhead",
    "weight_quant": "decode is bandwidth-bound: int8 weights read 4x fewer bytes than fp32 (optional)",
    "kv_pool_bytes": "the decode worker owns the KV pool that prefill workers write into",
    "cpu_pass_tokens": "not used: decode passes hold one token per sequence",
}

PREFILL = RoleProfile(role=Role.PREFILL, max_batch_size=8, max_num_tokens=8192, max_queue_delay_us=1000,
                      packed_batches=True, cuda_graph_batch_sizes=(), kv_pool_bytes=0, cpu_pass_tokens=512,
                      reasons=PREFILL_REASONS)
DECODE = RoleProfile(role=Role.DECODE, max_batch_size=256, max_num_tokens=256, max_queue_delay_us=0,
                     packed_batches=False, cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                     kv_pool_bytes=2 << 30, reasons=DECODE_REASONS)
DEFAULT_PROFILES = {Role.PREFILL: PREFILL, Role.DECODE: DECODE}
