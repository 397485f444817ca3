"""Where the device time of the serving forward goes, by kernel family (torch's profiler, CUPTI).

The engine as ``bench.throughput`` builds it (random bf16 weights in a model's shape, FlashInfer,
CUDA graphs, the given model kernels), batches of at most ``--budget`` tokens of a workload formed
as the server's batcher forms them and pipelined as it runs them. Per batch: the wall time, the
time some kernel ran (busy), and each family's kernel time, launches and share; the GEMMs' rate
against the 8192^3 matmul of the same run. Graph replays are traced per kernel.

    python -m bench.kernel_profile --out out/ [--model qwen3-0.6b] [--workloads A,E] [--kernels fused]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from .throughput import MODELS, batches, calls, engine_for, matmul_tflops
from .timing import environment, sync, write_json

FAMILIES = (  # the first pattern a kernel's name matches names its family
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|splitKreduce"),
    ("attention", r"Prefill|Attention|MergeState|flash"),
    ("qk_norm_rope", r"qk_norm_rope"),
    ("add_rmsnorm", r"FusedAddRMSNorm"),
    ("rmsnorm", r"RMSNorm"),
    ("silu_and_mul", r"act_and_mul|silu"),
    ("residual_add", r"elementwise|CUDAFunctor_add|AddFunctor"),
    ("copy_index", r"index|copy|gather|scatter|Memcpy|Memset|embedding|indexSelect"),
)


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return fam
    return "other"


def gemm_flops(cfg: dict, rows: int) -> float:
    """FLOPs of the layers' GEMMs on ``rows`` token rows (padding rows included: they run)."""
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    return 2 * L * (h * (q + 2 * kv) + q * h + 3 * h * i) * rows


def kernels_of(trace: Path) -> list[dict]:
    events = json.loads(trace.read_text())["traceEvents"]
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


def busy_us(kernels: list[dict]) -> float:
    """Time at least one kernel ran (the union of their intervals)."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k["ts"]):
        s, e = k["ts"], k["ts"] + k["dur"]
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def profile(engine, reqs, budget: int, n_batches: int, tmp: Path) -> dict:
    jobs = [engine.tokenize(replace(r, options=replace(r.options, scheme="auto"))) for r in reqs]
    todo = batches(jobs, budget)
    for b in todo[:3]:
        engine.score_batch(b)
    sync(engine.device)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        t0, waiting = time.perf_counter(), None
        for k in range(n_batches):
            launched = engine.launch(todo[k % len(todo)])
            if waiting is not None:
                waiting()
            waiting = launched
        waiting()
        wall = time.perf_counter() - t0
    trace = tmp / "trace.json"
    prof.export_chrome_trace(str(trace))
    ks = kernels_of(trace)
    fam_us, fam_n, names = defaultdict(float), defaultdict(int), defaultdict(float)
    for k in ks:
        f = family(k["name"])
        fam_us[f] += k["dur"]
        fam_n[f] += 1
        names[k["name"][:90]] += k["dur"]
    tokens = sum(j.tokens for k in range(n_batches) for j in todo[k % len(todo)])
    graph = engine.runner.graphs
    rows = sum(
        (graph.bucket(sum(j.tokens for j in b)) if graph else None) or sum(j.tokens for j in b)
        for b in (todo[k % len(todo)] for k in range(n_batches))
    )
    kernel_us = sum(fam_us.values())
    return {
        "batches": n_batches,
        "tokens_per_batch": tokens / n_batches,
        "rows_per_batch": rows / n_batches,
        "docs_per_batch": sum(len(j.items) for k in range(n_batches) for j in todo[k % len(todo)])
        / n_batches,
        "wall_ms_per_batch": wall * 1e3 / n_batches,
        "busy_ms_per_batch": busy_us(ks) / 1e3 / n_batches,
        "kernel_ms_per_batch": kernel_us / 1e3 / n_batches,
        "families": {
            f: {
                "ms_per_batch": us / 1e3 / n_batches,
                "launches_per_batch": fam_n[f] / n_batches,
                "share": us / kernel_us,
            }  # fmt: skip
            for f, us in sorted(fam_us.items(), key=lambda x: -x[1])
        },
        "top_kernels": [
            {"name": n, "ms_per_batch": us / 1e3 / n_batches}
            for n, us in sorted(names.items(), key=lambda x: -x[1])[:20]
        ],
        "_rows_total": rows,
        "_gemm_us": fam_us["gemm"],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--workloads", default="A,E")
    ap.add_argument(
        "--kernels",
        default="fused",
        help="comma-separated model kernels, each profiled (KERNELS/nodefer:"
        " each layer adds its own MLP residual)",
    )
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    cfg = MODELS[a.model]
    a.out.mkdir(parents=True, exist_ok=True)
    result = {**environment(device), "matmul_tflops": matmul_tflops(device), "records": []}
    for kernels in a.kernels.split(","):
        engine = engine_for(
            cfg, device, kernels.split("/")[0], a.budget, defer=not kernels.endswith("/nodefer")
        )
        for w in a.workloads.split(","):
            rec = {"model": a.model, "kernels": kernels, "workload": w}
            rec |= profile(engine, calls(w, 64, cfg["vocab_size"]), a.budget, a.batches, a.out)
            rows, gemm_us = rec.pop("_rows_total"), rec.pop("_gemm_us")
            rec["gemm_tflops"] = gemm_flops(cfg, rows) / (gemm_us * 1e-6) / 1e12 if gemm_us else None
            result["records"].append(rec)
            write_json(a.out / "kernel_profile.json", result)
            _print(rec, result["matmul_tflops"])
        del engine
        torch.cuda.empty_cache()
    (a.out / "trace.json").unlink(missing_ok=True)


def _print(r: dict, peak: float) -> None:
    print(
        f"\n{r['model']} {r['workload']} kernels={r['kernels']}: {r['tokens_per_batch']:.0f} tokens"
        f" ({r['rows_per_batch']:.0f} rows), {r['docs_per_batch']:.0f} docs a batch; wall"
        f" {r['wall_ms_per_batch']:.2f} ms, busy {r['busy_ms_per_batch']:.2f} ms, kernels"
        f" {r['kernel_ms_per_batch']:.2f} ms; GEMMs at {r['gemm_tflops'] or 0:.0f} TFLOP/s"
        f" ({(r['gemm_tflops'] or 0) / peak:.2f} of the matmul)"
    )
    print("| family | ms/batch | share | launches/batch | us/launch |\n|---|---:|---:|---:|---:|")
    for f, v in r["families"].items():
        per = v["ms_per_batch"] * 1e3 / max(v["launches_per_batch"], 1e-9)
        print(
            f"| {f} | {v['ms_per_batch']:.2f} | {v['share']:.3f} | {v['launches_per_batch']:.0f}"
            f" | {per:.1f} |"
        )
    print("| kernel | ms/batch |\n|---|---:|")
    for k in r["top_kernels"][:12]:
        print(f"| `{k['name']}` | {k['ms_per_batch']:.2f} |")


if __name__ == "__main__":
    main()
