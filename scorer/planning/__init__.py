"""Planners: one per scheme, a registry, ``auto``, and ``combine`` for mixed batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

import torch

from ..schemes import CONCRETE, SCHEMES
from .auto import article_choice
from .base import ItemLoc, Pass, Plan, PlanError, Shape, check_plan
from .schemes import cascade, custom_mask, grouped, multi_item, naive, ragged, split_cache

Planner = Callable[[Sequence[Shape]], Plan]

PLANNERS: dict[str, Callable[..., Plan]] = {
    "naive": naive,
    "split_cache": split_cache,
    "ragged": ragged,
    "cascade": cascade,
    "multi_item": multi_item,
    "custom_mask": custom_mask,
    "grouped": grouped,
}
assert tuple(PLANNERS) == CONCRETE

__all__ = [
    "PLANNERS",
    "SCHEMES",
    "ItemLoc",
    "Pass",
    "Plan",
    "PlanError",
    "Shape",
    "article_choice",
    "check_plan",
    "combine",
    "planner",
]


def planner(scheme: str, group_size: int = 8) -> Planner:
    if scheme == "grouped":
        return partial(grouped, group_size=group_size)
    try:
        return PLANNERS[scheme]
    except KeyError:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}") from None


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
    return Plan("mixed", passes, tuple(items), tuple(s for p in plans for s in p.shapes))
