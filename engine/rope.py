"""Rotary position embedding (RoPE) with the default, linear, dynamic-NTK and llama3 frequency schemes.

Rotation follows the Hugging Face "rotate half" convention: the first half of each head's dims pairs
with the second half. Weights converted from GGUF (which interleaves pairs) are un-permuted on load.
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # inv_freq: [dim/2]
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1 scheme: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    rs = cfg.rope_scaling
    low_wavelen = rs.original_max_position / rs.low_freq_factor
    high_wavelen = rs.original_max_position / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, blended, scaled)


class Rotary:
    """Precomputed cos/sin tables, and the rotation applied to packed q/k.

    For the dynamic scheme the frequencies depend on how long the sequence is when a token is
    processed (as in Hugging Face), so `cos_sin` takes each token's sequence length as well.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device):
        self.cfg = cfg
        self.device = device
        rs = cfg.rope_scaling
        inv_freq = _base_inv_freq(cfg.rope_theta, cfg.head_dim)
        if rs.type == "linear":
            inv_freq = inv_freq / rs.factor
        elif rs.type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, cfg)
        self.inv_freq = inv_freq.to(device)  # [hd/2] fp32
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # dtype -> cos, signed sin [N, hd]

    def _table(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for positions [0, >= n), computed in fp32 and kept in `dtype`."""
        cos, sin = self._tables.get(dtype, (None, None))
        if cos is None or cos.shape[0] < n:
            size = max(n, 2 * (cos.shape[0] if cos is not None else 0), 256)
            cos, sin = self._angles(torch.arange(size, device=self.device), self.inv_freq)
            cos, sin = cos.to(dtype), sin.to(dtype)
            self._tables[dtype] = cos, sin
        return cos, sin

    @staticmethod
    def _angles(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos [N, hd], and sin [N, hd] with its first half negated (what `apply_rotary` multiplies)."""
        freqs = pos.float()[:, None] * inv_freq[None, :]  # [N, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, hd]
        sin = emb.sin()
        sin[:, : sin.shape[1] // 2].neg_()
        return emb.cos(), sin

    def _dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        rs, dim = self.cfg.rope_scaling, self.cfg.head_dim
        orig = rs.original_max_position or self.cfg.max_position
        if seq_len <= orig:
            return self.inv_freq
        base = self.cfg.rope_theta * ((rs.factor * seq_len / orig) - (rs.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim).to(self.device)

    def cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32, max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin: [T, hd] for token positions [T]; seq_lens [T] matters only for dynamic scaling.

        `max_len`, when the caller knows it, is the largest of seq_lens (exactly, under dynamic scaling;
        otherwise any bound above every position): it spares reading the maximum back from the device.
        """
        dynamic = self.cfg.rope_scaling.type == "dynamic" and seq_lens is not None
        if dynamic and (max_len if max_len is not None else int(seq_lens.max())) > \
                (self.cfg.rope_scaling.original_max_position or self.cfg.max_position):
            cos = torch.empty(len(positions), self.cfg.head_dim, device=self.device)
            sin = torch.empty_like(cos)
            for n in seq_lens.unique().tolist():
                sel = seq_lens == n
                cos[sel], sin[sel] = self._angles(positions[sel], self._dynamic_inv_freq(int(n)))
            return cos.to(dtype), sin.to(dtype)
        cos, sin = self._table(max_len if max_len is not None else int(positions.max()) + 1, dtype)
        return cos[positions], sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; cos, signed sin (from `Rotary.cos_sin`): [T, 1, hd] -> rotated x: [T, heads, hd].

    Equals x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), bit for bit: the sign sits
    in the table instead of in an extra negation of x.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # [T, heads, hd]
    return (x * cos).add_(swapped.mul_(sin))
