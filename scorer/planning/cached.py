"""A plan on the prefix cache's K/V pool: only what is not cached is laid out, and every K/V slot
is a slot of the pool.

A request whose prompt has its first ``C`` tokens cached is planned as if its prompt were the
uncached rest (``Shape(P - C, items)``: the planners need no change and the host work is that of
the rows computed, not of the whole prompt). ``on_pool`` then puts the cached part back where it
belongs: every request of an attention call whose K/V list starts with the request's prompt
gets the ``C`` cached slots in front, a multi-item request's ``prefix_len`` grows by ``C``, and an
explicit mask gains ``C`` visible columns. Queries are aligned to the end of their K/V
(FlashInfer's causal convention) and keep their positions (``C..``), so each sees exactly what it
saw with the whole prompt computed. Rows go to the pool: the first copy of each prompt token being
cached to the slot the cache gave it, every other row to a scratch slot. Scheme-agnostic: a new
scheme runs on the cache with no code of its own, as long as its requests list the prompt's K/V
first (every planner here does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from .base import I32, AttentionCall, Pass, Plan, indptr, logical_bases, ranges
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
    """``plan`` (of the uncached shapes) on the pool: ``hits`` per request of the plan (plan
    order); ``scratch(n)`` gives ``n`` free pool slots for the rows that are not being cached.
    Vectorised over requests and rows: a batch holds hundreds of requests."""
    bases = torch.tensor(logical_bases(plan.shapes), dtype=torch.int64)
    prefix = torch.tensor([s.prefix_len for s in plan.shapes], dtype=torch.int64)
    total = sum(s.num_tokens for s in plan.shapes)
    owner = torch.full((total,), -1, dtype=torch.int64)  # the request whose prompt a token is of
    owner[ranges(bases, prefix)] = torch.repeat_interleave(torch.arange(len(prefix)), prefix)
    n_insert = torch.minimum(torch.tensor([len(h.insert) for h in hits], dtype=torch.int64), prefix)
    insert_slot = torch.full((total,), -1, dtype=torch.int64)
    insert_slot[ranges(bases, n_insert)] = torch.cat(
        [h.insert[:n] for h, n in zip(hits, n_insert.tolist(), strict=True)]
    )
    logical = torch.cat([p.logical for p in plan.passes])  # the plan's slot space, pass by pass
    is_insert = _first_occurrences(logical, insert_slot[logical] >= 0)
    slot_of = torch.empty(len(logical), dtype=torch.int64)
    slot_of[is_insert] = insert_slot[logical[is_insert]]
    slot_of[~is_insert] = scratch(int((~is_insert).sum()))
    cached = Cached(
        torch.cat([h.cached for h in hits]),
        torch.tensor([0] + [h.num_cached for h in hits], dtype=torch.int64).cumsum(0),
        owner[logical],
    )
    passes, at = [], 0
    for p in plan.passes:
        if p.slot_offset != at:
            raise ValueError("on_pool expects passes whose slots follow each other")
        calls = tuple(_call(c, slot_of, cached) for c in p.calls)
        passes.append(Pass(p.logical, 0, calls, slots=slot_of[at : at + p.num_rows]))
        at += p.num_rows
    return replace(plan, passes=tuple(passes))


@dataclass(frozen=True)
class Cached:
    """The cached slots of every request, flat (request ``r``'s at ``start[r]..start[r + 1]``),
    and the request whose prompt each plan slot holds (-1: not a prompt's)."""

    slots: torch.Tensor
    start: torch.Tensor
    slot_owner: torch.Tensor


def _first_occurrences(logical: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Rows among ``candidate`` that hold the first copy of their logical token (naive computes
    the prompt once per doc; one copy is cached)."""
    idx = candidate.nonzero().flatten()
    order = torch.sort(logical[idx], stable=True)
    head = torch.ones(len(idx), dtype=torch.bool)
    head[1:] = order.values[1:] != order.values[:-1]
    first = torch.zeros(len(logical), dtype=torch.bool)
    first[idx[order.indices[head]]] = True
    return first


def _call(c: AttentionCall, slot_of: torch.Tensor, cached: Cached) -> AttentionCall:
    """``c`` with its K/V named by pool slot, the cached prompt in front of each request that
    reads its prompt (its K/V list starts with one of the prompt's slots)."""
    kv_lens = (c.kv_indptr[1:] - c.kv_indptr[:-1]).long()
    kv = c.kv_indices.long()
    first = kv[c.kv_indptr[:-1].long().clamp(max=max(len(kv) - 1, 0))]
    reader = cached.slot_owner[first]  # per request: whose prompt it starts with, or -1
    reads = reader >= 0
    start = torch.where(reads, cached.start[reader.clamp(min=0)], 0)
    extra = torch.where(reads, cached.start[reader.clamp(min=0) + 1] - start, 0)
    if not bool(extra.any()):
        return replace(c, kv_indices=slot_of[kv].to(I32))
    new_ptr = indptr((kv_lens + extra).tolist()).long()
    out = torch.empty(int(new_ptr[-1]), dtype=torch.int64)
    out[ranges(new_ptr[:-1], extra)] = cached.slots[ranges(start, extra)]
    out[ranges(new_ptr[:-1] + extra, kv_lens)] = slot_of[kv]
    multi_item, custom_mask = c.multi_item, c.custom_mask
    if multi_item is not None:
        multi_item = replace(multi_item, prefix_len=multi_item.prefix_len + extra.to(I32))
    if custom_mask is not None:
        q_lens = (c.qo_indptr[1:] - c.qo_indptr[:-1]).tolist()
        masks = [
            torch.cat(
                [torch.ones(q, n, dtype=torch.bool), unpack_segment(custom_mask, i, q, int(kv_lens[i]))], 1
            )
            for i, (q, n) in enumerate(zip(q_lens, extra.tolist(), strict=True))
        ]
        custom_mask = pack_segments(masks)
    return replace(
        c, kv_indptr=new_ptr.to(I32), kv_indices=out.to(I32), multi_item=multi_item, custom_mask=custom_mask
    )
