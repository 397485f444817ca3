"""The scheme registry: one record per way of running a request, registered beside its planner.

A scheme is a ``Scheme`` record: its planner (shapes in, Plan out), how a request over the token
budget continues in later passes (``extend``), whether it recomputes the prompt per document, whether
it takes a group size, and whether it carries an explicit mask (capped). Adding a scheme is one
``@scheme`` planner here (or anywhere, before the engine is built) and its tests; nothing else
names schemes. The worked example of the article (P = 96, two items of 4 tokens) gives ragged
``qo_indptr = [0, 100, 104]`` and multi-item ``token_pos_in_items = [1, 2, 3, 4, 1, 2, 3, 4]``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import chain

import numpy as np

from ..lazy_torch import torch
from .base import (
    AttentionCall,
    ItemLoc,
    Pass,
    Plan,
    PlanError,
    Shape,
    arange,
    call,
    item_locs,
    item_offsets,
    logical_bases,
    multi_item_meta,
    np_indptr,
    np_ranges,
)
from .extend import extend_groups, extend_one_group, extend_per_item
from .packbits import multi_item_mask_packed

AUTO = "auto"
NAIVE, SPLIT_CACHE, RAGGED, CASCADE = "naive", "split_cache", "ragged", "cascade"
MULTI_ITEM, CUSTOM_MASK, GROUPED = "multi_item", "custom_mask", "grouped"
DEFAULT_GROUP_SIZE = 8
"""Docs per group of ``grouped`` when neither the request nor the server says."""

PlanFn = Callable[[Sequence[Shape], int], Plan]
"""(shapes, group size) -> Plan; the group size is 0 for schemes that take none."""


@dataclass(frozen=True)
class Scheme:
    """How one request runs.

    ``plan`` lays out one or more requests; ``extend`` plans a later pass of a request split over
    the token budget (items only, on the prefix K/V of its first pass), None for a scheme whose
    chunks are independent requests (it recomputes the prompt anyway); ``recomputes_prompt``: the
    prompt goes through the model once per document; ``grouped``: it takes a group size;
    ``explicit_mask``: its passes carry a Q x K mask, capped at the engine's
    ``max_custom_mask_tokens``.
    """

    name: str
    plan: PlanFn
    extend: PlanFn | None = None
    recomputes_prompt: bool = False
    grouped: bool = False
    explicit_mask: bool = False
    summary: str = ""

    def planner(self, group_size: int = 0) -> Callable[[Sequence[Shape]], Plan]:
        return partial(self.plan, group=group_size)

    def rows(self, shape: Shape) -> int:
        """Tokens the scheme puts through the model for ``shape`` (the GEMM rows; the cached
        part of the prefix is not computed)."""
        n = len(shape.item_lens) if self.recomputes_prompt else 1
        return shape.computed_prefix * n + sum(shape.item_lens)

    def mean_rows(self, p: int, s: float, m: int) -> float:
        """``rows`` of ``m`` docs of ``s`` tokens (mean) on a prompt of ``p``."""
        return m * (p + s) if self.recomputes_prompt else p + m * s

    def label(self, group_size: int = 0) -> str:
        """The name with its group size (``grouped:8``), as benchmarks and the cost model key it."""
        return f"{self.name}:{group_size}" if self.grouped else self.name

    def check(self, shape: Shape, budget: int, mask_cap: int) -> None:
        """Raise PlanError when the scheme cannot run ``shape`` under the engine's limits."""
        if not self.explicit_mask:
            return
        largest = shape.num_tokens
        if budget and largest > budget:
            largest = max(budget, shape.prefix_len + max(shape.item_lens))
        if largest > mask_cap:
            raise PlanError(
                f"{self.name} over {largest} tokens exceeds its cap of {mask_cap}; use {MULTI_ITEM}"
            )


REGISTRY: dict[str, Scheme] = {}


def scheme(name: str, **record) -> Callable[[PlanFn], PlanFn]:
    """Register the decorated planner as scheme ``name`` (``record``: the other Scheme fields)."""

    def register(fn: PlanFn) -> PlanFn:
        if name in REGISTRY or name == AUTO:
            raise ValueError(f"scheme {name!r} is registered already")
        REGISTRY[name] = Scheme(name, fn, summary=(fn.__doc__ or "").split("\n")[0], **record)
        return fn

    return register


def unregister(name: str) -> None:
    """Remove a registered scheme (tests that register a toy one)."""
    REGISTRY.pop(name)


def get(name: str) -> Scheme:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown scheme {name!r}; expected one of {', '.join(names())}") from None


def names() -> tuple[str, ...]:
    """Every name a request may ask for: ``auto`` and the registered schemes."""
    return (AUTO, *REGISTRY)


def plugin_modules() -> tuple[str, ...]:
    """The modules outside this one whose planners are registered here: what a process spawned
    by this one (a front end, an engine process) imports first to know the same schemes. A
    script's own (``__main__``) is the spawn's to run again."""
    own = {__name__, "__main__", "__mp_main__"}
    return tuple(sorted({s.plan.__module__ for s in REGISTRY.values()} - own))


def import_plugins(modules: Sequence[str]) -> None:
    """Register the schemes of ``modules`` (``plugin_modules`` of the spawning process)."""
    for module in modules:
        importlib.import_module(module)


class _Rows:
    """Rows of one pass under construction: appended logical ranges, slot ids of each."""

    def __init__(self, slot_offset: int) -> None:
        self.slot_offset = slot_offset
        self.chunks: list[torch.Tensor] = []
        self.n = 0

    def add(self, logical_start: int, length: int) -> int:
        """Append ``length`` logical tokens; returns their first row."""
        row = self.n
        self.chunks.append(arange(logical_start, length))
        self.n += length
        return row

    def slots(self, row: int, length: int) -> torch.Tensor:
        return arange(self.slot_offset + row, length)

    def to_pass(self, calls: Sequence[AttentionCall]) -> Pass:
        logical = torch.cat(self.chunks) if self.chunks else torch.zeros(0, dtype=torch.int64)
        return Pass(logical=logical, slot_offset=self.slot_offset, calls=tuple(calls))


def _requests(shapes: Sequence[Shape]):
    for base, s in zip(logical_bases(shapes), shapes, strict=True):
        yield base, s, [base + o for o in item_offsets(s)]


@scheme(NAIVE, recomputes_prompt=True)
def naive(shapes: Sequence[Shape], group: int = 0) -> Plan:
    """Scheme 1: every item is its own ``[prefix + item]`` request; the prefix is recomputed."""
    rows, q_lens, kv, items = _Rows(0), [], [], []
    for base, s, starts in _requests(shapes):
        locs = []
        for start, n in zip(starts, s.item_lens, strict=True):
            first = rows.add(base, s.prefix_len)
            rows.add(start, n)
            q_lens.append(s.prefix_len + n)
            kv.append(rows.slots(first, s.prefix_len + n))
            locs.append(ItemLoc(0, first + s.prefix_len, n))
        items.append(tuple(locs))
    return Plan((rows.to_pass([call(0, q_lens, kv, causal=True)]),), tuple(items), tuple(shapes))


@scheme(SPLIT_CACHE, extend=extend_per_item)
def split_cache(shapes: Sequence[Shape], group: int = 0) -> Plan:
    """Scheme 2: pass 1 runs ``[prefix + item 0]``; pass 2 runs the other items on its prefix K/V."""
    first, items = _Rows(0), []
    q1, kv1, prefix_slots = [], [], []
    for base, s, _ in _requests(shapes):
        row = first.add(base, s.prefix_len + s.item_lens[0])
        q1.append(s.prefix_len + s.item_lens[0])
        kv1.append(first.slots(row, q1[-1]))
        prefix_slots.append(first.slots(row, s.prefix_len))
        items.append([ItemLoc(0, row + s.prefix_len, s.item_lens[0])])
    passes = [first.to_pass([call(0, q1, kv1, causal=True)])]
    second, q2, kv2 = _Rows(first.n), [], []
    for (_, s, starts), pslots, locs in zip(_requests(shapes), prefix_slots, items, strict=True):
        for start, n in zip(starts[1:], s.item_lens[1:], strict=True):
            row = second.add(start, n)
            q2.append(n)
            kv2.append(torch.cat([pslots, second.slots(row, n)]))
            locs.append(ItemLoc(1, row, n))
    if q2:
        passes.append(second.to_pass([call(0, q2, kv2, causal=True)]))
    return Plan(tuple(passes), tuple(tuple(x) for x in items), tuple(shapes))


@scheme(RAGGED, extend=extend_per_item)
def ragged(shapes: Sequence[Shape], group: int = 0) -> Plan:
    """Scheme 3: Q = [prefix, d1, d2, ...]; request i reads prefix slots + its own item's slots."""
    return _shared_prefix_groups(shapes, group_size=1)


@scheme(CASCADE, extend=extend_per_item)
def cascade(shapes: Sequence[Shape], group: int = 0) -> Plan:
    """Scheme 4: rows [all prefixes, all items]; per layer: prefix causal, shared level
    (each prompt's items against its prefix, non-causal), unique level (each item causal
    on itself), and an LSE merge of the two levels over the item rows.
    """
    rows, items = _Rows(0), []
    prefix_rows = [rows.add(base, s.prefix_len) for base, s, _ in _requests(shapes)]
    n_prefix = rows.n
    shared_q, shared_kv, unique_q, unique_kv = [], [], [], []
    for (_, s, starts), prow in zip(_requests(shapes), prefix_rows, strict=True):
        locs = [ItemLoc(0, rows.add(st, n), n) for st, n in zip(starts, s.item_lens, strict=True)]
        items.append(tuple(locs))
        shared_q.append(sum(s.item_lens))
        shared_kv.append(rows.slots(prow, s.prefix_len))
        unique_q += [loc.length for loc in locs]
        unique_kv += [rows.slots(loc.row, loc.length) for loc in locs]
    prefix_call = call(0, [s.prefix_len for s in shapes], shared_kv, causal=True)
    shared = call(n_prefix, shared_q, shared_kv, causal=False)
    unique = call(n_prefix, unique_q, unique_kv, causal=True)
    return Plan((rows.to_pass([prefix_call, shared, unique]),), tuple(items), tuple(shapes))


@scheme(MULTI_ITEM, extend=extend_one_group)
def multi_item(shapes: Sequence[Shape], group: int = 0) -> Plan:
    """Scheme 5a: one logical request [prefix, d1..dN] per prompt with kMultiItemScoring metadata."""
    return _shared_prefix_groups(shapes, group_size=None)


@scheme(CUSTOM_MASK, extend=extend_one_group, explicit_mask=True)
def custom_mask(shapes: Sequence[Shape], group: int = 0) -> Plan:
    """Scheme 5b: the multi-item layout with an explicit, bit-packed Q x K mask per prompt."""
    plan = multi_item(shapes)
    (p,) = plan.passes
    (c,) = p.calls
    mask = multi_item_mask_packed([(s.prefix_len, s.item_lens) for s in shapes])
    masked = call(0, _lens(c.qo_indptr), _split(c.kv_indices, c.kv_indptr), causal=True, custom_mask=mask)
    return Plan((Pass(p.logical, 0, (masked,)),), plan.items, plan.shapes)


@scheme(GROUPED, extend=extend_groups, grouped=True)
def grouped(shapes: Sequence[Shape], group: int = DEFAULT_GROUP_SIZE) -> Plan:
    """Items split into groups of ``group_size``; each group is a multi-item request on the prefix."""
    return _shared_prefix_groups(shapes, group_size=group)


def _shared_prefix_groups(shapes: Sequence[Shape], group_size: int | None) -> Plan:
    """Rows [prefix, items...] per prompt; groups of items are requests sharing the prefix slots.

    The first group of a prompt also carries the prefix queries. ``group_size=1`` is plain
    ragged prefill (no multi-item metadata); ``None`` puts all items of a prompt in one group.
    Rows are the logical tokens in order, so each group reads two runs of slots: its prompt's and
    its own items' (laid out in numpy, without a Python step per item but the ``ItemLoc``: a
    batch holds thousands).
    """
    counts = [len(s.item_lens) for s in shapes]
    lens = np.fromiter(chain.from_iterable([s.item_lens for s in shapes]), np.int64, sum(counts))
    prefix = np.array([s.prefix_len for s in shapes], dtype=np.int64)
    first = np.cumsum([0, *counts])  # each prompt's first item in the flat item order, and the end
    before = np.zeros(len(lens) + 1, dtype=np.int64)  # tokens of the items before each, batch-wide
    np.cumsum(lens, out=before[1:])
    owner = np.repeat(np.arange(len(shapes)), counts)
    ends = np.cumsum(prefix)  # the prefixes up to each prompt's, and items before: an item's row
    starts = ends[owner] + before[:-1]
    base = ends - prefix + before[first[:-1]]  # each prompt's first row
    index = np.arange(len(lens)) - first[owner]  # an item's place in its prompt
    lead = index == 0
    if group_size == 1:  # ragged: every item is a request
        heads, own, g = slice(None), lens, owner
    else:
        heads = np.flatnonzero(index % group_size == 0 if group_size else lead)  # each group's first item
        own, g = np.add.reduceat(lens, heads) if len(heads) else lens[:0], owner[heads]
    q_lens = own + prefix[g] * lead[heads]
    kv_starts, kv_lens = np.empty((2, len(own), 2), dtype=np.int64)  # per group: its prompt's run, its items'
    kv_starts[:, 0], kv_starts[:, 1], kv_lens[:, 0], kv_lens[:, 1] = base[g], starts[heads], prefix[g], own
    kv = np_ranges(kv_starts.ravel(), kv_lens.ravel(), np.int32)
    meta = None
    if group_size != 1:
        meta = multi_item_meta(prefix[g].tolist(), [x.tolist() for x in np.split(lens, heads[1:])])
    flat, cuts = item_locs(0, starts.tolist(), lens.tolist()), first.tolist()
    items = tuple(tuple(flat[a:b]) for a, b in zip(cuts, cuts[1:], strict=False))
    total = int(ends[-1] + before[-1]) if len(shapes) else 0
    kv_indptr = np_indptr(prefix[g] + own)
    c = AttentionCall(0, total, np_indptr(q_lens), kv_indptr, torch.from_numpy(kv), True, meta)
    return Plan((Pass(torch.arange(total, dtype=torch.int64), 0, (c,)),), items, tuple(shapes))


def _lens(ptr: torch.Tensor) -> list[int]:
    return (ptr[1:] - ptr[:-1]).tolist()


def _split(indices: torch.Tensor, ptr: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(indices.to(torch.int64), _lens(ptr)))
