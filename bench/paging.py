"""A planned pass on pages of ``page_size`` slots instead of single slots, for the page-size benchmark.

The engine keeps a batch's K/V flat (page_size 1: the K/V the layer just computed is the page
pool, nothing is copied). A paged KV cache (vLLM, SGLang) stores K/V in fixed pages instead;
this converts a pass's calls to such a layout to measure whether FlashInfer's kernels run
faster on it. Each request's slot sequence is cut into pages of ``page_size``; identical pages
(the same slots) are stored once, so a shared prompt keeps sharing its full pages and only the
page where the prompt ends and a doc begins is duplicated per doc, as a paged cache would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from scorer.planning.base import AttentionCall, Pass


@dataclass(frozen=True)
class PagedPass:
    pass_: Pass  # the same pass, its calls indexing pages
    slot_of: torch.Tensor  # int64 [pages * page_size]: the slot held at each position of the pool

    def pool(self, kv: torch.Tensor, page_size: int) -> torch.Tensor:
        """``[slots, H, D]`` -> ``[pages, page_size, H, D]`` (a copy; unused positions hold slot 0)."""
        return kv[self.slot_of.to(kv.device)].view(-1, page_size, *kv.shape[1:])


def to_pages(p: Pass, page_size: int) -> PagedPass:
    pages: dict[tuple[int, ...], int] = {}
    calls = [_paged_call(c, page_size, pages) for c in p.calls]
    slot_of = torch.zeros(len(pages) * page_size, dtype=torch.int64)
    for slots, page in pages.items():
        slot_of[page * page_size : page * page_size + len(slots)] = torch.tensor(slots)
    return PagedPass(dataclasses.replace(p, calls=tuple(calls)), slot_of)


def _paged_call(c: AttentionCall, page_size: int, pages: dict[tuple[int, ...], int]) -> AttentionCall:
    if c.page_size != 1:
        raise ValueError("the call is paged already")
    kvp, slots = c.kv_indptr.tolist(), c.kv_indices.tolist()
    indptr, indices, last = [0], [], []
    for i in range(c.num_requests):
        seq = slots[kvp[i] : kvp[i + 1]]
        for j in range(0, len(seq), page_size):
            indices.append(pages.setdefault(tuple(seq[j : j + page_size]), len(pages)))
        indptr.append(len(indices))
        last.append(len(seq) - (len(seq) - 1) // page_size * page_size)
    i32 = torch.int32
    return dataclasses.replace(
        c,
        kv_indptr=torch.tensor(indptr, dtype=i32),
        kv_indices=torch.tensor(indices, dtype=i32),
        page_size=page_size,
        last_page_len=torch.tensor(last, dtype=i32),
    )


def unpage(c: AttentionCall, slot_of: torch.Tensor) -> list[list[int]]:
    """Each request's slot sequence read back through its pages (what the kernel will read)."""
    kvp, out = c.kv_indptr.tolist(), []
    for i in range(c.num_requests):
        seq: list[int] = []
        for page in c.kv_indices[kvp[i] : kvp[i + 1]].tolist():
            seq += slot_of[page * c.page_size : (page + 1) * c.page_size].tolist()
        out.append(seq[: len(seq) - c.page_size + int(c.last_page_len[i])])
    return out
