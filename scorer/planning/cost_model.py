"""GPU-calibrated scheme selection: predicted request latency per scheme, lowest wins.

The latency of a request of ``P`` prompt tokens and ``M`` docs of ``S`` tokens (mean) is the
model-level forward plus the host planner that builds the plan:

    T(scheme) = a + b * gemm(rows) + c * L * attention(scheme, P, S, M) + planner(scheme, P, S, M)

* ``rows`` are the tokens the scheme pushes through the GEMMs: ``M * (P + S)`` for naive (it
  recomputes the prompt per doc), ``P + M * S`` for every other scheme;
* ``gemm(rows)`` is the measured forward time of the model with attention removed (GEMMs,
  norms, RoPE, launches), interpolated in log-log space;
* ``attention`` is the measured time of one attention layer of the scheme (FlashInfer kernels,
  CUDA events), interpolated trilinearly in (log P, log S, log M) on the kernel benchmark's grid;
* ``a`` and ``c`` per scheme are fitted (relative least squares, non-negative) to measured
  model-level forward times (``bench/e2e.py``, the ``train`` shapes only); ``b`` is 1: the GEMM
  curve is measured directly and the same for every scheme (``fit --free-gemm`` fits it too);
* with the engine's CUDA graphs a pass runs padded to its token bucket, so ``gemm`` is read at
  the bucket;
* ``planner`` is linear in 1, the logical tokens, the per-doc page-table size ``M * (P + S)``
  and the square of the logical tokens (the explicit custom mask), fitted on the same shapes
  (relative least squares: a planner taking 0.2 ms matters as much as one taking 200).

Everything measured lives in ``cost_model.json`` beside this file; ``python -m bench.cost_fit``
fits it from the benchmarks' JSON and compares ``auto`` with the article's rule and the fastest
scheme on the held-out shapes.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from functools import cache, lru_cache
from pathlib import Path

import numpy as np

from .base import Shape
from .schemes import CASCADE, MULTI_ITEM, RAGGED, REGISTRY, get

DATA = Path(__file__).with_name("cost_model.json")
DEFAULT_GROUP_SIZES = (4, 16, 64)
MAX_EXTRAPOLATION = 1.0  # kernel-grid steps beyond the last measured point


def label(scheme: str, group_size: int = 0) -> str:
    return get(scheme).label(group_size)


def gemm_rows(scheme: str, p: int, s: float, m: int) -> float:
    return get(scheme).mean_rows(p, s, m)


class CostModel:
    """Predicted latency (ms) of each scheme on a request shape, from ``cost_model.json``."""

    def __init__(self, data: dict) -> None:
        self.data = data
        self.layers = int(data["layers"])
        curve = sorted((int(k), float(v)) for k, v in data["gemm_curve"].items())
        self._buckets = [int(b) for b in data.get("graph_buckets", [])]
        self._gemm_x = np.log([r for r, _ in curve]).tolist()
        self._gemm_y = np.log([t for _, t in curve]).tolist()
        g = data["attention"]["grid"]
        self._axes = tuple(tuple(np.log(np.asarray(g[k], dtype=float)).tolist()) for k in ("P", "S", "M"))
        self._attn = {  # nested lists (scalar reads), None -> NaN: not measured
            k: np.asarray(v, dtype=float).tolist() for k, v in data["attention"]["log_ms"].items()
        }
        self.fit = data["fit"]
        self.planner = data.get("planner", {})
        self.max_mask_tokens = int(data.get("max_mask_tokens", 8448))

    @classmethod
    def load(cls, path: Path = DATA) -> CostModel:
        return cls(json.loads(Path(path).read_text()))

    def gemm_ms(self, rows: float) -> float:
        """The forward without attention; a pass that fits a CUDA-graph bucket runs padded to it."""
        i = bisect_left(self._buckets, rows)
        if i < len(self._buckets):
            rows = self._buckets[i]
        x = math.log(max(rows, 1.0))
        return float(math.exp(_interp1(self._gemm_x, self._gemm_y, x)))

    def attention_ms(self, name: str, p: int, s: float, m: int) -> float:
        """One layer's attention (ms), or inf where the scheme was not measured around the shape."""
        table = self._attn.get(name)
        if table is None:
            return math.inf
        v = _interp3(table, _corners(self._axes, (math.log(p), math.log(max(s, 1.0)), math.log(m))))
        return math.exp(v) if math.isfinite(v) else math.inf

    def predict(self, scheme: str, group_size: int, p: int, s: float, m: int, cached: int = 0) -> float:
        """Predicted request latency (ms): the forward plus the host planner that builds its plan.
        ``cached`` prompt tokens in the prefix cache are not computed: the GEMMs see the uncached
        rows, attention the full prompt as its K/V."""
        args = (scheme, group_size, p, s, m)
        return self.predict_forward(*args, cached=cached) + self.predict_planner(*args)

    def predict_planner(self, scheme: str, group_size: int, p: int, s: float, m: int) -> float:
        c = self.planner.get(label(scheme, group_size))
        return float(np.dot(c, planner_features(p, s, m))) if c else 0.0

    def predict_forward(
        self, scheme: str, group_size: int, p: int, s: float, m: int, cached: int = 0
    ) -> float:
        record = get(scheme)
        name = record.label(group_size)
        coef = self.fit.get(name)
        if coef is None:
            return math.inf
        if record.explicit_mask and p + m * s > self.max_mask_tokens:
            return math.inf
        attn = self.attention_ms(name, p, s, m)
        if coef["c"] > 0 and not math.isfinite(attn):
            return math.inf
        gemm = self.gemm_ms(record.mean_rows(p - cached, s, m))
        return coef["a"] + coef["b"] * gemm + (coef["c"] * self.layers * attn if coef["c"] > 0 else 0.0)

    def candidates(self, m: int, group_sizes: Sequence[int]) -> list[tuple[str, int]]:
        """Every registered scheme the model has data for; grouped ones at each group size."""
        out = []
        for s in REGISTRY.values():
            sizes = [g for g in group_sizes if 1 < g < m] if s.grouped else [0]
            out += [(s.name, g) for g in sizes if s.label(g) in self.fit]
        return out

    def choose(self, shape: Shape, group_sizes: Sequence[int] = DEFAULT_GROUP_SIZES) -> tuple[str, int]:
        """The scheme (and group size) of least predicted latency. A prompt read from the prefix
        cache's pool (``shape.cached``) runs multi-item where cascade wins: the tables price cascade
        for computing the prompt's own attention once, which a pooled prompt does not compute, and
        what is left of it is multi-item's one attention call a layer over the pooled prompt as two
        calls and a merge (three launches a layer on the host). On the H200
        (``scripts/gpu/launch_profile.py``: 8,000-token prompts read from the pool, 32 docs of 4
        tokens, one engine) a lone call took 8.6 ms on multi-item against 14.3 ms as cascade, and
        4 calls a batch 11.1 ms against 25.8."""
        p, m = shape.prefix_len, len(shape.item_lens)
        s = sum(shape.item_lens) / max(m, 1)
        c = shape.cached
        scored = [(self.predict(sc, g, p, s, m, c), sc, g) for sc, g in self.candidates(m, group_sizes)]
        t, scheme, g = min(scored)
        if scheme == CASCADE and c and any(sc == MULTI_ITEM and math.isfinite(x) for x, sc, _ in scored):
            return MULTI_ITEM, 0
        return (scheme, g) if math.isfinite(t) else (RAGGED, 0)


@cache
def _default_model() -> CostModel:
    return CostModel.load()


def calibrated_choice(shape: Shape, group_sizes: Sequence[int] = DEFAULT_GROUP_SIZES) -> tuple[str, int]:
    """The scheme with the lowest predicted latency on the H200 (forward + host planner), and its
    group size (0 unless the scheme is ``grouped``)."""
    return _default_model().choose(shape, tuple(group_sizes))


def _interp1(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear; flat below the first point, the last slope beyond the last (GEMM time
    grows linearly with rows)."""
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    t = max((x - xs[i]) / (xs[i + 1] - xs[i]), 0.0)
    return float(ys[i] + t * (ys[i + 1] - ys[i]))


Corners = tuple[tuple[tuple[int, int, int], float], ...]


@lru_cache(maxsize=1024)
def _corners(axes: tuple[tuple[float, ...], ...], x: tuple[float, float, float]) -> Corners:
    """The grid corners around ``x`` and their trilinear weights (zero weights left out), linear
    extrapolation one step past the edges; shared by every scheme's table, so cached."""
    idx, ts = [], []
    for ax, v in zip(axes, x, strict=True):
        if len(ax) == 1:
            idx.append((0, 0))
            ts.append(0.0)
            continue
        i = min(max(bisect_right(ax, v) - 1, 0), len(ax) - 2)
        t = (v - ax[i]) / (ax[i + 1] - ax[i])
        idx.append((i, i + 1))
        ts.append(max(min(t, 1 + MAX_EXTRAPOLATION), -MAX_EXTRAPOLATION))
    out = []
    for corner in range(8):
        bits = [(corner >> d) & 1 for d in range(3)]
        w = 1.0
        for d, b in enumerate(bits):
            w *= ts[d] if b else 1 - ts[d]
        if w != 0.0:
            out.append(((idx[0][bits[0]], idx[1][bits[1]], idx[2][bits[2]]), w))
    return tuple(out)


def _interp3(table: list, corners: Corners) -> float:
    """Trilinear interpolation of ``table`` at ``corners``; a NaN corner (not measured) -> NaN."""
    total = 0.0
    for (i, j, k), w in corners:
        v = table[i][j][k]
        if not math.isfinite(v):
            return math.nan
        total += w * v
    return float(total)


def planner_features(p: int, s: float, m: int) -> np.ndarray:
    """1, logical tokens N, the page-table size of per-doc requests M * (P + S) (ragged repeats
    the prompt's slots per doc), and N^2 (the explicit custom mask)."""
    n = p + m * s
    return np.asarray([1.0, n, m * (p + s), n * n])
