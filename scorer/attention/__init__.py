"""Attention backends: the torch reference (CPU and GPU) and FlashInfer (GPU, optional)."""

from __future__ import annotations

import importlib.util
import logging

import torch

from .base import AttentionBackend, HeadSpec
from .torch_ref import TorchBackend

BACKENDS = ("auto", "torch", "flashinfer")
log = logging.getLogger(__name__)


def flashinfer_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None


def make_backend(name: str, spec: HeadSpec) -> AttentionBackend:
    """``auto`` takes FlashInfer on CUDA when it is installed, the torch reference otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}")
    if name == "flashinfer" or (name == "auto" and flashinfer_available(spec.device)):
        from .flashinfer import FlashInferBackend  # optional dependency, imported only here

        return FlashInferBackend(spec)
    return TorchBackend(spec)


__all__ = ["BACKENDS", "AttentionBackend", "HeadSpec", "TorchBackend", "make_backend"]
