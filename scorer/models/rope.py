"""Rotary position embeddings for a flat token layout, numerically as in HF Llama/Qwen3."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from scorer.config import ModelConfig


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] fp32 on CPU, attention_scaling applied to cos and sin)."""
    with torch.device("cpu"):
        if config.rope_type == "default":
            exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
            return 1.0 / (config.rope_theta**exponents), 1.0
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[config.rope_type](
            config.hf_config, torch.device("cpu")
        )
    return inv_freq.float(), float(attention_scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by the [T, 1, D] tables of ``RotaryEmbedding``."""
    cos, sin = cos_sin
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotaryEmbedding(nn.Module):
    """Holds inv_freq outside the module's buffers, so meta construction and dtype casts leave it fp32."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self._inv_freq, self.attention_scaling = rope_frequencies(config)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq.device != device:
            self._inv_freq = self._inv_freq.to(device)
        return self._inv_freq

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables [T, 1, D] for token positions [T], computed once per forward pass."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None, :]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None, :]
        return cos, sin
