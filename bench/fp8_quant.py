"""FP8's activation-quantizing kernels (``scorer.models.fp8_kernels``) against the memory floor.

The four a layer runs, at the widths of Qwen3-0.6B and Qwen3-8B on 16,128 rows (a full batch's
CUDA-graph bucket): the input RMSNorm (``norm``), the residual add and post-attention RMSNorm
(``add_norm``), the attention output's plain quantization (``attn_out``, q heads x head_dim wide) and
the gate/up output's (``act``, the MLP's width). Each in its default program shape (``row_config``)
and a sweep of others (rows a program, warps). Device times are CUDA events
(``bench.timing.time_gpu``, median of 100); the floor is the bytes read and written once at the
device-to-device copy rate of the same run. Every variant's FP8 values are compared with
``quantize_rows``'s (the share of values that differ).

    python -m bench.fp8_quant --out out/
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch

from scorer.models import fp8_kernels as fk
from scorer.models.triton_ops import rms_norm_reference

from .qk_norm_rope import copy_bandwidth
from .timing import environment, time_gpu, write_json

ROWS = 16128
WIDTHS = {"0.6b": (1024, 2048, 3072), "8b": (4096, 4096, 12288)}  # hidden, q heads x head_dim, MLP
SWEEP = [(1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (4, 4), (4, 8), (8, 4), (8, 8), (16, 8), (1, 32)]
EPS = 1e-6


def cases(model: str, device: torch.device) -> dict:
    """name -> (mode, x, width, weight, residual, bytes read + written)."""
    h, q, inter = WIDTHS[model]
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return (3 * torch.randn(*shape, generator=g, device=device)).to(torch.bfloat16)

    w = (1 + 0.3 * torch.randn(h, generator=g, device=device)).to(torch.bfloat16)
    out = {
        "norm": (fk._NORM, rand(ROWS, h), h, w, None, ROWS * h * 3),
        "add_norm": (fk._ADD_NORM, rand(ROWS, h), h, w, rand(ROWS, h), ROWS * h * 7),
        "attn_out": (fk._PLAIN, rand(ROWS, q), q, None, None, ROWS * q * 3),
        "act": (fk._PLAIN, rand(ROWS, inter), inter, None, None, ROWS * inter * 3),
    }
    return out


def want(mode, x, w, residual) -> torch.Tensor:
    if mode == fk._PLAIN:
        return fk.quantize_rows(x)[0]
    src = x if residual is None else (residual.float() + x.float()).to(x.dtype)
    return fk.quantize_rows(rms_norm_reference(src, w, EPS))[0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--models", default="0.6b,8b")
    a = ap.parse_args(argv)
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    result = {**environment(device), "copy_bw": bw, "rows": ROWS, "records": []}
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (read + written)")
    print("| model | kernel | width | rows, warps | us | of floor | values off |")
    print("|---|---|---:|---|---:|---:|---:|")
    for model in a.models.split(","):
        for name, (mode, x, width, w, residual, nbytes) in cases(model, device).items():
            ref = want(mode, x, w, residual).view(torch.uint8)
            default = fk.row_config(width, mode)
            for config in [default] + [c for c in SWEEP if c != default]:
                res = None if residual is None else residual.clone()  # the first call's sum is checked
                run = partial(fk._launch, mode, x, width, w, EPS, res, config=config)
                got = run().q.view(torch.uint8)
                off = (got != ref).float().mean().item()
                us = time_gpu(run, device).median_ms * 1e3
                floor = nbytes / bw * 1e6
                rec = {"model": model, "kernel": name, "width": width, "config": list(config),
                       "default": config == default, "us": us, "floor_us": floor, "of_floor": floor / us,
                       "values_off": off}  # fmt: skip
                result["records"].append(rec)
                tag = " (default)" if config == default else ""
                cells = f"{us:.1f} | {floor / us:.0%} | {off:.2e}"
                print(f"| {model} | {name} | {width} | {config}{tag} | {cells} |", flush=True)
            write_json(a.out / "fp8_quant.json", result)


if __name__ == "__main__":
    main()
