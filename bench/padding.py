"""Rows a saturated server's forward passes pad up to their CUDA-graph bucket, by workload: the
buckets growing by 1/8 alone, with 256-row steps in the top quarter (sessions 9-15) and with
today's (``buckets``'s ``fine``: 128-row steps from a quarter of the budget). Host only: each
workload's calls (``bench.throughput``'s) in full batches of the budget, planned by the engine
(``auto``, the passes of calls split over the budget included), each pass's rows taken to its
bucket. The device time of a padded row is the row-wise work of a Qwen3-0.6B-shaped forward
(GEMMs and elementwise kernels), ``--us-per-row`` as measured on the H200 (bench/RESULTS.md
section 15: 21.4 ms of an A batch's busy time outside attention over 13,104 rows).

    python -m bench.padding [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from scorer.models.graphs import TOP_QUARTER, buckets

from .throughput import MODELS, WORKLOADS, calls, engine_for, full_batches

SERVED = ("A", "A'", "E", "B", "C", "D")


def rows(plan, table: list[int]) -> tuple[int, int]:
    """(tokens, graph rows) of a plan's passes; a pass over the largest bucket runs eagerly."""
    tokens = padded = 0
    for p in plan.passes:
        n = p.num_rows
        tokens += n
        padded += next((b for b in table if b >= n), n)
    return tokens, padded


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--calls", type=int, default=256, help="calls of each workload")
    ap.add_argument("--us-per-row", type=float, default=21.44e3 / 13104)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    engine = engine_for(MODELS["smoke"], torch.device("cpu"), "torch", a.budget)
    tables = {
        "1/8 growth": buckets(a.budget, fine=None),
        "fine top quarter": buckets(a.budget, fine=TOP_QUARTER),
        "128-row steps from a quarter": buckets(a.budget),
    }
    out = {"budget": a.budget, "buckets": {k: len(v) for k, v in tables.items()}, "workloads": {}}
    print(f"buckets: {out['buckets']}")
    names = list(tables)
    print(
        "| workload | tokens a batch | "
        + " | ".join(f"padded rows, {k}" for k in names)
        + " | ms saved (est.) |"
    )
    print("|---|---:|" + "---:|" * (len(names) + 1))
    for w in SERVED:
        jobs = [engine.tokenize(r) for r in calls(w, a.calls, MODELS["smoke"]["vocab_size"])]
        counts = {
            k: [rows(engine.plan(b), t) for b in full_batches(jobs, a.budget)] for k, t in tables.items()
        }
        tokens = statistics.mean(t for t, _ in counts["1/8 growth"])
        pad = {k: statistics.mean(r - t for t, r in v) for k, v in counts.items()}
        saved = (pad[names[1]] - pad[names[-1]]) * a.us_per_row / 1e3  # today's against sessions 9-15's
        out["workloads"][w] = {
            "tokens": tokens,
            "padded_rows": pad,
            "saved_ms_est": saved,
            "shape": WORKLOADS[w],
        }
        cells = " | ".join(f"{pad[k]:,.0f} ({pad[k] / tokens:.1%})" for k in names)
        print(f"| {w} | {tokens:,.0f} | {cells} | {saved:.2f} |")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "padding.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
