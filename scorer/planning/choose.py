"""``auto``: the policies that pick a concrete scheme (and group size) for one request's shape.

``article_choice`` is the selection guide of the article's section 5.3 written as code; it is
the baseline the GPU-calibrated cost model has to beat.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Shape
from .schemes import MULTI_ITEM, NAIVE, RAGGED

Policy = Callable[[Shape], tuple[str, int]]
"""shape -> (concrete scheme name, group size; 0 unless the scheme is grouped)."""

AUTO_POLICIES = ("default", "calibrated", "article", RAGGED)  # the last: always ragged
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
        return MULTI_ITEM
    if n <= FEW_ITEMS and shape.prefix_len < LONG_PREFIX:
        return NAIVE
    return RAGGED


def auto_policy(name: str, backend: str, device_type: str) -> Policy:
    """How ``auto`` picks. ``calibrated``: the cost model fitted to FlashInfer on the H200;
    ``article``: the article's section 5.3 guide; ``ragged``: always ragged, the measured choice
    of the torch backend on the CPU (``python -m bench.cpu_schemes``: fastest or within 3 ms of it
    at 1-20 docs, while naive is the slowest everywhere). ``default`` takes the calibrated model
    on FlashInfer, ragged on the CPU, and the article's guide for the torch backend on a GPU."""
    if name not in AUTO_POLICIES:
        raise ValueError(f"unknown auto policy {name!r}; expected one of {', '.join(AUTO_POLICIES)}")
    if name == "default":
        name = "calibrated" if backend == "flashinfer" else RAGGED if device_type == "cpu" else "article"
    if name == "calibrated":
        from .cost_model import calibrated_choice

        return calibrated_choice
    if name == RAGGED:
        return lambda shape: (RAGGED, 0)
    return lambda shape: (article_choice(shape), 0)
