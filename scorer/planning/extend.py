"""The later passes of a request split over the token budget (``split.py``): items only, on the
prefix K/V its first pass wrote. Each is a scheme's ``extend`` in the registry (``schemes.py``):
one request per item, one multi-item group, or multi-item groups of a size."""

from __future__ import annotations

from ..lazy_torch import torch
from .base import ItemLoc, Pass, Plan, Shape, arange, call, item_offsets, multi_item_meta


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
