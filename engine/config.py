"""Model architecture description, parsed once from a Hugging Face `config.json` and validated.

Supported: the Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2). Anything else is refused with the
list of supported architectures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `type` is one of ROPE_TYPES; the other fields apply to some types."""

    type: str = "default"
    factor: float = 1.0
    original_max_position: int = 0  # llama3 and dynamic
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # biases on the q/k/v projections
    output_bias: bool = False  # bias on the attention output projection (Llama's attention_bias sets both)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Parse a Hugging Face config.json dict; raise ModelLoadError naming what is unsupported."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {act!r}; the Llama family uses 'silu'")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_params(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0))),
                max_position=_max_context(cfg),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; Llama declares them with attention_bias.
                attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
                output_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
                rope_scaling=_rope_scaling(cfg),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None


def _rope_params(cfg: dict) -> dict:
    # Newer transformers write `rope_parameters` (theta and scaling together); older ones `rope_scaling`.
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _rope_scaling(cfg: dict) -> RopeScaling:
    rs = _rope_params(cfg)
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported RoPE scaling {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return RopeScaling()
    return RopeScaling(
        type=kind,
        factor=float(rs.get("factor", 1.0)),
        original_max_position=int(rs.get("original_max_position_embeddings")
                                  or cfg.get("max_position_embeddings", 0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
    )


def _max_context(cfg: dict) -> int:
    limit = int(cfg.get("max_position_embeddings", 2048))
    rs = _rope_params(cfg)
    if (rs.get("rope_type") or rs.get("type")) in ("linear", "dynamic"):
        # These schemes stretch a model trained on max_position_embeddings by `factor`.
        limit = int(limit * float(rs.get("factor", 1.0)))
    # We do not implement sliding-window attention: cap the context where it would start to matter.
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True):
        limit = min(limit, int(window))
    return limit
