"""A toy eighth scheme, registered as one record: ragged with each prompt's docs in reverse row
order (every doc reads the prefix and its own rows). Importing this module registers it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from scorer.planning import REGISTRY, Plan, Shape, scheme
from scorer.planning.base import ItemLoc, call, item_offsets, logical_bases
from scorer.planning.extend import extend_per_item
from scorer.planning.schemes import _Rows

TOY = "reversed_ragged"


def reversed_ragged(shapes: Sequence[Shape], group: int = 0) -> Plan:
    """Ragged with the docs of every prompt in reverse order in the pass."""
    rows, q_lens, kv, items = _Rows(0), [], [], []
    for base, s in zip(logical_bases(shapes), shapes, strict=True):
        prow = rows.add(base, s.prefix_len)
        starts = [base + o for o in item_offsets(s)]
        last = len(s.item_lens) - 1
        locs: list[ItemLoc] = [ItemLoc(0, 0, 0)] * len(s.item_lens)
        for i in range(last, -1, -1):
            locs[i] = ItemLoc(0, rows.add(starts[i], s.item_lens[i]), s.item_lens[i])
        prefix = rows.slots(prow, s.prefix_len)
        for i in range(last, -1, -1):
            q_lens.append(locs[i].length + (s.prefix_len if i == last else 0))  # the first carries the prefix
            kv.append(torch.cat([prefix, rows.slots(locs[i].row, locs[i].length)]))
        items.append(tuple(locs))
    return Plan((rows.to_pass([call(0, q_lens, kv, causal=True)]),), tuple(items), tuple(shapes))


def register() -> None:
    if TOY not in REGISTRY:
        scheme(TOY, extend=extend_per_item)(reversed_ragged)


register()
