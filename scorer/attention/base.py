"""The attention backend interface: ``plan`` once per forward pass, ``run`` once per layer."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import torch

from ..planning import Pass


@dataclass(frozen=True)
class HeadSpec:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    scale: float | None = None  # the softmax scale; None: head_dim ** -0.5
    soft_cap: float = 0.0  # logits -> soft_cap * tanh(logits / soft_cap) (Gemma 2); 0: none

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale


class AttentionBackend(Protocol):
    """Executes the attention calls of a planned pass.

    ``run(layer, q, k, v)`` takes ``q`` as ``[num_rows, num_qo_heads, head_dim]`` and the layer's
    K/V pool as ``[num_slots, num_kv_heads, head_dim]`` and returns ``[num_rows, num_qo_heads,
    head_dim]`` (written into ``out`` when given). ``stats`` counts kernel calls and LSE merges
    (per layer), for tests and metrics.
    """

    name: str
    stats: Counter

    def plan(self, p: Pass) -> None: ...

    def run(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...
