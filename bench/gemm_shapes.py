"""The forward's GEMMs one by one, as the fused GPU path calls them, against an 8192^3 matmul.

For each model and row count M (a pass's rows: C's 16,100 + 4,100 greedy passes, the 10,100 of a
balanced split, A's and E's ~15-16k batches), the layer's four GEMMs as ``scorer.models.decoder``
runs them: ``mm`` for q/k/v (one weight) and gate/up (one weight), ``addmm_`` into the residual for
the output and down projections. Each is timed with CUDA events (median of ``--iters``) and
reported in TFLOP/s and as a fraction of the same run's 8192^3 bf16 matmul. cuBLAS reads its
workspace size once per process (``CUBLAS_WORKSPACE_CONFIG``, ``CUBLASLT_WORKSPACE_SIZE``), so a
workspace comparison is two runs; ``--label`` names each. GPU only.

``--sweep A:B:STEP`` times the four over every row count of a range and prints one line per
count: their sum (a layer's GEMM time) and the smallest sum at any count at or above it, the
time a pass would take if it were padded to the best larger size.

    python -m bench.gemm_shapes --out DIR [--rows 4100,10100,16100] [--label default]
    python -m bench.gemm_shapes --out DIR --rows "" --sweep 3072:16384:64
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from .timing import time_ms

MODELS = {"0.6b": (1024, 2048, 1024, 3072), "8b": (4096, 4096, 1024, 12288)}  # h, q, kv, mlp width


def matmul_tflops(n: int) -> float:
    x, y, z = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return 2 * n**3 / time_ms(lambda: torch.mm(x, y, out=z), 20) / 1e9


def gemms(model: str, m: int) -> dict:
    """name -> (function, FLOPs) for the layer's GEMMs on ``m`` rows."""
    h, q, kv, i = MODELS[model]
    dev, dt = "cuda", torch.bfloat16
    x, res = torch.randn(m, h, device=dev, dtype=dt), torch.randn(m, h, device=dev, dtype=dt)
    w_qkv, w_o = torch.randn(q + 2 * kv, h, device=dev, dtype=dt), torch.randn(h, q, device=dev, dtype=dt)
    w_gu, w_down = torch.randn(2 * i, h, device=dev, dtype=dt), torch.randn(h, i, device=dev, dtype=dt)
    attn, act = torch.randn(m, q, device=dev, dtype=dt), torch.randn(m, i, device=dev, dtype=dt)
    out_qkv, out_gu = (
        torch.empty(m, q + 2 * kv, device=dev, dtype=dt),
        torch.empty(m, 2 * i, device=dev, dtype=dt),
    )
    return {
        "qkv": (lambda: torch.mm(x, w_qkv.t(), out=out_qkv), 2 * m * h * (q + 2 * kv)),
        "o+res": (lambda: res.addmm_(attn, w_o.t()), 2 * m * q * h),
        "gate_up": (lambda: torch.mm(x, w_gu.t(), out=out_gu), 2 * m * h * 2 * i),
        "down+res": (lambda: res.addmm_(act, w_down.t()), 2 * m * i * h),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--models", default="0.6b")
    ap.add_argument("--rows", default="4100,10100,15400,16100,20100")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--label", default="default")
    ap.add_argument("--sweep", default="", help="A:B:STEP, row counts of a sweep (sums only)")
    ap.add_argument("--sweep-iters", type=int, default=20)
    a = ap.parse_args(argv)
    n = 8192
    ref = matmul_tflops(n)
    env = {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")}
    print(f"{a.label}: matmul {ref:.0f} TFLOP/s; {env}")
    print("| label | model | rows | GEMM | ms | TFLOP/s | of matmul |")
    print("|---|---|---:|---|---:|---:|---:|")
    records = []
    for model in a.models.split(","):
        for m in [int(x) for x in a.rows.split(",") if x]:
            for name, (fn, flops) in gemms(model, m).items():
                ms = time_ms(fn, a.iters)
                tf = flops / ms / 1e9
                records.append(
                    dict(label=a.label, model=model, rows=m, gemm=name, ms=ms, tflops=tf, of_matmul=tf / ref)
                )
                print(
                    f"| {a.label} | {model} | {m} | {name} | {ms:.4f} | {tf:.0f} | {tf / ref:.3f} |",
                    flush=True,
                )
    sweep = []
    if a.sweep:
        lo, hi, step = map(int, a.sweep.split(":"))
        for model in a.models.split(","):
            ms_ = {
                m: sum(time_ms(fn, a.sweep_iters) for fn, _ in gemms(model, m).values())
                for m in range(lo, hi + 1, step)
            }
            best = float("inf")
            for m in sorted(ms_, reverse=True):
                best = min(best, ms_[m])
                sweep.append(
                    dict(label=a.label, model=model, rows=m, layer_ms=ms_[m], best_at_or_above_ms=best)
                )
            sweep.sort(key=lambda r: (r["model"], r["rows"]))
        print("| model | rows | layer GEMMs ms | best at or above | ns a row |")
        print("|---|---:|---:|---:|---:|")
        for r in sweep:
            ns, best = 1e6 * r["layer_ms"] / r["rows"], r["best_at_or_above_ms"]
            print(f"| {r['model']} | {r['rows']} | {r['layer_ms']:.4f} | {best:.4f} | {ns:.2f} |")
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"gemm_shapes_{a.label}.json"
    path.write_text(
        json.dumps({"matmul_tflops": ref, "env": env, "records": records, "sweep": sweep}, indent=1)
    )


if __name__ == "__main__":
    main()
