"""The MLP's first half on Triton (``triton_ops.gate_up_silu``) against cuBLAS, as the model runs it.

For each model and row count, ``silu(x @ gate.T) * (x @ up.T)``: cuBLAS's GEMM into [T, 2I] alone
(``cublas gemm``), the same and FlashInfer's SiLU-and-mul (``cublas+silu``, the path without
``DecoderLM.swiglu_gemm``), and Triton's ``gate_up_silu`` in each program shape of
``SWIGLU_CONFIGS`` (``--configs default``: the model's own, ``gate_up_config``). Each is timed
inside a CUDA graph of ``--reps`` calls (as the model's graphs run them: no host time), median of
``--iters`` replays, in microseconds and as a fraction of the same run's 8192^3 bf16 matmul
(useful FLOPs 4 T H I); each output's largest error against the fp32 product
(``gate_up_silu_reference``) beside it. GPU only.

``--fp8``: the same on FP8 operands (``--quantization fp8``: x per row, the weight per output
channel, ``fp8_kernels.quantize_rows``), each as the serving path runs it, up to the down GEMM's
FP8 input: cuBLAS's rowwise-scaled GEMM (``torch._scaled_mm``) alone and with the quantizing
SiLU-and-mul (``fp8_kernels.silu_mul_quant``), and Triton's ``gate_up_silu`` in each shape of
``FP8_CONFIGS`` followed by its quantization (``fp8_kernels.quantize``); errors against the fp32
product of the dequantized operands.

    python -m bench.triton_gemm --out DIR [--models 0.6b,8b] [--rows 800,4100,16128] [--configs default]
        [--fp8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from scorer.models import fp8_kernels, fused, triton_ops
from scorer.models.quant import dequantize

from .timing import capture_graph, environment, time_ms

MODELS = {"0.6b": (1024, 2048, 1024, 3072), "8b": (4096, 4096, 1024, 12288)}  # h, q, kv, mlp width


def matmul_tflops(n: int) -> float:
    x, y, z = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return 2 * n**3 / time_ms(lambda: torch.mm(x, y, out=z), 20) / 1e9


SWIGLU_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, GROUP_M, persistent, loop)
    (128, 128, 64, 3, 8, 4, True, ""),
    (128, 128, 64, 3, 8, 16, True, ""),
    (128, 128, 64, 3, 8, 8, True, ""),
    (128, 128, 64, 3, 8, 8, False, ""),
    (128, 128, 64, 3, 8, 8, True, "ws"),
    (128, 128, 64, 2, 8, 8, True, "ws"),
    (64, 128, 64, 2, 4, 8, False, ""),
    (64, 128, 64, 3, 4, 8, False, ""),
]
"""Sweeps of ten shapes on an H200 (the plain Triton GEMM for q/k/v, o+res and down+res too: slower
than cuBLAS everywhere; bench/data/kernels/triton_gemm.*) put the persistent 128 x 128 x 64 shape
first; these are it, its GROUP_M neighbours, warp specialisation, and 64-row tiles in two stages
(two programs an SM, one's epilogue under the other's loads)."""

FP8_CONFIGS = [
    (128, 128, 128, 3, 8, 4, True, ""),  # the default (``gate_up_config(fp8=True)``)
    (128, 128, 128, 4, 8, 4, True, ""),
    (128, 128, 128, 3, 8, 16, True, ""),
    (128, 128, 64, 4, 8, 4, True, ""),
    (128, 128, 256, 2, 8, 4, True, ""),
    (128, 128, 128, 3, 8, 4, True, "ws"),
    (64, 128, 128, 3, 4, 8, False, ""),
]
"""FP8's program shapes: the bf16 default with K in steps of 128 (the same bytes a stage), its
neighbours in stages, K step and grouping, warp specialisation, 64-row tiles."""


def graph_us(fn, reps: int, iters: int) -> float:
    """Median microseconds of one ``fn()`` over ``iters`` replays of a graph of ``reps`` calls."""
    graph = capture_graph(fn, torch.device("cuda"), warmup=3, reps=reps)
    return time_ms(graph.replay, iters) * 1e3 / reps


def timed(model: str, rows: int, runs: dict, check, flops: int, reps: int, iters: int, peak: float) -> list:
    """Each of ``runs`` (name -> function) checked (``check(name)``: its error, or None) and timed."""
    out = []
    for name, fn in runs.items():
        rec = {"model": model, "rows": rows, "variant": name}
        try:
            fn()
            torch.cuda.synchronize()
            err = check(name)
            if err is not None:
                rec["max_err"] = err
            rec["us"] = graph_us(fn, reps, iters)
            rec["of_matmul"] = flops / (rec["us"] * 1e-6) / 1e12 / peak
        except Exception as e:  # noqa: BLE001  (a shape that does not compile is recorded)
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
        print(
            f"| {model} | {rows} | {name} | {rec.get('us', float('nan')):.1f} | "
            f"{rec.get('of_matmul', float('nan')):.3f} | {rec.get('max_err', float('nan')):.4f} |"
            + (f" {rec['error']}" if "error" in rec else ""),
            flush=True,
        )
        out.append(rec)
    return out


def measure(model: str, rows: int, configs: list, reps: int, iters: int, peak: float) -> list[dict]:
    h, _, _, i = MODELS[model]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g) / h**0.5
    gu = torch.empty(rows, 2 * i, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(rows, i, device="cuda", dtype=torch.bfloat16)
    ref = triton_ops.gate_up_silu_reference(x, w, torch.empty(rows, i, device="cuda", dtype=torch.float32))
    runs = {
        "mlp cublas gemm": lambda: torch.mm(x, w.t(), out=gu),
        "mlp cublas+silu": lambda: act.copy_(fused.silu_and_mul(torch.mm(x, w.t(), out=gu))),
    }
    for c in configs or [triton_ops.gate_up_config(rows, h, i)]:
        label = "mlp triton " + ",".join(map(str, c)).rstrip(",")
        runs[label] = lambda c=c: triton_ops.gate_up_silu(x, w, act, config=c)

    def mlp_err(name):
        return None if name == "mlp cublas gemm" else (act.float() - ref).abs().max().item()

    return timed(model, rows, runs, mlp_err, 4 * rows * h * i, reps, iters, peak)


def measure_fp8(model: str, rows: int, configs: list, reps: int, iters: int, peak: float) -> list[dict]:
    h, _, _, i = MODELS[model]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g) / h**0.5
    (xq, sx), (wq, sw) = fp8_kernels.quantize_rows(x), fp8_kernels.quantize_rows(w)
    sw = sw.reshape(1, -1).contiguous()
    gu = torch.empty(rows, 2 * i, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(rows, i, device="cuda", dtype=torch.bfloat16)
    ref = triton_ops.gate_up_silu_reference(xq.float() * sx, wq.float() * sw.reshape(-1, 1))
    last: dict = {}

    def gemm():
        return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, out=gu)

    def cublas_silu():
        last["q"] = fp8_kernels.silu_mul_quant(gemm())

    runs = {"fp8 cublas gemm": gemm, "fp8 cublas+silu_quant": cublas_silu}
    for c in configs:

        def triton_quant(c=c):
            last["q"] = fp8_kernels.quantize(
                triton_ops.gate_up_silu(xq, wq, act, config=c, x_scale=sx, w_scale=sw)
            )

        runs["fp8 triton+quant " + ",".join(map(str, c)).rstrip(",")] = triton_quant

    def err(name):  # the FP8 output dequantized, against the fp32 product (half an FP8 step is ~3%)
        return None if name == "fp8 cublas gemm" else (dequantize(*last["q"]) - ref).abs().max().item()

    return timed(model, rows, runs, err, 4 * rows * h * i, reps, iters, peak)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--models", default="0.6b,8b")
    ap.add_argument("--rows", default="800,4100,16128")
    ap.add_argument("--configs", default="all", help="'all' (SWIGLU_CONFIGS) or 'default'")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--fp8", action="store_true", help="FP8 operands (FP8_CONFIGS), up to the down GEMM's input"
    )
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    configs = (FP8_CONFIGS if a.fp8 else SWIGLU_CONFIGS) if a.configs == "all" else None
    peak = matmul_tflops(8192)
    result = {**environment(torch.device("cuda")), "matmul_tflops": peak, "records": []}
    print(f"matmul {peak:.0f} TFLOP/s\n| model | rows | variant | us | of matmul | max err |")
    print("|---|---:|---|---:|---:|---:|")
    for model in a.models.split(","):
        for rows in (int(r) for r in a.rows.split(",") if r):
            if a.fp8:
                fp8_configs = configs or [
                    triton_ops.gate_up_config(rows, MODELS[model][0], MODELS[model][3], fp8=True)
                ]
                result["records"] += measure_fp8(model, rows, fp8_configs, a.reps, a.iters, peak)
            else:
                result["records"] += measure(model, rows, configs, a.reps, a.iters, peak)
            (a.out / "triton_gemm.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
