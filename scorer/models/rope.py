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


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by the [T, 1, D] tables of ``RotaryEmbedding``.

    HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = roll(x, D/2) * [-1.., +1..]``:
    the sign lives in the sine table, which saves rotate_half's negation and concatenation and
    leaves every rounding as in HF.
    """
    cos, signed_sin = cos_sin
    half = q.shape[-1] // 2
    qo, ko = out or (None, None)
    return (
        torch.add(q * cos, q.roll(half, dims=-1) * signed_sin, out=qo),
        torch.add(k * cos, k.roll(half, dims=-1) * signed_sin, out=ko),
    )


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
        """cos and signed sin tables [T, 1, D] for token positions [T], once per forward pass."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None, :]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None, :]
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
