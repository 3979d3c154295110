"""The Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, tied or separate head.

`forward` runs one packed pass (tokens of several sequences back to back, `[T]`); how attention sees
the KV cache is decided by the attention object it is given (see engine/attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import Attention
from engine.config import ModelConfig
from engine.cpu_kernels import layers as cpu_layers
from engine.cpu_kernels import norm as cpu_norm
from engine.errors import ModelLoadError
from engine.linear import Dense
from engine.lora import LoraAdapter, LoraRows
from engine.quant import SCALE_SUFFIX, make_quantized
from engine.rope import Rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, D] -> [T, D]; statistics in fp32 whatever the model dtype, the weight applied after the
    cast back, as Hugging Face's Llama does (the same ops in the same order: equal bit for bit)."""
    xf = x if x.dtype == torch.float32 else x.float()  # no conversion op in fp32
    xf = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True).add_(eps))  # xf * xf: pow(2) without its scalar casts
    return weight * (xf if x.dtype == torch.float32 else xf.to(x.dtype))


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, D] += delta [T, D] in place (when given), then rms_norm(x): one call where Tandem's CPU kernel
    applies (engine/cpu_kernels/norm.py: a decode step's few rows), PyTorch's ops otherwise."""
    if cpu_norm.supports(x):
        return cpu_norm.add_rms_norm(x, delta, weight, eps)
    if delta is not None:
        x += delta
    return rms_norm(x, weight, eps)


@dataclass
class Layer:
    attn_norm: torch.Tensor  # [D]
    qkv: Dense  # [D] -> [(H + 2*Hkv) * hd]: q, k, v projections fused into one matmul
    o: Dense  # [H*hd] -> [D]
    mlp_norm: torch.Tensor  # [D]
    gate_up: Dense  # [D] -> [2 * I]: gate and up projections fused
    down: Dense  # [I] -> [D]


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, weight_quant: str = "none"):
        """`weight_quant` picks the kernel for int8 checkpoints (those with `<name>_scale` tensors)."""
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        w = _Weights(weights, self.device, dtype, weight_quant)
        self.embed = w.take("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))  # [V, D]
        self.layers = [self._layer(w, i) for i in range(cfg.num_layers)]
        self.norm = w.take("model.norm.weight", (cfg.hidden_size,))
        if w.quantized("lm_head.weight") or not cfg.tie_word_embeddings:
            self.lm_head = w.linear(["lm_head"], [cfg.vocab_size], cfg.hidden_size, bias=False)
        else:
            self.lm_head = Dense(self.embed)
            if self.lm_head.holds_rows:
                self.embed = None  # lookups read the head's packed copy (Dense.rows): one copy fewer
        w.check_all_used()
        self.rotary = Rotary(cfg, self.device)
        self._one_call = cpu_layers.layer_weights(self.layers)  # None unless every layer can run in one call
        self.loras: dict[str, LoraAdapter] = {}  # by name: the adapters a request may name (engine/lora.py)

    @property
    def one_call_rows(self) -> int:
        """The most rows a pass may have to run every layer in one call (0: never, on this CPU or model)."""
        return cpu_layers.max_rows(self.dtype) if self._one_call is not None else 0

    @property
    def in_rounds(self) -> bool:
        """Whether a pass longer than `one_call_rows` runs as rounds of one call each (else the layer loop)."""
        return self._one_call is not None and cpu_layers.in_rounds(self.dtype)

    def _layer(self, w: "_Weights", i: int) -> Layer:
        c, p = self.cfg, f"model.layers.{i}."
        qd, kvd, D = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
        return Layer(
            attn_norm=w.take(p + "input_layernorm.weight", (D,)),
            qkv=w.linear([p + f"self_attn.{n}_proj" for n in "qkv"], [qd, kvd, kvd], D, c.attention_bias),
            o=w.linear([p + "self_attn.o_proj"], [D], qd, c.output_bias),
            mlp_norm=w.take(p + "post_attention_layernorm.weight", (D,)),
            gate_up=w.linear([p + "mlp.gate_proj", p + "mlp.up_proj"], [c.intermediate_size] * 2, D, False),
            down=w.linear([p + "mlp.down_proj"], [D], c.intermediate_size, False),
        )

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step reads: every layer's matrices, the norms and the output head."""
        per_layer = sum(d.nbytes for L in self.layers for d in (L.qkv, L.o, L.gate_up, L.down))
        return per_layer + self.lm_head.nbytes

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, seq_lens_for_rope: torch.Tensor,
                attn: Attention, last_rows: torch.Tensor,
                max_len: int | None = None, lora: LoraRows | None = None) -> torch.Tensor:
        """tokens, positions: [T] -> logits [R, V] at rows `last_rows` [R] (each sequence's last, and any
        prompt rows whose logprobs were asked for).

        `max_len`: the longest sequence length in the pass, when known (see Rotary.cos_sin). `lora`: the
        rows that take LoRA adapters' updates (engine/lora.py), in the one call as in the layer loop."""
        c = self.cfg
        T = tokens.shape[0]
        x = self.lm_head.rows(tokens) if self.embed is None else self.embed[tokens]  # [T, D]
        cos, sin = self.rotary.cos_sin(positions, seq_lens_for_rope, self.dtype, max_len)  # [T, hd] each
        in_place = attn.in_place_rows() if T <= self.one_call_rows else None
        if in_place is not None:  # every layer in one call (engine/cpu_kernels/layers.py)
            x = cpu_layers.run_pass(x, self._one_call, in_place, cos, sin, c.num_heads, c.rms_norm_eps,
                                    attn.in_place_layer_done(), lora)
        else:  # cos, sin [T, 1, hd]: broadcast over heads, shaped once per pass
            self._layer_loop(x, cos[:, None, :], sin[:, None, :], attn, lora)
        x = rms_norm(x[last_rows], self.norm, c.rms_norm_eps)  # [B, D]
        return self.lm_head(x)  # [B, V]

    def _layer_loop(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention,
                    lora: LoraRows | None = None) -> None:
        """x: [T, D] through every layer, in place; cos, sin: [T, 1, hd]; `lora`'s rows take its updates."""
        up = lora.add if lora is not None else _no_update
        c = self.cfg
        T = x.shape[0]
        H, Hkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        mlp_out = None  # the previous layer's MLP output [T, D], added to x by the next norm
        for i, L in enumerate(self.layers):
            h = add_rms_norm(x, mlp_out, L.attn_norm, c.rms_norm_eps)  # [T, D]; x is this pass's own tensor
            qkv = up(i, "qkv", h, L.qkv(h)).view(T, H + 2 * Hkv, hd)  # [T, H + 2*Hkv, hd]: q, k, v heads
            out = attn.attend_qkv(i, qkv, cos, sin, H)  # [T, H*hd]: rotary embedding, K/V written, attention
            h = add_rms_norm(x, up(i, "o", out, L.o(out)), L.mlp_norm, c.rms_norm_eps)  # x += attention's projection
            gate, u = up(i, "gate_up", h, L.gate_up(h)).chunk(2, dim=-1)  # [T, I] each, views of one fresh tensor
            act = F.silu(gate).mul_(u)  # [T, I]; silu writes a contiguous [T, I] the product takes as it is
            mlp_out = up(i, "down", act, L.down(act))  # [T, D]
        if mlp_out is not None:
            x += mlp_out


def _no_update(layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A pass without LoRA rows: the layer's output as it is."""
    return y


class _Weights:
    """Takes named tensors out of a checkpoint, checking shapes, so none is missed or misread."""

    def __init__(self, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 weight_quant: str):
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.weight_quant = weight_quant
        self.used: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.weights.get(name)
        if t is None:
            raise ModelLoadError(f"checkpoint lacks tensor {name!r}")
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
        self.used.add(name)
        return t.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def quantized(self, weight_name: str) -> bool:
        return weight_name + SCALE_SUFFIX in self.weights

    def linear(self, prefixes: list[str], outs: list[int], d_in: int, bias: bool):
        """One linear layer from the projections `prefixes` (fused along the output dimension)."""
        b = torch.cat([self.take(p + ".bias", (o,)) for p, o in zip(prefixes, outs)]) if bias else None
        if not self.quantized(prefixes[0] + ".weight"):
            return Dense(torch.cat([self.take(p + ".weight", (o, d_in)) for p, o in zip(prefixes, outs)]), b)
        if self.weight_quant == "none":
            raise ModelLoadError("checkpoint has int8 weights; load it with weight_quant 'int8' or 'int8-dynamic'")
        q = torch.cat([self.take(p + ".weight", (o, d_in), torch.int8) for p, o in zip(prefixes, outs)])
        s = torch.cat([self.take(p + ".weight" + SCALE_SUFFIX, (o,), torch.float32) for p, o in zip(prefixes, outs)])
        return make_quantized(self.weight_quant, q, s, b)

    def check_all_used(self) -> None:
        # Rotary tables are recomputed, not loaded; anything else left over means a layout we misread.
        left = sorted(n for n in self.weights if n not in self.used and "rotary_emb" not in n
                      and not (n == "lm_head.weight"))
        if left:
            raise ModelLoadError(f"checkpoint has tensors this architecture does not use: {left[:5]}")
