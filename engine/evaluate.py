"""Perplexity of a model on a text: the quality check for quantized decode engines."""

from __future__ import annotations

import math

import torch

from engine.attention import PrefillAttention
from engine.model import LlamaModel
from engine.transports.base import DiscardWriter


@torch.inference_mode()
def perplexity(model: LlamaModel, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given the preceding tokens, in one causal pass."""
    n = len(ids)
    tokens = torch.tensor(ids, device=model.device)  # [T]
    positions = torch.arange(n, device=model.device)  # [T]
    lens = torch.full((n,), n, device=model.device)  # [T]
    logits = model.forward(tokens, positions, lens, PrefillAttention([n], [DiscardWriter()]), positions[:-1])
    nll = torch.nn.functional.cross_entropy(logits.float(), tokens[1:], reduction="mean")  # logits: [T-1, V]
    return math.exp(float(nll))
