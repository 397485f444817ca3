"""Which FP8 scalings cuBLAS runs for the down GEMM, how fast, how exact: the rowwise GEMM the
FP8 linears use (x per token, W per output channel) against x per token and 128-wide group
(BlockWise1x128) with W per channel written as 1x128 groups, or W in 128 x 128 blocks. Errors
against the fp32 product of the dequantized operands, as a share of the largest output.
    python scripts/gpu/scaled_mm_probe.py OUT.json"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.timing import environment, time_gpu
from scorer.models.fp8_kernels import quantize_rows

FP8, G = torch.float8_e4m3fn, 128
dev = torch.device("cuda")
out = {**environment(dev), "records": []}


def q_groups(x):  # per row and 128 columns -> q, scale [M, K/128] (fp32, contiguous)
    m, k = x.shape
    q, s = quantize_rows(x.reshape(m * k // G, G))
    return q.view(m, k), s.view(m, k // G)


def probe(m: int, k: int, n: int) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16) * torch.rand(
        m, 1, device=dev, generator=g
    )
    w = (torch.randn(n, k, device=dev, generator=g) / k**0.5).to(torch.bfloat16)
    xq, xs = quantize_rows(x)
    wq, ws = quantize_rows(w)
    xgq, xgs = q_groups(x)
    sa = xgs.t().contiguous().t()  # [M, K/128], stride [1, M]
    sb_groups = ws.reshape(1, n).expand(k // G, n).contiguous().t()  # W per channel as 1x128: [N, K/128]
    wb = w.float().view(n // G, G, k // G, G)
    wbs = wb.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12) / 448
    wbq = (wb / wbs).to(FP8).view(n, k)
    wbs2 = wbs.view(n // G, k // G)  # [N/128, K/128]
    ref_row = (xq.float() * xs) @ (wq.float() * ws).t()
    # x dequantized per row and 128 columns, as both grouped variants read it
    xg = (xgq.float().view(m, k // G, G) * xgs.view(m, k // G, 1)).view(m, k)
    ref_grp = xg @ (wq.float() * ws).t()
    ref_blk = xg @ (wbq.float().view(n // G, G, k // G, G) * wbs).view(n, k).t()
    L4 = -(-(k // G) // 4) * 4
    sb_store = torch.zeros(n // G, L4, device=dev)  # Bs [L4, N/128] with stride [1, L4]
    sb_store[:, : k // G] = wbs2
    sb_blk = sb_store.t()
    variants = {
        "rowwise": (
            lambda: torch._scaled_mm(
                xq, wq.t(), scale_a=xs, scale_b=ws.reshape(1, n), out_dtype=torch.bfloat16
            ),
            ref_row,
        ),
        "1x128 x 1x128 (W per channel)": (
            lambda: F.scaled_mm(
                xgq,
                wq.t(),
                sa,
                F.ScalingType.BlockWise1x128,
                sb_groups,
                F.ScalingType.BlockWise1x128,
                output_dtype=torch.bfloat16,
            ),
            ref_grp,
        ),
        "1x128 x 128x128 (W per block)": (
            lambda: F.scaled_mm(
                xgq,
                wbq.t(),
                sa,
                F.ScalingType.BlockWise1x128,
                sb_blk,
                F.ScalingType.BlockWise128x128,
                output_dtype=torch.bfloat16,
            ),
            ref_blk,
        ),
    }
    for name, (fn, ref) in variants.items():
        rec = {"m": m, "k": k, "n": n, "variant": name}
        try:
            y = fn()
            torch.cuda.synchronize()
            rec["max_err_of_max"] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            rec["us"] = time_gpu(fn, dev).median_ms * 1e3
            rec["tflops"] = 2 * m * k * n / rec["us"] / 1e6
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"[:400]
        print(rec, flush=True)
        out["records"].append(rec)


for shape in [(16128, 3072, 1024), (4096, 3072, 1024), (16128, 12288, 4096), (4096, 12288, 4096)]:
    probe(*shape)
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
