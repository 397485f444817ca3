"""The per-layer K/V page pool of a plan (page_size 1)."""

from __future__ import annotations

import torch

from ..planning import Pass, Plan


class KVPool:
    """Pass ``k`` writes its rows' K/V to slots ``slot_offset + row``. A single-pass plan needs
    no pool: each layer's own K/V is the pool, with no copy."""

    def __init__(self, plan: Plan, num_layers: int, num_kv_heads: int, head_dim: int, dtype, device) -> None:
        self.pools = None
        if len(plan.passes) > 1:
            shape = (plan.num_slots, num_kv_heads, head_dim)
            self.pools = [
                (
                    torch.empty(shape, dtype=dtype, device=device),
                    torch.empty(shape, dtype=dtype, device=device),
                )
                for _ in range(num_layers)
            ]

    def write(
        self, layer: int, p: Pass, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pools is None:
            return k, v
        kp, vp = self.pools[layer]
        kp[p.slot_offset : p.slot_offset + p.num_rows] = k
        vp[p.slot_offset : p.slot_offset + p.num_rows] = v
        return kp, vp
