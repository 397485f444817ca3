"""Attention backends: the torch reference (CPU and GPU) and FlashInfer (GPU, optional), chosen
once at start."""

from __future__ import annotations

import importlib.util
import logging

import torch

from ..options import BACKENDS, FALLBACKS
from .base import AttentionBackend, HeadSpec
from .torch_ref import TorchBackend

log = logging.getLogger(__name__)


class BackendUnavailable(RuntimeError):
    """The attention backend asked for cannot run this model here."""


def flashinfer_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None


def flashinfer_problem(spec: HeadSpec) -> str | None:
    """Why FlashInfer cannot run a model of ``spec`` here, or None when it can."""
    if not flashinfer_available(spec.device):
        return "flashinfer needs CUDA" if spec.device.type != "cuda" else "flashinfer is not installed"
    from .flashinfer import unsupported_reason

    reason = unsupported_reason(spec)
    if reason is not None:
        return f"FlashInfer cannot run {reason}"
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # a broken install: its kernels do not load
        return f"flashinfer does not load ({type(e).__name__}: {e})"
    return None


def make_backend(name: str, spec: HeadSpec, fallback: str = "none") -> AttentionBackend:
    """The backend, decided here once. ``auto``: FlashInfer where it can run the model (CUDA,
    installed, a supported head shape), the torch reference otherwise. ``flashinfer`` where it
    cannot run raises BackendUnavailable, unless ``fallback`` is ``torch`` (logged)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}")
    if fallback not in FALLBACKS:
        raise ValueError(f"unknown attention fallback {fallback!r}; expected one of {', '.join(FALLBACKS)}")
    if name == "torch":
        return TorchBackend(spec)
    problem = flashinfer_problem(spec)
    if problem is None:
        from .flashinfer import FlashInferBackend  # optional dependency, imported only here

        return FlashInferBackend(spec)
    if name == "auto":
        log.info("attention: torch reference (%s)", problem)
        return TorchBackend(spec)
    if fallback == "torch":
        log.warning(
            "attention: %s; falling back to the torch reference (--attention-fallback torch)", problem
        )
        return TorchBackend(spec)
    raise BackendUnavailable(f"--attention-backend flashinfer: {problem}")


__all__ = [
    "BACKENDS",
    "FALLBACKS",
    "AttentionBackend",
    "BackendUnavailable",
    "HeadSpec",
    "TorchBackend",
    "make_backend",
]
