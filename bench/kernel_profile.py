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
import itertools
import json
import re
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from .throughput import FP8_SYSTEMS, MODELS, calls, engine_for, full_batches, matmul_tflops
from .timing import environment, sync, write_json

FAMILIES = (  # the first pattern a kernel's name matches names its family (FA3's names hold "cutlass")
    ("attention", r"PrefillWithKVCache|BatchPrefill|MergeState|Attention"),
    ("gate_up_silu", r"gate_up_silu"),  # Triton's gate/up GEMM writing silu(g) * u
    ("fp8_quant", r"_quant_kernel"),  # FP8's norms, SiLU-and-mul and plain quantization (fp8_kernels)
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|splitKreduce"),
    ("qk_norm_rope", r"qk_norm_rope"),
    ("add_rmsnorm", r"FusedAddRMSNorm"),
    ("rmsnorm", r"RMSNorm|rms_norm"),
    ("silu_and_mul", r"act_and_mul|silu"),
    ("copy_index", r"index|copy|gather|scatter|Memcpy|Memset|embedding|indexSelect"),
    ("residual_add", r"elementwise|CUDAFunctor_add|AddFunctor"),
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


def span_us(kernels: list[dict]) -> float:
    """The first kernel's start to the last one's end."""
    return max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels) if kernels else 0.0


def busy_us(kernels: list[dict]) -> float:
    """Time at least one kernel ran (the union of their intervals)."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k["ts"]):
        s, e = k["ts"], k["ts"] + k["dur"]
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def short_name(name: str) -> str:
    """A kernel's name without its template arguments (``void ns::Kernel<...>(...)`` -> ``ns::Kernel``)."""
    return re.sub(r"^void ", "", name).split("<")[0].split("(")[0][:60]


def idle_by_neighbours(kernels: list[dict], key: Callable[[str], str] = family) -> dict[str, float]:
    """Device idle between consecutive kernels (us), by the families (or ``key``) on either side:
    where a forward's gaps sit (a graph replay's start, an eager attention launch, a batch's end)."""
    out: dict[str, float] = defaultdict(float)
    ks = sorted(kernels, key=lambda k: k["ts"])
    end, last = float("-inf"), None
    for k in ks:
        if last is not None and k["ts"] > end:
            out[f"{key(last['name'])} -> {key(k['name'])}"] += k["ts"] - end
        if k["ts"] + k["dur"] >= end:
            end, last = k["ts"] + k["dur"], k
    return dict(sorted(out.items(), key=lambda x: -x[1]))


def profile(engine, reqs, scheme: str, budget: int, n_batches: int, tmp: Path) -> dict:
    jobs = [engine.tokenize(replace(r, options=replace(r.options, scheme=scheme))) for r in reqs]
    todo = full_batches(jobs, budget)
    for b in todo[:3]:
        engine.score_batch(b)
    sync(engine.device)
    # the device's activity only: tracing every host op would slow the launches being measured
    cuda = engine.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    ran = [todo[k % len(todo)] for k in range(n_batches)]
    with torch.profiler.profile(activities=acts) as prof:
        t0, waiting = time.perf_counter(), None
        for b in ran:
            launched = engine.launch(b)
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
    tokens = [sum(j.tokens for j in b) for b in ran]
    graph = engine.runner.graphs
    rows = sum((graph.bucket(n) if graph else None) or n for n in tokens)
    kernel_us = sum(fam_us.values())
    return {
        "scheme_used": sorted({j.scheme.name for j in jobs}),
        "batches": n_batches,
        "tokens_per_batch": sum(tokens) / n_batches,
        "rows_per_batch": rows / n_batches,
        "docs_per_batch": sum(len(j.items) for b in ran for j in b) / n_batches,
        "wall_ms_per_batch": wall * 1e3 / n_batches,
        "busy_ms_per_batch": busy_us(ks) / 1e3 / n_batches,
        # first kernel's start to the last one's end: without the first launch and the last wait
        "span_ms_per_batch": span_us(ks) / 1e3 / n_batches,
        "kernel_ms_per_batch": kernel_us / 1e3 / n_batches,
        "families": {
            f: {
                "ms_per_batch": us / 1e3 / n_batches,
                "launches_per_batch": fam_n[f] / n_batches,
                "share": us / kernel_us,
            }  # fmt: skip
            for f, us in sorted(fam_us.items(), key=lambda x: -x[1])
        },
        "idle_ms_per_batch_by_neighbours": {
            pair: us / 1e3 / n_batches for pair, us in list(idle_by_neighbours(ks).items())[:12]
        },
        "idle_ms_per_batch_by_kernels": {
            pair: us / 1e3 / n_batches for pair, us in list(idle_by_neighbours(ks, short_name).items())[:12]
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
        help="comma-separated model kernels, each profiled (KERNELS/noaddmm: the residual adds"
        " outside the GEMMs; KERNELS/finorm: FlashInfer's hidden-state norms, not Triton's;"
        " KERNELS/noswiglu: gate/up on cuBLAS and FlashInfer's SiLU-and-mul, not Triton's one GEMM;"
        " KERNELS/fp8 and the other bench.throughput FP8 variants: the linears in FP8)",
    )
    ap.add_argument("--schemes", default="auto", help="comma-separated: auto or a scheme, each profiled")
    ap.add_argument(
        "--attention",
        default="auto",
        help="comma-separated FlashInfer kernels (auto, fa2, fa3), each profiled (auto/nomat: long docs'"
        " calls paged, not FA3 over a gathered copy of their keys)",
    )
    ap.add_argument("--blas", default="default", help="comma-separated bench.throughput.BLAS, each profiled")
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    cfg = MODELS[a.model]
    a.out.mkdir(parents=True, exist_ok=True)
    result = {**environment(device), "matmul_tflops": matmul_tflops(device), "records": []}
    for kernels, attention, blas in itertools.product(
        *(x.split(",") for x in (a.kernels, a.attention, a.blas))
    ):
        base, *opts = kernels.split("/")
        engine = engine_for(
            cfg,
            device,
            base,
            a.budget,
            attention=attention.split("/")[0],
            blas=blas,
            materialize=not attention.endswith("/nomat"),
            residual_in_gemm="noaddmm" not in opts,
            triton_norm="finorm" not in opts,
            swiglu_gemm="noswiglu" not in opts,
            fp8=next((FP8_SYSTEMS[o] for o in opts if o in FP8_SYSTEMS), ""),
        )
        for w, scheme in itertools.product(a.workloads.split(","), a.schemes.split(",")):
            rec = {
                "model": a.model,
                "kernels": kernels,
                "attention": attention,
                "blas": blas,
                "workload": w,
                "scheme": scheme,
            }
            rec |= profile(engine, calls(w, 64, cfg["vocab_size"]), scheme, a.budget, a.batches, a.out)
            rows, gemm_us = rec.pop("_rows_total"), rec.pop("_gemm_us")
            rec["gemm_tflops"] = gemm_flops(cfg, rows) / (gemm_us * 1e-6) / 1e12 if gemm_us else None
            rec["docs_s"] = rec["docs_per_batch"] / rec["wall_ms_per_batch"] * 1e3
            result["records"].append(rec)
            write_json(a.out / "kernel_profile.json", result)
            _print(rec, result["matmul_tflops"])
        del engine
        torch.cuda.empty_cache()
    (a.out / "trace.json").unlink(missing_ok=True)
    print(
        "\n| workload | kernels | attention | blas | scheme | docs/s | wall ms | span ms | busy ms"
        " | attention ms | GEMM ms | copies+memsets |\n"
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for r in result["records"]:
        fam = {f: v["ms_per_batch"] for f, v in r["families"].items()}
        copies = r["families"].get("copy_index", {}).get("launches_per_batch", 0)
        print(
            f"| {r['workload']} | {r['kernels']} | {r['attention']} | {r['blas']} | {r['scheme']}"
            f" ({','.join(r['scheme_used'])}) | {r['docs_s']:,.0f} | {r['wall_ms_per_batch']:.2f}"
            f" | {r['span_ms_per_batch']:.2f} | {r['busy_ms_per_batch']:.2f} | {fam.get('attention', 0):.2f}"
            f" | {fam.get('gemm', 0):.2f} | {copies:.0f} |"
        )


def _print(r: dict, peak: float) -> None:
    print(
        f"\n{r['model']} {r['workload']} kernels={r['kernels']} attention={r['attention']} blas={r['blas']}"
        f" scheme={r['scheme']}: {r['tokens_per_batch']:.0f} tokens"
        f" ({r['rows_per_batch']:.0f} rows), {r['docs_per_batch']:.0f} docs a batch; wall"
        f" {r['wall_ms_per_batch']:.2f} ms, kernels' span {r['span_ms_per_batch']:.2f} ms, busy"
        f" {r['busy_ms_per_batch']:.2f} ms, kernels"
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
    print("| idle between (kernel before -> after) | ms/batch |\n|---|---:|")
    for pair, ms in list(r["idle_ms_per_batch_by_neighbours"].items())[:8]:
        print(f"| {pair} | {ms:.3f} |")
    print("| idle between (kernels) | ms/batch |\n|---|---:|")
    for pair, ms in list(r["idle_ms_per_batch_by_kernels"].items())[:8]:
        print(f"| `{pair}` | {ms:.3f} |")
    print("| kernel | ms/batch |\n|---|---:|")
    for k in r["top_kernels"][:12]:
        print(f"| `{k['name']}` | {k['ms_per_batch']:.2f} |")


if __name__ == "__main__":
    main()
