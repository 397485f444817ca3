"""``auto``: pick a concrete scheme for one request from its shape.

``article_choice`` is the selection guide of the article's section 5.3 written as code; it is
the baseline a GPU-calibrated cost model has to beat.
"""

from __future__ import annotations

from .base import Shape

LONG_PREFIX = 2048  # "P at least a few thousand"
SHORT_ITEM = 16  # "short suffix"; items carry the template's own tokens, so S = 4 is not literal
MANY_ITEMS = 8  # "large batch, M >> 1"
FEW_ITEMS = 4  # "M <= 4"


def article_choice(shape: Shape) -> str:
    """Section 5.3: ragged by default; multi-item for long prefix + many short items; naive for
    a handful of items on a short prefix."""
    n = len(shape.item_lens)
    mean_item = sum(shape.item_lens) / max(n, 1)
    if shape.prefix_len >= LONG_PREFIX and n >= MANY_ITEMS and mean_item <= SHORT_ITEM:
        return "multi_item"
    if n <= FEW_ITEMS and shape.prefix_len < LONG_PREFIX:
        return "naive"
    return "ragged"
