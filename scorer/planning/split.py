"""Splitting one request over a token budget into several passes that reuse its prompt's K/V.

Pass 0 runs the prefix and the first chunk of items with the request's own scheme; every later
pass runs one chunk of items as extend requests on the prefix slots of pass 0, as the scheme's
``extend`` lays them out (``extend.py``: one request per item, one multi-item group, or groups of
a size), so the prompt is still computed once. Those passes need a K/V pool that outlives a pass:
every pass copies each layer's K/V into it (``KVPool``), two copies a layer over all of its rows.

Where the prompt is short, computing it again in every pass costs less than those copies (a
100-token prompt over 20,100 rows: 0.5% more rows against ~4% of the forward in copies on
Qwen3-0.6B). ``recompute_share`` says how many rows may be recomputed, as a share of the
request's: within it each chunk is the prompt and its items, planned as an independent request
whose pass reads only its own rows (``slot_offset`` 0), so the plan needs no pool. A scheme
without ``extend`` recomputes the prompt by definition: its chunks are independent requests.
"""

from __future__ import annotations

from dataclasses import replace

from ..lazy_torch import torch
from .base import ItemLoc, Pass, Plan, Shape, arange, item_offsets
from .schemes import Scheme


def chunk_items(shape: Shape, budget: int, naive: bool, recompute: bool = False) -> list[tuple[int, int]]:
    """Greedy (first item, count) chunks whose pass rows stay within ``budget`` (at least one
    item). The prefix's rows count once per item (``naive``), once per chunk (``recompute``) or in
    the first chunk only."""
    p = shape.prefix_len
    chunks, start, rows = [], 0, 0 if naive else p
    for i, n in enumerate(shape.item_lens):
        cost = n + (p if naive else 0)
        if i > start and rows + cost > budget:
            chunks.append((start, i - start))
            start, rows = i, p if recompute else 0
        rows += cost
    chunks.append((start, len(shape.item_lens) - start))
    return chunks


def split_to_budget(
    scheme: Scheme, shape: Shape, budget: int, group_size: int, recompute_share: float = 0.0
) -> Plan:
    """``scheme``'s plan of ``shape``, but with no pass over ``budget`` rows where items allow;
    the prompt computed again in each pass where that adds at most ``recompute_share`` of the
    request's rows (see the module's docstring)."""
    plan_fn = scheme.planner(group_size)
    naive = scheme.extend is None
    chunks = chunk_items(shape, budget, naive)
    if len(chunks) == 1:
        return plan_fn([shape])
    p, offs = shape.prefix_len, item_offsets(shape)
    recompute = naive
    if not naive and p and recompute_share > 0:
        again = chunk_items(shape, budget, naive, recompute=True)
        if p * (len(again) - 1) <= recompute_share * shape.num_tokens:
            chunks, recompute = again, True
    passes: list[Pass] = []
    items: list[ItemLoc] = []
    prefix_slots = None
    for k, (i0, n) in enumerate(chunks):
        sub_shape = Shape(p, shape.item_lens[i0 : i0 + n])
        shift = offs[i0] - p
        slot = sum(x.num_rows for x in passes)
        sub = plan_fn([sub_shape]) if k == 0 or recompute else scheme.extend([sub_shape], group_size)
        if recompute and len(sub.passes) == 1:  # reads only its own rows: no pool
            slot, slot_map = 0, None
        elif k == 0 or recompute:
            slot_map = arange(slot, sub.num_slots)
        else:
            slot_map = torch.cat([prefix_slots, arange(slot, sub.num_slots)])
        first_pass = len(passes)
        for q in sub.passes:
            logical = torch.where(q.logical < p, q.logical, q.logical + shift)
            calls = q.calls
            if slot_map is not None:
                calls = tuple(
                    replace(c, kv_indices=slot_map[c.kv_indices.long()].to(torch.int32)) for c in calls
                )
            passes.append(Pass(logical, slot + q.slot_offset, calls))
        if k == 0:
            prefix_slots = torch.nonzero(passes[0].logical < p).flatten()[:p]
        items += [loc._replace(pass_idx=loc.pass_idx + first_pass) for loc in sub.items[0]]
    return Plan(tuple(passes), (tuple(items),), (shape,))
