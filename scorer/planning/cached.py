"""A plan on the prefix cache's K/V pool: the cached prompt tokens' rows taken out, every K/V
slot a slot of the pool.

The planners lay out each request's whole prompt. ``on_pool`` then drops the rows of the tokens
whose K/V the cache holds (every copy: naive's per-doc copies of the prompt too), sends the first
copy of each token being cached to the slot the cache gave it and every other row to a scratch
slot, and renames every ``kv_indices`` entry to the pool slot of the token it named. Queries are
aligned to the end of their K/V (FlashInfer's causal convention) and keep their positions, so a
request that lost its first rows sees exactly what it saw; a request left without queries
(cascade's prefix level on a fully cached prompt) leaves its call. Scheme-agnostic: a new scheme
runs on the cache with no code of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from .base import I32, AttentionCall, ItemLoc, MultiItem, Pass, Plan, indptr, logical_bases
from .packbits import pack_segments, unpack_segment


@dataclass(frozen=True)
class PrefixHit:
    """What the cache holds of one request's prompt: the pool slots of its first ``len(cached)``
    tokens, and the slots the batch writes the next ``len(insert)`` prompt tokens to."""

    cached: torch.Tensor  # int64 [C]
    insert: torch.Tensor  # int64 [n]

    @property
    def num_cached(self) -> int:
        return len(self.cached)


NO_HIT = PrefixHit(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))


def on_pool(plan: Plan, hits: Sequence[PrefixHit], scratch: Callable[[int], torch.Tensor]) -> Plan:
    """``plan`` on the pool: ``hits`` per request of the plan (plan order); ``scratch(n)`` gives
    ``n`` free pool slots for the rows that are neither cached nor being cached."""
    bases = logical_bases(plan.shapes)
    total = bases[-1] + plan.shapes[-1].num_tokens if bases else 0
    cached_slot = torch.full((total,), -1, dtype=torch.int64)
    insert_slot = torch.full((total,), -1, dtype=torch.int64)
    for base, h in zip(bases, hits, strict=True):
        c = h.num_cached
        cached_slot[base : base + c] = h.cached
        insert_slot[base + c : base + c + len(h.insert)] = h.insert
    logical = torch.cat([p.logical for p in plan.passes])  # the plan's slot space, pass by pass
    is_cached = cached_slot[logical] >= 0
    is_insert = _first_occurrences(logical, insert_slot[logical] >= 0)
    rest = ~is_cached & ~is_insert
    slot_of = torch.empty(len(logical), dtype=torch.int64)
    slot_of[is_cached] = cached_slot[logical[is_cached]]
    slot_of[is_insert] = insert_slot[logical[is_insert]]
    slot_of[rest] = scratch(int(rest.sum()))
    passes, kept_before, at = [], [], 0
    for p in plan.passes:
        if p.slot_offset != at:
            raise ValueError("on_pool expects passes whose slots follow each other")
        keep = ~is_cached[at : at + p.num_rows]
        kb = torch.zeros(p.num_rows + 1, dtype=torch.int64)
        kb[1:] = keep.cumsum(0)
        calls = tuple(c for c in (_call(c, kb, keep, slot_of) for c in p.calls) if c is not None)
        passes.append(Pass(p.logical[keep], 0, calls, slots=slot_of[at : at + p.num_rows][keep]))
        kept_before.append(kb)
        at += p.num_rows
    items = tuple(
        tuple(ItemLoc(loc.pass_idx, int(kept_before[loc.pass_idx][loc.row]), loc.length) for loc in locs)
        for locs in plan.items
    )
    score_rows = tuple(kb[rows] for kb, rows in zip(kept_before, plan.score_rows, strict=True))
    return replace(plan, passes=tuple(passes), items=items, score_rows=score_rows)


def _first_occurrences(logical: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Rows among ``candidate`` that hold the first copy of their logical token."""
    idx = candidate.nonzero().flatten()
    order = torch.sort(logical[idx], stable=True)
    head = torch.ones(len(idx), dtype=torch.bool)
    head[1:] = order.values[1:] != order.values[:-1]
    first = torch.zeros(len(logical), dtype=torch.bool)
    first[idx[order.indices[head]]] = True
    return first


def _call(c: AttentionCall, kept_before: torch.Tensor, keep: torch.Tensor, slot_of) -> AttentionCall | None:
    """``c`` with its cached query rows taken out and its K/V named by pool slot; None when no
    request of it has a query left."""
    bounds = kept_before[c.qo_indptr.long() + c.q_start]
    q_lens = bounds[1:] - bounds[:-1]
    live = q_lens > 0
    if not bool(live.any()):
        return None
    kv_lens = (c.kv_indptr[1:] - c.kv_indptr[:-1]).long()
    kv = slot_of[c.kv_indices.long()]
    multi_item, custom_mask = c.multi_item, c.custom_mask
    if not bool(live.all()):
        kv = kv[torch.repeat_interleave(live, kv_lens)]
        if multi_item is not None:
            multi_item = _live_items(multi_item, live)
    if custom_mask is not None:
        q_old = (c.qo_indptr[1:] - c.qo_indptr[:-1]).tolist()
        masks = []
        for i in live.nonzero().flatten().tolist():
            rows = keep[c.q_start + int(c.qo_indptr[i]) : c.q_start + int(c.qo_indptr[i + 1])]
            masks.append(unpack_segment(custom_mask, i, q_old[i], int(kv_lens[i]))[rows])
        custom_mask = pack_segments(masks)
    return replace(
        c,
        q_start=int(bounds[0]),
        q_end=int(bounds[-1]),
        qo_indptr=indptr(q_lens[live].tolist()),
        kv_indptr=indptr(kv_lens[live].tolist()),
        kv_indices=kv.to(I32),
        multi_item=multi_item,
        custom_mask=custom_mask,
    )


def _live_items(m: MultiItem, live: torch.Tensor) -> MultiItem:
    pos = m.token_pos_in_items.view(len(live), m.token_pos_in_items_len)[live]
    return MultiItem(m.prefix_len[live], pos.flatten(), m.token_pos_in_items_len, m.max_item_len[live])
