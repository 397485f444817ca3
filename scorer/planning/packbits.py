"""Explicit attention masks in FlashInfer's packed layout (``segment_packbits``, little bit order).

Each request's Q x K boolean mask is flattened row-major, padded to a whole byte and packed
eight elements per byte, element ``8 * b + k`` in bit ``k`` of byte ``b``; segments follow
each other and ``indptr`` holds their byte offsets.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from ..lazy_torch import torch
from .base import CustomMask, indptr


@cache
def _bits(device: torch.device) -> torch.Tensor:
    """Each bit's value in a byte, lowest first (one tensor per device, made on first use: torch
    is not imported when this module is)."""
    return 1 << torch.arange(8, dtype=torch.int32, device=device)


def multi_item_mask(prefix_len: int, item_lens: Sequence[int]) -> torch.Tensor:
    """The [n, n] mask of one multi-item request: causal prefix, items see prefix + own past."""
    n = prefix_len + sum(item_lens)
    start = torch.zeros(n, dtype=torch.int64)
    at = prefix_len
    for length in item_lens:
        start[at : at + length] = at
        at += length
    i = torch.arange(n).unsqueeze(1)
    j = torch.arange(n).unsqueeze(0)
    return (j <= i) & ((j < prefix_len) | (j >= start.unsqueeze(1)))


def pack_segments(masks: Sequence[torch.Tensor]) -> CustomMask:
    """Pack boolean masks (one per request) into FlashInfer's uint8 bit layout."""
    packed = []
    for m in masks:
        flat = m.flatten().to(torch.int32)
        flat = torch.nn.functional.pad(flat, (0, (-len(flat)) % 8))
        packed.append((flat.view(-1, 8) * _bits(flat.device)).sum(1).to(torch.uint8))
    return CustomMask(packed=torch.cat(packed), indptr=indptr([len(p) for p in packed]))


def unpack_segment(mask: CustomMask, request: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The [q_len, kv_len] boolean mask of one request of a packed mask."""
    seg = mask.packed[int(mask.indptr[request]) : int(mask.indptr[request + 1])].to(torch.int32)
    bits = (seg.unsqueeze(1) & _bits(seg.device)) != 0
    return bits.flatten()[: q_len * kv_len].view(q_len, kv_len)


def multi_item_mask_packed(requests: Sequence[tuple[int, Sequence[int]]]) -> CustomMask:
    return pack_segments([multi_item_mask(p, items) for p, items in requests])
