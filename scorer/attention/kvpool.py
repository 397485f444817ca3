"""The per-layer K/V page pools (page_size 1): a plan's own (``KVPool``), or the prefix cache's
(``CachePool``), which persists across batches."""

from __future__ import annotations

import torch

from ..planning import Pass, Plan


class KVPool:
    """Pass ``k`` writes its rows' K/V to slots ``slot_offset + row``. A plan whose passes all
    read only their own rows (``slot_offset`` 0: one pass, or a split request's chunks that
    compute their prompt again) needs no pool: each layer's own K/V is the pool, with no copy."""

    def __init__(self, plan: Plan, num_layers: int, num_kv_heads: int, head_dim: int, dtype, device) -> None:
        self.pools = None
        if any(p.slot_offset for p in plan.passes):
            shape = (plan.num_slots, num_kv_heads, head_dim)
            self.pools = [
                (
                    torch.empty(shape, dtype=dtype, device=device),
                    torch.empty(shape, dtype=dtype, device=device),
                )
                for _ in range(num_layers)
            ]

    def write(
        self, layer: int, p: Pass, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pools is None:
            return k, v
        kp, vp = self.pools[layer]
        kp[p.slot_offset : p.slot_offset + p.num_rows] = k
        vp[p.slot_offset : p.slot_offset + p.num_rows] = v
        return kp, vp


class CachePool:
    """The prefix cache's pool ``[layers, capacity, heads, dim]``: a pass on it writes row ``i``'s
    K/V to slot ``slots[i]`` (``Pass.slots`` on the device) and reads the whole pool."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s pool, its pass's K/V written already (by the CUDA graphs)."""
        return self.k[layer], self.v[layer]

    def write(
        self, layer: int, p: Pass, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kp, vp = self.read(layer)
        kp.index_copy_(0, slots, k)
        vp.index_copy_(0, slots, v)
        return kp, vp
