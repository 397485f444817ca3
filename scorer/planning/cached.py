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
from functools import cache

import numpy as np

from ..lazy_torch import torch
from .base import AttentionCall, Pass, Plan, logical_bases, np_i32, np_ranges
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


@cache
def no_hit() -> PrefixHit:
    """The hit of a prompt off the cache (one shared pair of empty tensors, never written to)."""
    return PrefixHit(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))


def _inserts(
    plan: Plan, hits: Sequence[PrefixHit], whole: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The plan's rows as logical tokens (every pass's, in order), which of them hold the first copy
    of a prompt token being cached, the pool slot each logical token is cached to (-1: none) and
    the request whose prompt each logical token is of (-1: an item's). ``whole``: the plan computes
    every prompt token, its cached ones too (the inserts follow them); else it starts after them."""
    bases = np.asarray(logical_bases(plan.shapes), dtype=np.int64)
    prefix = np.fromiter((s.prefix_len for s in plan.shapes), dtype=np.int64, count=len(plan.shapes))
    total = sum(s.num_tokens for s in plan.shapes)
    owner = np.full(total, -1, dtype=np.int64)
    owner[np_ranges(bases, prefix)] = np.repeat(np.arange(len(prefix)), prefix)
    skip = np.fromiter((h.num_cached if whole else 0 for h in hits), dtype=np.int64, count=len(hits))
    n_insert = np.minimum(
        np.fromiter((len(h.insert) for h in hits), dtype=np.int64, count=len(hits)), prefix - skip
    )
    insert_slot = np.full(total, -1, dtype=np.int64)
    if len(hits):
        insert_slot[np_ranges(bases + skip, n_insert)] = np.concatenate(
            [h.insert.numpy()[:n] for h, n in zip(hits, n_insert.tolist(), strict=True)]
        )
    logical = np.concatenate([p.logical.numpy() for p in plan.passes])  # the plan's slot space
    return logical, _first_occurrences(logical, insert_slot[logical] >= 0), insert_slot, owner


def with_pool_copies(plan: Plan, hits: Sequence[PrefixHit]) -> Plan:
    """``plan`` (off the pool, every prompt token computed) writing the prompt tokens ``hits``
    insert (per request of the plan, plan order; they follow the hit's cached tokens, which are
    not read) to the pool as it goes: each pass's ``copies`` name its rows to copy and their pool
    slots, and attention reads the pass's own K/V as off the cache. A batch that only writes the
    cache then copies a few rows a layer, where ``on_pool`` would put every row in the pool and
    read them all back through its page table (7-9% of E's docs/s on the H200)."""
    logical, is_insert, insert_slot, _ = _inserts(plan, hits, whole=True)
    passes, at = [], 0
    for p in plan.passes:
        rows = np.flatnonzero(is_insert[at : at + p.num_rows])
        copies = torch.from_numpy(rows), torch.from_numpy(insert_slot[logical[at + rows]])
        passes.append(replace(p, copies=copies) if len(rows) else p)
        at += p.num_rows
    return replace(plan, passes=tuple(passes))


def on_pool(plan: Plan, hits: Sequence[PrefixHit], scratch: Callable[[int], torch.Tensor]) -> Plan:
    """``plan`` (of the uncached shapes) on the pool: ``hits`` per request of the plan (plan
    order); ``scratch(n)`` gives ``n`` free pool slots for the rows that are not being cached.
    Vectorised over requests and rows in numpy (a batch holds hundreds of requests; torch's CPU
    ops cost microseconds each, numpy's a tenth of that, and this runs before a batch's first
    kernel can start)."""
    logical, is_insert, insert_slot, owner = _inserts(plan, hits)
    slot_of = np.empty(len(logical), dtype=np.int64)
    slot_of[is_insert] = insert_slot[logical[is_insert]]
    slot_of[~is_insert] = scratch(int((~is_insert).sum())).numpy()
    counts = np.fromiter((h.num_cached for h in hits), dtype=np.int64, count=len(hits))
    cached = Cached(
        np.concatenate([h.cached.numpy() for h in hits]) if len(hits) else np.zeros(0, dtype=np.int64),
        np.concatenate([[0], np.cumsum(counts)]),
        owner[logical],
    )
    passes, at = [], 0
    for p in plan.passes:
        if p.slot_offset not in (0, at):
            raise ValueError("on_pool expects passes whose slots follow each other or start at 0")
        # a pass at slot_offset 0 after others reads only its own rows, numbered from 0
        base = at - p.slot_offset
        own = replace(cached, slot_owner=cached.slot_owner[base:]) if base else cached
        calls = tuple(_call(c, slot_of[base:], own) for c in p.calls)
        passes.append(Pass(p.logical, 0, calls, slots=torch.from_numpy(slot_of[at : at + p.num_rows])))
        at += p.num_rows
    return replace(plan, passes=tuple(passes))


@dataclass(frozen=True)
class Cached:
    """The cached slots of every request, flat (request ``r``'s at ``start[r]..start[r + 1]``),
    and the request whose prompt each plan slot holds (-1: not a prompt's); numpy int64."""

    slots: np.ndarray
    start: np.ndarray
    slot_owner: np.ndarray


def _first_occurrences(logical: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Rows among ``candidate`` that hold the first copy of their logical token (naive computes
    the prompt once per doc; one copy is cached)."""
    idx = np.flatnonzero(candidate)
    order = np.argsort(logical[idx], kind="stable")
    values = logical[idx][order]
    head = np.ones(len(idx), dtype=bool)
    head[1:] = values[1:] != values[:-1]
    first = np.zeros(len(logical), dtype=bool)
    first[idx[order[head]]] = True
    return first


def _call(c: AttentionCall, slot_of: np.ndarray, cached: Cached) -> AttentionCall:
    """``c`` with its K/V named by pool slot, the cached prompt in front of each request that
    reads its prompt (its K/V list starts with one of the prompt's slots)."""
    ptr = c.kv_indptr.numpy().astype(np.int64)
    kv_lens = ptr[1:] - ptr[:-1]
    kv = c.kv_indices.numpy().astype(np.int64)
    first = (
        kv[np.minimum(ptr[:-1], max(len(kv) - 1, 0))] if len(kv) else np.zeros(len(kv_lens), dtype=np.int64)
    )
    reader = cached.slot_owner[first] if len(kv) else np.full(len(kv_lens), -1, dtype=np.int64)
    reads = reader >= 0
    owner = np.maximum(reader, 0)
    start = np.where(reads, cached.start[owner], 0)
    extra = np.where(reads, cached.start[owner + 1] - start, 0)
    if not extra.any():
        return replace(c, kv_indices=np_i32(slot_of[kv]))
    new_ptr = np.concatenate([[0], np.cumsum(kv_lens + extra)])
    out = np.empty(int(new_ptr[-1]), dtype=np.int64)
    out[np_ranges(new_ptr[:-1], extra)] = cached.slots[np_ranges(start, extra)]
    out[np_ranges(new_ptr[:-1] + extra, kv_lens)] = slot_of[kv]
    multi_item, custom_mask = c.multi_item, c.custom_mask
    if multi_item is not None:
        multi_item = replace(multi_item, prefix_len=multi_item.prefix_len + np_i32(extra))
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
        c, kv_indptr=np_i32(new_ptr), kv_indices=np_i32(out), multi_item=multi_item, custom_mask=custom_mask
    )
