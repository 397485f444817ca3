"""Splitting one request over a token budget into several passes that reuse its prompt's K/V.

Pass 0 runs the prefix and the first chunk of items with the request's own scheme; every later
pass runs one chunk of items as extend requests on the prefix slots of pass 0, as the scheme's
``extend`` lays them out (one request per item, one multi-item group, or groups of a size), so the
prompt is still computed once. A scheme without ``extend`` recomputes the prompt by definition:
its chunks are independent requests.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from .base import ItemLoc, Pass, Plan, Shape, arange, call, item_offsets, multi_item_meta

if TYPE_CHECKING:
    from .schemes import Scheme


def chunk_items(shape: Shape, budget: int, naive: bool) -> list[tuple[int, int]]:
    """Greedy (first item, count) chunks whose pass rows stay within ``budget`` (at least one item)."""
    chunks, start, rows = [], 0, 0 if naive else shape.prefix_len
    for i, n in enumerate(shape.item_lens):
        cost = n + (shape.prefix_len if naive else 0)
        if i > start and rows + cost > budget:
            chunks.append((start, i - start))
            start, rows = i, 0
        rows += cost
    chunks.append((start, len(shape.item_lens) - start))
    return chunks


def extend(shape: Shape, group_size: int | None) -> Plan:
    """Items only, on a prefix whose K/V already exists: K/V slot ``j < P`` names prefix token
    ``j``, slot ``P + row`` this pass's own rows. ``group_size`` None: one request per item."""
    p = shape.prefix_len
    offs = item_offsets(shape)
    rows, locs, at = [], [], 0
    for off, n in zip(offs, shape.item_lens, strict=True):
        rows.append(arange(off, n))
        locs.append(ItemLoc(0, at, n))
        at += n
    size = group_size or 1
    groups = [locs[g : g + size] for g in range(0, len(locs), size)]
    kv = [torch.cat([arange(0, p)] + [arange(p + loc.row, loc.length) for loc in grp]) for grp in groups]
    meta = multi_item_meta([p] * len(groups), [[loc.length for loc in grp] for grp in groups])
    c = call(0, [sum(loc.length for loc in grp) for grp in groups], kv, True, meta if group_size else None)
    return Plan((Pass(torch.cat(rows), 0, (c,)),), (tuple(locs),), (shape,))


def extend_per_item(shapes: list[Shape], group: int = 0) -> Plan:
    """A later pass with one extend request per item."""
    (shape,) = shapes
    return extend(shape, None)


def extend_one_group(shapes: list[Shape], group: int = 0) -> Plan:
    """A later pass whose items form one multi-item request."""
    (shape,) = shapes
    return extend(shape, len(shape.item_lens))


def extend_groups(shapes: list[Shape], group: int = 0) -> Plan:
    """A later pass of multi-item groups of ``group`` items."""
    (shape,) = shapes
    return extend(shape, group)


def split_to_budget(scheme: Scheme, shape: Shape, budget: int, group_size: int) -> Plan:
    """``scheme``'s plan of ``shape``, but with no pass over ``budget`` rows where items allow."""
    plan_fn = scheme.planner(group_size)
    chunks = chunk_items(shape, budget, naive=scheme.extend is None)
    if len(chunks) == 1:
        return plan_fn([shape])
    p, offs = shape.prefix_len, item_offsets(shape)
    passes: list[Pass] = []
    items: list[ItemLoc] = []
    prefix_slots = None
    for k, (i0, n) in enumerate(chunks):
        sub_shape = Shape(p, shape.item_lens[i0 : i0 + n])
        shift = offs[i0] - p
        slot = sum(x.num_rows for x in passes)
        if k == 0 or scheme.extend is None:
            sub = plan_fn([sub_shape])
            slot_map = arange(slot, sub.num_slots)
        else:
            sub = scheme.extend([sub_shape], group_size)
            slot_map = torch.cat([prefix_slots, arange(slot, sub.num_slots)])
        first_pass = len(passes)
        for q in sub.passes:
            logical = torch.where(q.logical < p, q.logical, q.logical + shift)
            calls = tuple(
                replace(c, kv_indices=slot_map[c.kv_indices.long()].to(torch.int32)) for c in q.calls
            )
            passes.append(Pass(logical, slot + q.slot_offset, calls))
        if k == 0:
            prefix_slots = torch.nonzero(passes[0].logical < p).flatten()[:p]
        items += [loc._replace(pass_idx=loc.pass_idx + first_pass) for loc in sub.items[0]]
    return Plan(tuple(passes), (tuple(items),), (shape,))
