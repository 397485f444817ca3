"""FlashInfer's fused kernels for the decoder's elementwise work (CUDA, fp16/bf16).

The eager decoder spends ~60 small kernels per layer on RMSNorm (7-8 ops, four times per Qwen3
layer), RoPE and SiLU-and-mul; on an H200 that, not the GEMMs, is most of a forward of a few
thousand tokens. FlashInfer fuses each into one kernel (prebuilt in the GPU kit: ``norm``,
``rope``, ``silu_and_mul``) and computes in fp32 with one rounding at the end, so results differ
from HF's op-by-op bf16 rounding by about one ulp; the GPU tests hold scores to the bf16 bounds.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None):
    """RMSNorm over the last dim of a contiguous ``x`` (any leading dims), into ``out`` if given."""
    from flashinfer.norm import rmsnorm

    d = x.shape[-1]
    y = rmsnorm(x.reshape(-1, d), weight, eps, out=None if out is None else out.view(-1, d))
    return y.view(x.shape)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In place: ``residual += x``, then ``x = rmsnorm(residual)``; returns ``x``."""
    from flashinfer.norm import fused_add_rmsnorm

    fused_add_rmsnorm(x, residual, weight, eps)
    return x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of width ``2d``."""
    from flashinfer.activation import silu_and_mul as fused

    return fused(x)


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hkv, D] in place (non-interleaved, as HF's
    ``rotate_half``) by the fp32 cache rows [max_pos, D] (cos | sin) of ``positions``."""
    from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace

    n, d = q.shape[0], q.shape[-1]
    apply_rope_with_cos_sin_cache_inplace(positions, q.view(n, -1), k.view(n, -1), d, cos_sin_cache, True)
