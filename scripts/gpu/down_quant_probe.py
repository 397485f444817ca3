"""The FP8 down projection quantizing its own input (``fp8_kernels.rowmax_mm``, the gate/up GEMM
writing each row's absmax by 128 columns) against a quantizing pass over the gate/up output and
cuBLAS's rowwise GEMM, on Qwen3-0.6B's and 8B's MLP shapes: each kernel's device time, what the
MLP saves, and the two outputs' difference (the same FP8 values, summed in another order).
``rowmax_mm``'s program shapes are swept (the first is ``ROWMAX_MM_CONFIG``).
    python scripts/gpu/down_quant_probe.py OUT.json"""

import json
import sys
from functools import partial
from pathlib import Path

import torch

from bench.timing import environment, time_gpu
from scorer.models.fp8_kernels import ROWMAX_MM_CONFIG, RowMax, quantize, quantize_rows, rowmax_mm
from scorer.models.triton_ops import AMAX_BLOCK, gate_up_silu

dev = torch.device("cuda")
out = {**environment(dev), "records": []}
CONFIGS = [
    ROWMAX_MM_CONFIG,
    (128, 128, 128, 3, 8, 8),
    (128, 128, 64, 3, 8, 8),
    (64, 128, 128, 4, 4, 8),
    (128, 256, 64, 3, 8, 8),
]


def weights(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_rows((torch.randn(n, k, device=dev, generator=g) / k**0.5).bfloat16())
    return q, s.reshape(1, n).contiguous()


def us(fn) -> float:
    return round(time_gpu(fn, dev).median_ms * 1e3, 2)


def probe(m: int, hidden: int, inter: int) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    xq, xs = quantize_rows(torch.randn(m, hidden, device=dev, generator=g).bfloat16())
    wgu, sgu = weights(2 * inter, hidden, g)
    wd, sd = weights(hidden, inter, g)
    h = torch.empty(m, inter, dtype=torch.bfloat16, device=dev)
    amax = torch.empty(m, inter // AMAX_BLOCK, dtype=torch.float32, device=dev)
    y = torch.empty(m, hidden, dtype=torch.bfloat16, device=dev)
    gate_up = lambda: gate_up_silu(xq, wgu, h, x_scale=xs, w_scale=sgu)  # noqa: E731
    gate_up_amax = lambda: gate_up_silu(xq, wgu, h, x_scale=xs, w_scale=sgu, row_amax=amax)  # noqa: E731
    gate_up_amax()
    hq = quantize(h)

    def cublas():
        return torch._scaled_mm(hq.q, wd.t(), scale_a=hq.scale, scale_b=sd, out_dtype=torch.bfloat16, out=y)

    cublas()
    torch.cuda.synchronize()
    rec = {"m": m, "hidden": hidden, "inter": inter}
    rec["amax_exact"] = bool(
        torch.equal(amax.amax(dim=1, keepdim=True), h.float().abs().amax(dim=1, keepdim=True))
    )
    rec |= {
        "gate_up_us": us(gate_up),
        "gate_up_amax_us": us(gate_up_amax),
        "quantize_us": us(lambda: quantize(h)),
        "cublas_down_us": us(cublas),
    }
    print(rec, flush=True)
    out["records"].append(rec)
    before = rec["gate_up_us"] + rec["quantize_us"] + rec["cublas_down_us"]
    for cfg in CONFIGS:
        r = {"m": m, "hidden": hidden, "inter": inter, "config": cfg}
        try:
            run = partial(rowmax_mm, RowMax(h, amax), wd, sd, torch.bfloat16, config=cfg)
            y2 = run()
            torch.cuda.synchronize()
            r["max_diff_of_max"] = ((y2.float() - y.float()).abs().max() / y.float().abs().max()).item()
            r["rowmax_mm_us"] = us(run)
            r["saved_us"] = round(before - rec["gate_up_amax_us"] - r["rowmax_mm_us"], 2)
        except Exception as e:  # noqa: BLE001
            r["error"] = f"{type(e).__name__}: {e}"[:400]
        print(r, flush=True)
        out["records"].append(r)


for shape in [(16128, 1024, 3072), (4100, 1024, 3072), (16128, 4096, 12288)]:
    probe(*shape)
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
