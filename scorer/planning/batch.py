"""One plan for a batch of requests: grouped by scheme and combined side by side, or one request
split over the token budget; checked, with its read-out attached."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..lazy_torch import torch
from .base import ItemLoc, Pass, Plan, Shape, check_plan, with_score_rows
from .schemes import Scheme
from .split import split_to_budget

Planned = tuple[Shape, Scheme, int]
"""What the batch planner needs of a request: its shape, concrete scheme and group size."""


def plan_batch(requests: Sequence[Planned], budget: int, mask_cap: int, recompute_share: float = 0.0) -> Plan:
    """Requests of the same (scheme, group size) planned together, the groups combined; a lone
    request over ``budget`` tokens split into passes that reuse its prompt's K/V, or compute a
    short prompt again (``split_to_budget``'s ``recompute_share``)."""
    if len(requests) == 1 and budget:
        shape, scheme, group = requests[0]
        if scheme.rows(shape) > budget:
            plan = split_to_budget(scheme, shape, budget, group, recompute_share)
            check_plan(plan, mask_cap)
            return with_score_rows(plan, [0])
    keys = [(scheme.name, group) for _, scheme, group in requests]
    parts, order = [], []
    for key in dict.fromkeys(keys):
        members = [i for i, k in enumerate(keys) if k == key]
        _, scheme, group = requests[members[0]]
        parts.append(scheme.plan([requests[i][0] for i in members], group))
        order += members
    plan = combine(parts)
    check_plan(plan, mask_cap)
    return with_score_rows(plan, order)


def combine(plans: Sequence[Plan]) -> Plan:
    """One plan running several plans' requests side by side: pass k of the result is pass k of
    every part, rows and slots shifted, requests in the order of the parts."""
    if len(plans) == 1:
        return plans[0]
    n_passes = max(len(p.passes) for p in plans)
    rows = [[p.passes[k].num_rows if k < len(p.passes) else 0 for k in range(n_passes)] for p in plans]
    pass_rows = [sum(r[k] for r in rows) for k in range(n_passes)]
    pass_offset = [sum(pass_rows[:k]) for k in range(n_passes)]
    row_off = [[sum(rows[g][k] for g in range(f)) for k in range(n_passes)] for f in range(len(plans))]
    logical, calls = [[] for _ in range(n_passes)], [[] for _ in range(n_passes)]
    items: list[tuple[ItemLoc, ...]] = []
    base = 0
    for f, plan in enumerate(plans):
        slot_map = torch.cat(
            [
                torch.arange(pass_offset[k] + row_off[f][k], pass_offset[k] + row_off[f][k] + rows[f][k])
                for k in range(len(plan.passes))
            ]
        )
        for k, p in enumerate(plan.passes):
            logical[k].append(p.logical + base)
            for c in p.calls:
                shift = row_off[f][k]
                kv = slot_map[c.kv_indices.long()].to(torch.int32)
                calls[k].append(replace(c, q_start=c.q_start + shift, q_end=c.q_end + shift, kv_indices=kv))
        items += [
            tuple(ItemLoc(i.pass_idx, i.row + row_off[f][i.pass_idx], i.length) for i in locs)
            for locs in plan.items
        ]
        base += sum(s.num_tokens for s in plan.shapes)
    passes = tuple(
        Pass(logical=torch.cat(logical[k]), slot_offset=pass_offset[k], calls=tuple(calls[k]))
        for k in range(n_passes)
    )
    return Plan(passes, tuple(items), tuple(s for p in plans for s in p.shapes))
