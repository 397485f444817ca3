"""Reference semantics of the FlashInfer kernels behind ``scorer.models.fused``."""

from __future__ import annotations

import torch

from scorer.models.triton_ops import rms_norm_reference


class TorchFused:
    """fp32 torch stand-ins with the semantics of the FlashInfer kernels in scorer.models.fused
    (documented by FlashInfer), so the fused wiring is checked on the CPU; the kernels themselves
    are checked on the GPU (tests/gpu)."""

    rms_norm = staticmethod(rms_norm_reference)  # FlashInfer's rmsnorm: fp32, rounded once

    @staticmethod
    def add_rms_norm_(x, residual, weight, eps):
        residual.add_(x)
        return x.copy_(TorchFused.rms_norm(residual, weight, eps))

    @staticmethod
    def silu_and_mul(x):
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:]

    @staticmethod
    def rope_(q, k, positions, cache):
        half = q.shape[-1] // 2
        cos, sin = cache[positions, None, :half], cache[positions, None, half:]
        for x in (q, k):
            x1, x2 = x[..., :half].float(), x[..., half:].float()
            x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1))
