"""The layers' RMSNorm over hidden rows on the GPU: FlashInfer's ``rmsnorm`` (the fused path's
before this kernel), torch's ``F.rms_norm`` and ``scorer.models.triton_ops.rms_norm`` with its default
program shape and a sweep of others, against the memory-bandwidth floor.

Shapes: the hidden rows of serving passes (Qwen3-0.6B's 1,024 and Qwen3-8B's 4,096 wide; 16,128
and 4,224 rows are workload C's two CUDA-graph buckets). Device times are CUDA events
(``bench.timing.time_gpu``, median of 100); the floor is the rows read and written once at the
device-to-device copy rate measured in the same run; ``of floor`` = floor / time. Every Triton
shape is checked against FlashInfer's output first (at most 1% of the elements one rounding apart).

    python -m bench.rms_norm --out out/
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from scorer.models.triton_ops import rms_norm, rms_norm_config

from .qk_norm_rope import copy_bandwidth
from .timing import environment, time_gpu, write_json

SHAPES = [(16128, 1024), (4224, 1024), (16128, 4096)]
SWEEP = [(1, 1), (1, 4), (2, 4), (4, 4), (8, 4), (2, 8), (4, 8), (8, 8), (16, 8), (4, 2), (8, 2)]
EPS = 1e-6


def bench_shape(rows: int, width: int, device: torch.device, bw: float) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    x = (3 * torch.randn(rows, width, generator=g, device=device)).to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(width, generator=g, device=device)).to(torch.bfloat16)
    out = torch.empty_like(x)
    floor_us = 2 * x.numel() * x.element_size() / bw * 1e6
    paths = {"torch F.rms_norm": lambda: F.rms_norm(x, (width,), w, EPS)}
    try:
        from flashinfer.norm import rmsnorm

        paths["flashinfer rmsnorm"] = lambda: rmsnorm(x, w, EPS, out=out)
        want = rmsnorm(x, w, EPS)
    except ImportError:
        want = None
    default = rms_norm_config(width)
    configs = [default] + [c for c in SWEEP if c != default]
    for c in configs:
        got = rms_norm(x, w, EPS, config=c)
        if want is not None:
            flipped = (got != want).float().mean().item()
            assert flipped < 0.01, f"triton {c} differs from FlashInfer on {flipped:.2%} of the elements"
        label = f"triton {c[0]} rows, {c[1]} warps" + (" (default)" if c == default else "")
        paths[label] = lambda c=c: rms_norm(x, w, EPS, out, config=c)
    res = []
    for label, fn in paths.items():
        us = time_gpu(fn, device).median_ms * 1e3
        res.append({"path": label, "us": us, "floor_us": floor_us, "of_floor": floor_us / us})
    return {"rows": rows, "width": width, "results": res}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    a = ap.parse_args(argv)
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    result = {**environment(device), "copy_bw": bw, "shapes": []}
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (read + written)")
    print("| rows x width | path | us | floor us | of floor |\n|---|---|---:|---:|---:|")
    for rows, width in SHAPES:
        s = bench_shape(rows, width, device, bw)
        result["shapes"].append(s)
        write_json(a.out / "rms_norm.json", result)
        for r in s["results"]:
            cells = f"{r['us']:.1f} | {r['floor_us']:.1f} | {r['of_floor']:.0%}"
            print(f"| {rows} x {width} | {r['path']} | {cells} |")


if __name__ == "__main__":
    main()
