"""The per-layer K/V page pool of a plan (page_size 1), and a one-layer replay for tests/benchmarks."""

from __future__ import annotations

import torch

from ..planning import Pass, Plan
from .base import AttentionBackend


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


def replay_attention(
    plan: Plan, backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """One attention layer of ``plan`` on per-logical-token ``q``/``k``/``v`` ([N, H, D]).

    Returns the output rows of every item token, request by request and item by item, so that
    any two schemes can be compared row for row.
    """
    pool = KVPool(plan, 1, k.shape[1], k.shape[2], k.dtype, k.device)
    outs = []
    for p in plan.passes:
        backend.plan(p)
        idx = p.logical.to(q.device)
        kk, vv = pool.write(0, p, k[idx], v[idx])
        outs.append(backend.run(0, q[idx], kk, vv))
    return torch.cat(
        [outs[loc.pass_idx][loc.row : loc.row + loc.length] for locs in plan.items for loc in locs]
    )
