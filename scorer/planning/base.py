"""Plans: how a batch of scoring requests runs as forward passes of attention calls.

The vocabulary is FlashInfer's paged prefill with ``page_size = 1``: every token's K/V sits
in one slot of a per-layer pool, and an attention call names the slots each of its requests
reads through ``kv_indptr`` / ``kv_indices``. Rows of pass ``k`` write their K/V to slots
``slot_offset_k + row``, so a single-pass plan uses the pass's own K/V as the pool.

Every request of a batch lives in one *logical* token space: request ``r`` owns ids
``base_r .. base_r + P_r + sum(L_r)``, its prefix first and then its items in order. A pass
says which logical token each of its rows holds; token ids and positions follow from that,
so a scheme can only change *where* a token is computed, never *what* it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import chain, repeat
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from ..lazy_torch import torch

MAX_ITEM_LEN = 65535  # token_pos_in_items is uint16 in FlashInfer


class PlanError(ValueError):
    """A plan would break one of FlashInfer's invariants (or a configured cap)."""


@dataclass(frozen=True)
class Shape:
    """What a planner needs to know about one request: prefix length and item lengths, and how
    many of the prefix's first tokens have their K/V in the prefix cache (``cached``: planners
    lay out the whole prefix; ``cached.on_pool`` takes those rows out)."""

    prefix_len: int
    item_lens: tuple[int, ...]
    cached: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prefix_len + sum(self.item_lens)

    @property
    def computed_prefix(self) -> int:
        """Prefix tokens the model computes: the uncached rest."""
        return self.prefix_len - self.cached

    @property
    def prompt_per_doc_tokens(self) -> int:
        """Tokens of scoring every doc alone, the prompt computed again for each."""
        return self.prefix_len * len(self.item_lens) + sum(self.item_lens)


@dataclass(frozen=True)
class MultiItem:
    """kMultiItemScoring metadata, one entry per request of the call.

    ``token_pos_in_items`` holds, for each request, the 1-based position of every token
    after the prefix inside its item, zero-padded to ``token_pos_in_items_len``.
    """

    prefix_len: torch.Tensor  # int32 [R]
    token_pos_in_items: torch.Tensor  # uint16 [R * token_pos_in_items_len]
    token_pos_in_items_len: int
    max_item_len: torch.Tensor  # int32 [R]


@dataclass(frozen=True)
class CustomMask:
    """An explicit Q x K mask per request, row-major, packed 8 per byte (little bit order).

    ``indptr`` are byte offsets of each request's segment, as FlashInfer's
    ``segment_packbits`` lays them out.
    """

    packed: torch.Tensor  # uint8 [indptr[-1]]
    indptr: torch.Tensor  # int32 [R + 1]


@dataclass(frozen=True)
class AttentionCall:
    """One batch-prefill call over rows ``[q_start, q_end)`` of a pass.

    Request ``i`` of the call has queries ``q_start + qo_indptr[i] .. q_start + qo_indptr[i+1]``
    and reads K/V slots ``kv_indices[kv_indptr[i] : kv_indptr[i+1]]``. With ``causal`` the
    queries are aligned to the end of the request's K/V (FlashInfer's convention). Calls that
    cover the same rows are merged by log-sum-exp.

    The planners emit ``page_size`` 1 (an index is a K/V slot). With a larger ``page_size`` an
    index is a page of that many slots and request ``i`` uses ``last_page_len[i]`` slots of its
    last page (``bench.paging`` converts a plan; FlashInfer runs it, the torch reference does not).
    """

    q_start: int
    q_end: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    causal: bool
    multi_item: MultiItem | None = None
    custom_mask: CustomMask | None = None
    page_size: int = 1
    last_page_len: torch.Tensor | None = None  # int32 [requests]; None: full pages (page_size 1)

    @property
    def num_requests(self) -> int:
        return len(self.qo_indptr) - 1

    @property
    def rows(self) -> tuple[int, int]:
        return (self.q_start, self.q_end)


@dataclass(frozen=True)
class Pass:
    """One forward pass: rows hold ``logical`` tokens, K/V go to ``slot_offset + row`` of the
    plan's own pool, or to ``slots[row]`` of the prefix cache's pool when ``slots`` is set;
    ``copies`` (rows, pool slots): K/V of a pass off the pool that the prefix cache keeps too."""

    logical: torch.Tensor  # int64 [T]
    slot_offset: int
    calls: tuple[AttentionCall, ...]
    slots: torch.Tensor | None = None  # int64 [T]: pool slots (a plan on the prefix cache)
    copies: tuple[torch.Tensor, torch.Tensor] | None = None  # int64 [n] each (``cached.with_pool_copies``)

    @property
    def num_rows(self) -> int:
        return self.logical.shape[0]

    def merge_groups(self) -> list[list[int]]:
        """Indices of calls grouped by identical row range; a group of several is LSE-merged."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, call in enumerate(self.calls):
            groups.setdefault(call.rows, []).append(i)
        return list(groups.values())


class ItemLoc(NamedTuple):
    """Where an item's tokens sit: ``length`` rows from ``row`` in pass ``pass_idx`` (a named
    tuple: a batch's planning makes one per doc, thousands)."""

    pass_idx: int
    row: int
    length: int

    @property
    def score_row(self) -> int:
        return self.row + self.length - 1


@dataclass(frozen=True)
class Plan:
    """Passes of one batch, and where each item's score row comes out.

    ``items`` are per request of the plan, per item; ``requests`` the batch index of each request
    of the plan (``plan_batch`` groups requests by scheme); ``score_rows`` per pass the rows whose
    last hidden state scores an item, and ``item_order`` the permutation that takes those rows,
    gathered pass by pass, to items in plan order (None: they are in that order already).
    """

    passes: tuple[Pass, ...]
    items: tuple[tuple[ItemLoc, ...], ...]  # per request, per item
    shapes: tuple[Shape, ...] = field(default=())
    requests: tuple[int, ...] = field(default=())
    score_rows: tuple[torch.Tensor, ...] = field(default=())
    item_order: torch.Tensor | None = None

    @property
    def num_slots(self) -> int:
        return sum(p.num_rows for p in self.passes)

    @property
    def on_pool(self) -> bool:
        """The plan reads and writes the prefix cache's K/V pool (``cached.on_pool``)."""
        return bool(self.passes) and self.passes[0].slots is not None

    @property
    def num_attention_calls(self) -> int:
        return sum(len(p.calls) for p in self.passes)

    @property
    def num_items(self) -> int:
        return sum(len(locs) for locs in self.items)


def with_score_rows(plan: Plan, requests: Sequence[int]) -> Plan:
    """``plan`` with its read-out: the score rows of each pass and the item order."""
    if len(plan.passes) == 1:  # every item in pass 0: its score rows, in plan order
        locs = np.fromiter(chain.from_iterable(chain.from_iterable(plan.items)), np.int64, 3 * plan.num_items)
        score_rows = (torch.from_numpy(locs[1::3] + locs[2::3] - 1),)  # row + length - 1
        return replace(plan, requests=tuple(requests), score_rows=score_rows, item_order=None)
    per_pass: list[list[int]] = [[] for _ in plan.passes]
    gathered: list[tuple[int, int]] = []  # (pass, index within its pass's score rows), plan order
    for locs in plan.items:
        for loc in locs:
            rows = per_pass[loc.pass_idx]
            gathered.append((loc.pass_idx, len(rows)))
            rows.append(loc.score_row)
    starts = [sum(len(r) for r in per_pass[:k]) for k in range(len(per_pass))]
    order = [starts[k] + i for k, i in gathered]
    identity = order == list(range(len(order)))
    return replace(
        plan,
        requests=tuple(requests),
        score_rows=tuple(torch.tensor(r, dtype=torch.long) for r in per_pass),
        item_order=None if identity else torch.tensor(order, dtype=torch.long),
    )


def item_locs(pass_idx: int, rows: Sequence[int], lengths: Sequence[int]) -> list[ItemLoc]:
    """``[ItemLoc(pass_idx, r, n) for r, n in zip(rows, lengths)]`` without a Python call per
    item (a NamedTuple's constructor is a Python function; ``tuple.__new__`` is what it calls)."""
    return list(map(tuple.__new__, repeat(ItemLoc), zip(repeat(pass_idx), rows, lengths)))


def logical_bases(shapes: Sequence[Shape]) -> list[int]:
    bases, total = [], 0
    for s in shapes:
        bases.append(total)
        total += s.num_tokens
    return bases


def item_offsets(shape: Shape) -> list[int]:
    """Logical offset (within the request) of each item's first token."""
    offs, at = [], shape.prefix_len
    for n in shape.item_lens:
        offs.append(at)
        at += n
    return offs


def arange(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def indptr(lengths: Sequence[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    return out


def call(
    q_start: int,
    q_lens: Sequence[int],
    kv: Sequence[torch.Tensor],
    causal: bool,
    multi_item: MultiItem | None = None,
    custom_mask: CustomMask | None = None,
) -> AttentionCall:
    """An attention call from per-request query lengths and K/V slot lists."""
    kv_indices = torch.cat(list(kv)).to(torch.int32) if kv else torch.zeros(0, dtype=torch.int32)
    return AttentionCall(
        q_start=q_start,
        q_end=q_start + sum(q_lens),
        qo_indptr=indptr(q_lens),
        kv_indptr=indptr([len(k) for k in kv]),
        kv_indices=kv_indices,
        causal=causal,
        multi_item=multi_item,
        custom_mask=custom_mask,
    )


def np_ranges(starts: np.ndarray, lengths: np.ndarray, dtype=np.int64) -> np.ndarray:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorised: the planners' hot
    paths, in numpy, where torch's per-op cost on small CPU tensors (microseconds each) would be
    most of the work. ``dtype`` int32 gives the int64 result cast
    to int32 (both wrap alike) at half the memory traffic: K/V indices, tens of thousands."""
    ends = np.cumsum(lengths)
    out = np.repeat((starts - (ends - lengths)).astype(dtype), lengths)
    out += iota(len(out))
    return out


_IOTA = np.zeros(0, dtype=np.int32)
_IOTA_CAP = 1 << 21  # 8 MiB kept at most


def iota(n: int) -> np.ndarray:
    """``np.arange(n)`` (int32, read-only), sliced from a buffer kept between plans up to
    ``_IOTA_CAP`` values: ``np.arange`` fills at about 0.2 ns a value, a third of ``np_ranges``."""
    global _IOTA
    if n > len(_IOTA):
        if n > _IOTA_CAP:
            return np.arange(n, dtype=np.int32)
        grown = np.arange(min(max(n, 2 * len(_IOTA)), _IOTA_CAP), dtype=np.int32)
        grown.flags.writeable = False
        _IOTA = grown
    return _IOTA[:n]


def np_i32(a: np.ndarray) -> torch.Tensor:
    """A numpy array of indices as the int32 tensor the attention calls take."""
    return torch.from_numpy(a.astype(np.int32))


def np_indptr(lengths: np.ndarray) -> torch.Tensor:
    """``indptr`` of a numpy array of lengths."""
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return torch.from_numpy(out)


def multi_item_meta(prefix_lens: Sequence[int], items_per_request: Sequence[Sequence[int]]) -> MultiItem:
    """kMultiItemScoring metadata for requests whose K/V is ``prefix + their items`` (laid out in
    numpy: torch's per-op cost on these small tensors made it 0.2 ms a pooled hit's batch)."""
    counts = np.fromiter(map(len, items_per_request), np.int64, len(items_per_request))
    lens = np.fromiter(chain.from_iterable(items_per_request), np.int64, int(counts.sum()))
    first = np.zeros(len(counts) + 1, dtype=np.int64)  # each request's first item, and the end
    np.cumsum(counts, out=first[1:])
    before = np.zeros(len(lens) + 1, dtype=np.int64)  # tokens of the items before each
    np.cumsum(lens, out=before[1:])
    totals = before[first[1:]] - before[first[:-1]]
    width = max(int(totals.max(initial=0)), 1)
    pos = np.zeros(len(counts) * width, dtype=np.uint16)  # 1..n within each item, wrapping as uint16
    if len(lens):
        cols = np_ranges(np.arange(len(counts), dtype=np.int64) * width, totals)
        pos[cols] = np_ranges(np.ones_like(lens), lens).astype(np.uint16)
    longest = np.zeros(len(counts), dtype=np.int32)
    some = counts > 0  # reduceat gives an empty request the next one's first item
    if some.any():
        longest[some] = np.maximum.reduceat(lens, first[:-1][some])
    return MultiItem(
        prefix_len=torch.tensor(list(prefix_lens), dtype=torch.int32),
        token_pos_in_items=torch.from_numpy(pos),
        token_pos_in_items_len=width,
        max_item_len=torch.from_numpy(longest),
    )


def check_plan(plan: Plan, max_custom_mask_tokens: int) -> None:
    """Raise PlanError unless every pass is something FlashInfer runs exactly."""
    num_slots = plan.num_slots
    for k, p in enumerate(plan.passes):
        ranges = sorted({c.rows for c in p.calls})
        for (s0, e0), (s1, _) in zip(ranges, ranges[1:], strict=False):
            if s1 < e0:
                raise PlanError(f"pass {k}: calls over rows [{s0},{e0}) and [{s1},..) overlap partly")
        for c in p.calls:
            _check_call(c, p.slot_offset + p.num_rows, max_custom_mask_tokens, f"pass {k}")
        covered = 0  # the calls' rows, in order, leave no row of the pass out
        for s0, e0 in ranges:
            if s0 > covered:
                break
            covered = max(covered, e0)
        if covered < p.num_rows:
            raise PlanError(f"pass {k}: rows without an attention call")
    if max(map(attrgetter("length"), chain.from_iterable(plan.items)), default=0) > MAX_ITEM_LEN:
        r, longest = max(
            enumerate(max((loc.length for loc in locs), default=0) for locs in plan.items), key=lambda x: x[1]
        )
        raise PlanError(f"request {r}: item of {longest} tokens exceeds {MAX_ITEM_LEN}")
    if any(len(p.calls) == 0 for p in plan.passes) or num_slots == 0:
        raise PlanError("empty pass")


def _check_call(c: AttentionCall, visible_slots: int, mask_cap: int, where: str) -> None:
    qo, kvp = c.qo_indptr.numpy().astype(np.int64), c.kv_indptr.numpy().astype(np.int64)  # numpy: thousands
    kv = c.kv_indices.numpy()
    q_lens, kv_lens = qo[1:] - qo[:-1], kvp[1:] - kvp[:-1]
    if int(qo[-1]) != c.q_end - c.q_start or int(kvp[-1]) != len(kv):
        raise PlanError(f"{where}: indptr does not match rows or kv_indices")
    if len(q_lens) and (q_lens.min() < 0 or kv_lens.min() < 1):
        raise PlanError(f"{where}: empty or negative request")
    if len(kv) and (int(kv.min()) < 0 or int(kv.max()) >= visible_slots):
        raise PlanError(f"{where}: kv_indices outside the slots written so far")
    if c.causal and bool((q_lens > kv_lens).any()):
        raise PlanError(f"{where}: causal request with more queries than keys")
    if c.multi_item is not None:
        m = c.multi_item
        pos = m.token_pos_in_items.to(torch.int32).view(c.num_requests, m.token_pos_in_items_len)
        if bool((m.max_item_len < pos.max(dim=1).values).any()):
            raise PlanError(f"{where}: max_item_len below the longest item")
        if bool((m.max_item_len > MAX_ITEM_LEN).any()):
            raise PlanError(f"{where}: item longer than {MAX_ITEM_LEN} tokens")
        if bool((kv_lens - m.prefix_len.numpy() > m.token_pos_in_items_len).any()):
            raise PlanError(f"{where}: token_pos_in_items shorter than the items")
    if c.custom_mask is not None:
        if max(int(q_lens.max()), int(kv_lens.max())) > mask_cap:
            raise PlanError(f"{where}: custom mask over {mask_cap} tokens; use multi_item")
        need = ((q_lens * kv_lens + 7) // 8).tolist()
        if (c.custom_mask.indptr[1:] - c.custom_mask.indptr[:-1]).tolist() != need:
            raise PlanError(f"{where}: packed mask segments do not match request sizes")
