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

Everything measured lives in ``cost_model.json`` beside this file. ``python -m
scorer.planning.cost_model evaluate E2E_JSON`` compares ``auto`` with the article's rule and the
fastest scheme on the held-out shapes.
"""

from __future__ import annotations

import argparse
import json
import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from functools import cache, lru_cache
from pathlib import Path

import numpy as np

from ..schemes import UNGROUPED as SCHEMES
from .auto import article_choice
from .base import Shape

DATA = Path(__file__).with_name("cost_model.json")
DEFAULT_GROUP_SIZES = (4, 16, 64)
MAX_EXTRAPOLATION = 1.0  # kernel-grid steps beyond the last measured point


def label(scheme: str, group_size: int = 0) -> str:
    return f"grouped:{group_size}" if scheme == "grouped" else scheme


def gemm_rows(scheme: str, p: int, s: float, m: int) -> float:
    return m * (p + s) if scheme == "naive" else p + m * s


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

    def predict(self, scheme: str, group_size: int, p: int, s: float, m: int) -> float:
        """Predicted request latency (ms): the forward plus the host planner that builds its plan."""
        args = (scheme, group_size, p, s, m)
        return self.predict_forward(*args) + self.predict_planner(*args)

    def predict_planner(self, scheme: str, group_size: int, p: int, s: float, m: int) -> float:
        c = self.planner.get(label(scheme, group_size))
        return float(np.dot(c, planner_features(p, s, m))) if c else 0.0

    def predict_forward(self, scheme: str, group_size: int, p: int, s: float, m: int) -> float:
        name = label(scheme, group_size)
        coef = self.fit.get(name)
        if coef is None:
            return math.inf
        if scheme == "custom_mask" and p + m * s > self.max_mask_tokens:
            return math.inf
        attn = self.attention_ms(name, p, s, m)
        if coef["c"] > 0 and not math.isfinite(attn):
            return math.inf
        gemm = self.gemm_ms(gemm_rows(scheme, p, s, m))
        return coef["a"] + coef["b"] * gemm + (coef["c"] * self.layers * attn if coef["c"] > 0 else 0.0)

    def candidates(self, m: int, group_sizes: Sequence[int]) -> list[tuple[str, int]]:
        out = [(s, 0) for s in SCHEMES]
        return out + [("grouped", g) for g in group_sizes if 1 < g < m and label("grouped", g) in self.fit]

    def choose(self, shape: Shape, group_sizes: Sequence[int] = DEFAULT_GROUP_SIZES) -> tuple[str, int]:
        p, m = shape.prefix_len, len(shape.item_lens)
        s = sum(shape.item_lens) / max(m, 1)
        scored = [(self.predict(sc, g, p, s, m), sc, g) for sc, g in self.candidates(m, group_sizes)]
        t, scheme, g = min(scored)
        return (scheme, g) if math.isfinite(t) else ("ragged", 0)


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


# ---- fitting and evaluation (offline, from the benchmarks' JSON) ----


def merge_grids(runs: list[dict]) -> dict:
    """One kernel grid from several runs (e.g. a later run of the rows a budget cut): per cell,
    the union of the measured variants, later runs winning."""
    cells: dict[tuple[int, int, int], dict] = {}
    for run in runs:
        for c in run["cells"]:
            if "results" in c:
                key = (c["P"], c["S"], c["M"])
                old = cells.get(key, {})
                cells[key] = {**old, **c, "results": {**old.get("results", {}), **c["results"]}}
    return {**runs[0], "cells": list(cells.values())}


def attention_table(kernels: dict, kernel: str = "fa3") -> dict:
    """Per scheme label, the log kernel ms on the wide grid (NaN where not measured)."""
    cells = [c for c in kernels["cells"] if "results" in c]
    ps, ss, ms = (sorted({c[k] for c in cells}) for k in ("P", "S", "M"))
    names = {k.split("/")[0] for c in cells for k in c["results"]}
    tables = {}
    for name in sorted(names):
        t = np.full((len(ps), len(ss), len(ms)), np.nan)
        for c in cells:
            r = c["results"].get(f"{name}/{'fa2' if name == 'custom_mask' else kernel}", {})
            if "mean_ms" in r:
                t[ps.index(c["P"]), ss.index(c["S"]), ms.index(c["M"])] = math.log(r["mean_ms"])
        tables[name] = [
            [[None if math.isnan(x) else round(x, 5) for x in row] for row in plane] for plane in t
        ]
    return {"grid": {"P": ps, "S": ss, "M": ms}, "log_ms": tables}


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (all subsets of the 3 columns)."""
    best, best_err = np.zeros(x.shape[1]), math.inf
    for mask in range(1, 1 << x.shape[1]):
        cols = [j for j in range(x.shape[1]) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(x.shape[1])
        full[cols] = coef
        err = float(((x @ full - y) ** 2).sum())
        if err < best_err:
            best, best_err = full, err
    return best


def measured(e2e: dict, split: str, key: str = "forward_ms") -> list[tuple[tuple[int, int, int], dict]]:
    return [
        ((c["P"], c["S"], c["M"]), {k: r[key] for k, r in c["results"].items() if key in r})
        for c in e2e["cells"]
        if c.get("split") == split and c.get("results")
    ]


def fit(kernels: dict, e2e: dict, max_mask_tokens: int = 8448, fixed_gemm: bool = True) -> dict:
    layers = int(e2e["model"]["num_hidden_layers"])
    data = {
        "version": 1,
        "layers": layers,
        "measured_on": {k: e2e["env"].get(k) for k in ("gpu", "torch", "flashinfer", "nvidia_smi")},
        "gemm_curve": e2e["gemm_curve"],
        "graph_buckets": e2e.get("graph_buckets", []),
        "attention": attention_table(kernels),
        "max_mask_tokens": max_mask_tokens,
        "fit": {name: {"a": 0.0, "b": 1.0, "c": 1.0} for name in attention_table(kernels)["log_ms"]},
    }
    model = CostModel(data)
    train = measured(e2e, "train")
    coefs = {}
    for name in sorted({k for _, t in train for k in t}):
        scheme = name.split(":")[0]
        rows, ys = [], []
        for (p, s, m), t in train:
            if name not in t:
                continue
            attn = model.attention_ms(name, p, s, m)
            if not math.isfinite(attn):
                continue
            rows.append([1.0, model.gemm_ms(gemm_rows(scheme, p, s, m)), layers * attn])
            ys.append(t[name])
        if len(ys) < 3:
            continue
        x, y = np.asarray(rows), np.asarray(ys)
        if fixed_gemm:  # the GEMM term is measured directly and is the same for every scheme
            a, c = _nonneg_lstsq((x[:, [0, 2]]) / y[:, None], 1 - x[:, 1] / y)
            b = 1.0
        else:
            a, b, c = _nonneg_lstsq(x / y[:, None], np.ones(len(y)))
        coefs[name] = {"a": float(a), "b": float(b), "c": float(c), "n": len(ys)}
    data["fit"] = coefs
    data["planner"] = fit_planner(e2e)
    return data


PLANNER_SCALE = np.asarray([1.0, 1e4, 1e5, 1e8])


def planner_features(p: int, s: float, m: int) -> np.ndarray:
    """1, logical tokens N, the page-table size of per-doc requests M * (P + S) (ragged repeats
    the prompt's slots per doc), and N^2 (the explicit custom mask)."""
    n = p + m * s
    return np.asarray([1.0, n, m * (p + s), n * n])


def fit_planner(e2e: dict) -> dict[str, list[float]]:
    """Host planner + plan check ms per scheme, linear in ``planner_features`` (non-negative
    least squares of the relative error, train shapes)."""
    out = {}
    train = measured(e2e, "train", "planner_ms")
    for name in sorted({k for _, t in train for k in t}):
        pts = [(planner_features(p, s, m), t[name]) for (p, s, m), t in train if name in t]
        y = np.asarray([y for _, y in pts])
        x = np.asarray([f for f, _ in pts]) / PLANNER_SCALE / y[:, None]  # relative errors
        coef = _nonneg_lstsq(x, np.ones(len(y))) / PLANNER_SCALE
        out[name] = [float(c) for c in coef]
    return out


def latencies(e2e: dict, split: str, objective: str) -> list[tuple[tuple[int, int, int], dict]]:
    """Measured ms per variant: ``forward`` alone, or ``latency`` (planner + forward)."""
    fwd = measured(e2e, split)
    if objective == "forward":
        return fwd
    plan = dict(measured(e2e, split, "planner_ms"))
    return [(c, {k: v + plan[c].get(k, 0.0) for k, v in t.items()}) for c, t in fwd]


def evaluate(
    e2e: dict, model: CostModel, split: str = "heldout", objective: str = "latency"
) -> tuple[list[dict], dict]:
    """auto (lowest predicted latency) vs the article's rule vs the fastest, on measured times."""
    rows = []
    for (p, s, m), t in latencies(e2e, split, objective):
        best = min(t, key=t.get)
        scheme, g = model.choose(Shape(p, (s,) * m))
        auto = label(scheme, g)
        art = article_choice(Shape(p, (s,) * m))
        rows.append(
            {
                "P": p,
                "S": s,
                "M": m,
                "best": best,
                "best_ms": t[best],
                "auto": auto,
                "auto_ms": t.get(auto, math.nan),
                "article": art,
                "article_ms": t.get(art, math.nan),
                "predicted_ms": model.predict(scheme, g, p, s, m),
            }
        )
    for r in rows:
        r["auto_ok"] = r["auto_ms"] - r["best_ms"] <= max(0.05 * r["best_ms"], 0.005)
    speedups = [r["article_ms"] / r["auto_ms"] for r in rows if r["auto_ms"] > 0 and r["article_ms"] > 0]
    summary = {
        "cells": len(rows),
        "auto_within_goal": sum(r["auto_ok"] for r in rows),
        "geomean_article_over_auto": float(np.exp(np.mean(np.log(speedups)))) if speedups else math.nan,
        "geomean_article_over_best": float(
            np.exp(np.mean(np.log([r["article_ms"] / r["best_ms"] for r in rows])))
        )
        if rows
        else math.nan,
    }
    return rows, summary


def evaluation_markdown(rows: list[dict], summary: dict) -> str:
    lines = [
        "| P | S | M | fastest | ms | auto | ms | within goal | article rule | ms | article / auto |",
        "|---:|---:|---:|---|---:|---|---:|:---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['P']} | {r['S']} | {r['M']} | {r['best']} | {r['best_ms']:.2f} | {r['auto']} | "
            f"{r['auto_ms']:.2f} | {'yes' if r['auto_ok'] else 'NO'} | {r['article']} | "
            f"{r['article_ms']:.2f} | {r['article_ms'] / r['auto_ms']:.2f} |"
        )
    lines.append("")
    sm = summary
    lines.append(
        f"auto within max(5%, 5 us) of the fastest in {sm['auto_within_goal']}/{sm['cells']} cells; "
        f"geometric-mean speed-up of auto over the article's rule {sm['geomean_article_over_auto']:.3f}x "
        f"(of the fastest scheme over the rule: {sm['geomean_article_over_best']:.3f}x)"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m scorer.planning.cost_model", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit on the train shapes and write the model's data file")
    f.add_argument("e2e_json", type=Path)
    f.add_argument("kernels_json", type=Path, nargs="+", help="wide-grid runs; later files fill cells")
    f.add_argument("--out", type=Path, default=DATA)
    f.add_argument("--free-gemm", action="store_true", help="fit the GEMM coefficient b per scheme too")
    e = sub.add_parser("evaluate", help="auto vs the article's rule vs the fastest, held-out shapes")
    e.add_argument("e2e_json", type=Path)
    e.add_argument("--model", type=Path, default=DATA)
    e.add_argument("--split", default="heldout")
    e.add_argument("--objective", choices=("latency", "forward"), default="latency")
    a = ap.parse_args(argv)
    if a.cmd == "fit":
        kernels = merge_grids([json.loads(k.read_text()) for k in a.kernels_json])
        e2e = json.loads(a.e2e_json.read_text())
        data = fit(kernels, e2e, fixed_gemm=not a.free_gemm)
        a.out.write_text(json.dumps(data, indent=1) + "\n")
        for name, c in data["fit"].items():
            print(f"{name:12s} a={c['a']:.3f} ms  b={c['b']:.3f}  c={c['c']:.3f}  (n={c['n']})")
    else:
        e2e = json.loads(a.e2e_json.read_text())
        rows, summary = evaluate(e2e, CostModel.load(a.model), a.split, a.objective)
        print(f"{a.split} shapes, objective: {a.objective} (ms)\n")
        print(evaluation_markdown(rows, summary))


if __name__ == "__main__":
    main()
