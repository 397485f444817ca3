"""Rotary position embeddings for a flat token layout, numerically as in HF Llama/Qwen3."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Rope:
    """What a forward pass rotates q and k with: HF's cos and signed-sin tables [T, 1, D], or, with
    the fused kernels, the token positions and the fp32 cos|sin cache [max_pos, D]."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    cache: torch.Tensor | None = None

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated q and k, written into ``out`` when given (the fused kernel rotates in place:
        q and k may already be ``out``)."""
        if self.cache is None:
            return apply_rope(q, k, (self.cos, self.sin), out)
        from . import fused

        if out is not None:
            q, k = (o if o is x else o.copy_(x) for o, x in zip(out, (q, k), strict=True))
        fused.rope_(q, k, self.positions, self.cache)
        return q, k


class RotaryEmbedding(nn.Module):
    """Holds inv_freq outside the module's buffers, so meta construction and dtype casts leave it fp32."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self._inv_freq, self.attention_scaling = rope_frequencies(config)
        self.max_positions = config.max_position_embeddings
        self.cos_sin_cache: torch.Tensor | None = None  # set by use_fused(): the fused kernels run

    def use_fused(self, device: torch.device) -> None:
        """Rotate with FlashInfer's kernel from an fp32 cos|sin cache of every position."""
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = t[:, None] * self.inv_freq(device)[None, :]
        self.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_scaling

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq.device != device:
            self._inv_freq = self._inv_freq.to(device)
        return self._inv_freq

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The rotation of token positions [T], once per forward pass."""
        if self.cos_sin_cache is not None:
            return Rope(positions=positions, cache=self.cos_sin_cache)
        return Rope(*self.tables(positions, dtype))

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin tables [T, 1, D] for token positions [T]."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None, :]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None, :]
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
