"""One attention layer of a plan replayed on per-logical-token q/k/v: any two schemes compared row
for row (tests and the kernel benchmark)."""

from __future__ import annotations

import torch

from scorer.attention.base import AttentionBackend
from scorer.attention.kvpool import KVPool
from scorer.planning import Plan


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
