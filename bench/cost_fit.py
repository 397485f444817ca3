"""Fit and evaluate ``auto``'s cost model (scorer/planning/cost_model.py) from the benchmarks' JSON.

    python -m bench.cost_fit fit bench/data/cost_model/e2e.json bench/data/cost_model/kernels_wide.json \
        --e2e-more bench/data/cost_model/e2e_cascade.json
    python -m bench.cost_fit evaluate bench/data/cost_model/e2e.json [--objective forward|latency]
    (``--e2e-more`` to both: later runs of some schemes that replace their results cell by cell)

``fit`` writes the predictor's data file, ``scorer/planning/cost_model.json``; ``evaluate`` compares
``auto`` with the article's rule and the fastest scheme on the held-out shapes.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from scorer.planning import get
from scorer.planning.base import Shape
from scorer.planning.choose import article_choice
from scorer.planning.cost_model import DATA, CostModel, gemm_rows, label, planner_features


def _masked(name: str) -> bool:
    """The scheme of a benchmark label carries an explicit mask (it runs on FA2 only)."""
    return get(name.split(":")[0]).explicit_mask


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
            r = c["results"].get(f"{name}/{'fa2' if _masked(name) else kernel}", {})
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


def load_e2e(first: Path, more: list[Path]) -> dict:
    """A model-level run, its cells filled by later runs of some schemes (``bench.e2e --schemes``):
    per cell, a later run's result of a variant replaces the earlier one; the GEMM curve is the
    first run's."""
    return merge_grids([json.loads(p.read_text()) for p in (first, *more)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.cost_fit", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit on the train shapes and write the model's data file")
    f.add_argument("e2e_json", type=Path)
    f.add_argument("kernels_json", type=Path, nargs="+", help="wide-grid runs; later files fill cells")
    f.add_argument("--out", type=Path, default=DATA)
    f.add_argument("--free-gemm", action="store_true", help="fit the GEMM coefficient b per scheme too")
    more = "later model-level runs; their results replace the earlier ones cell by cell"
    f.add_argument("--e2e-more", type=Path, nargs="*", default=[], help=more)
    e = sub.add_parser("evaluate", help="auto vs the article's rule vs the fastest, held-out shapes")
    e.add_argument("e2e_json", type=Path)
    e.add_argument("--model", type=Path, default=DATA)
    e.add_argument("--split", default="heldout")
    e.add_argument("--objective", choices=("latency", "forward"), default="latency")
    e.add_argument("--e2e-more", type=Path, nargs="*", default=[], help=more)
    a = ap.parse_args(argv)
    if a.cmd == "fit":
        kernels = merge_grids([json.loads(k.read_text()) for k in a.kernels_json])
        e2e = load_e2e(a.e2e_json, a.e2e_more)
        data = fit(kernels, e2e, fixed_gemm=not a.free_gemm)
        a.out.write_text(json.dumps(data, indent=1) + "\n")
        for name, c in data["fit"].items():
            print(f"{name:12s} a={c['a']:.3f} ms  b={c['b']:.3f}  c={c['c']:.3f}  (n={c['n']})")
    else:
        e2e = load_e2e(a.e2e_json, a.e2e_more)
        rows, summary = evaluate(e2e, CostModel.load(a.model), a.split, a.objective)
        print(f"{a.split} shapes, objective: {a.objective} (ms)\n")
        print(evaluation_markdown(rows, summary))


if __name__ == "__main__":
    main()
