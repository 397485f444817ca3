"""Per-head q/k RMSNorm + RoPE on an H200, three ways, against the memory-bandwidth floor.

(a) ``flashinfer``: the current fused path (``scorer.models.fused``): FlashInfer's ``rmsnorm`` on
    the q rows and on the k rows (contiguous q and k, as separate q_proj/k_proj GEMMs give them),
    each into an out buffer, then ``apply_rope_with_cos_sin_cache_inplace`` on those buffers;
    ``+v`` adds the v copy into its buffer (what the CUDA-graph runner does).
(b) ``torch``: ``F.rms_norm`` on q and k, then the same FlashInfer RoPE.
(c) ``triton``: ``scorer.models.triton_ops.qk_norm_rope`` from the fused QKV GEMM output
    [T, (Hq + 2 Hkv) D] into out buffers in one pass; ``qk`` returns v as a view of the GEMM
    output, ``+v`` also copies v into ``v_out``. Program shapes (BLOCK_T, BLOCK_H, num_warps,
    grid order) are swept on the ``+v`` variant and on the serving layout (q and
    k rewritten in place in the GEMM's output, v left there: ``qk in place``), each checked
    against the fp32 reference to within one bf16 ulp.

The contiguous q and k copies of (a) and (b) are made before timing. Times are device times
(CUDA events, ``bench.timing.time_gpu``: median of 50 after warm-up). The floor is the bytes that
must move once (q and k read and written, positions, the cos|sin rows of the distinct positions;
``+v``: v read and written) at 4.3 TB/s, the device-to-device copy rate measured on an H200;
``of floor`` = floor / time. The Triton JIT compile of a first call is timed in fresh processes:
with an empty Triton cache (cold) and again with the cache that run left (a restart).

    python -m bench.qk_norm_rope --out out/
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from scorer.models.triton_ops import default_config, qk_norm_rope, qk_norm_rope_reference, qkv_views

from .timing import environment, time_gpu, write_json

MODELS = {"qwen3-0.6b": (16, 8, 128), "qwen3-8b": (32, 8, 128)}  # (Hq, Hkv, head_dim)
TOKENS = (16384, 4096)
DTYPE = torch.bfloat16
EPS = 1e-6
MAX_POS = 40960  # Qwen3's max_position_embeddings; positions drawn below 8192
PEAK_BW = 4.3e12
CONFIGS = [  # (BLOCK_T, BLOCK_H, num_warps, heads_fastest): program tiles of 1k-8k elements
    (bt, bh, w, order)
    for order in (False, True)
    for bt, bh, w in [
        (4, 4, 4),
        (8, 4, 4),
        (4, 4, 2),
        (8, 2, 4),
        (16, 2, 4),
        (32, 2, 4),
        (16, 2, 2),
        (2, 8, 4),
        (8, 8, 8),
        (16, 1, 4),
        (32, 1, 4),
    ]
]
ROOT = Path(__file__).resolve().parents[1]

COLD_SCRIPT = """
import json, time
t0 = time.perf_counter()
import torch
from scorer.models.triton_ops import qk_norm_rope
t_import = time.perf_counter() - t0
T, hq, hkv, d = 4096, 16, 8, 128
qkv = torch.randn(T, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
w = torch.ones(d, device="cuda", dtype=torch.bfloat16)
pos = torch.randint(0, 8192, (T,), device="cuda")
cache = torch.randn(8192, d, device="cuda")
outs = [torch.empty(T, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv)]
torch.cuda.synchronize()
times = []
for _ in range(2):
    t0 = time.perf_counter()
    qk_norm_rope(qkv, w, w, 1e-6, pos, cache, hq, hkv, d, *outs)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
print(json.dumps({"import_s": t_import, "first_call_s": times[0], "second_call_s": times[1]}))
"""


def first_call_times() -> dict:
    """Wall time of the first kernel call in a fresh process: empty Triton cache, then the cache
    that process left behind."""
    out = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        env = {**os.environ, "TRITON_CACHE_DIR": cache_dir}
        for label in ("cold", "disk_cached"):
            p = subprocess.run(
                [sys.executable, "-c", COLD_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True
            )
            if p.returncode:
                out[label] = {"error": p.stderr[-2000:]}
            else:
                out[label] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = time_gpu(lambda: dst.copy_(src), device, warmup=3, iters=10)
    return 2 * src.numel() / (t.median_ms * 1e-3)


def floor_bytes(T: int, hq: int, hkv: int, d: int, n_pos: int, with_v: bool | None) -> int:
    """Bytes read + written once; ``with_v`` None: the q/k rows alone (a norm without RoPE)."""
    e = torch.finfo(DTYPE).bits // 8
    if with_v is None:
        return 2 * T * (hq + hkv) * d * e
    qk = 2 * T * (hq + hkv) * d * e + T * 8 + n_pos * d * 4
    return qk + (2 * T * hkv * d * e if with_v else 0)


def max_err(got: torch.Tensor, ref32: torch.Tensor) -> float:
    return (got.float() - ref32).abs().max().item()


def within_one_ulp(outs, ref) -> bool:
    """q and k within one bf16 ulp of the fp32 reference, v equal (the test's criterion)."""
    q_ok, k_ok = (
        ((o.float() - r).abs() <= 2.0**-7 * r.abs() + 1e-5).all().item()
        for o, r in zip(outs[:2], ref[:2], strict=True)
    )
    return q_ok and k_ok and torch.equal(outs[2], ref[2])


def bench_shape(model: str, T: int, device: torch.device) -> dict:
    from flashinfer.norm import rmsnorm
    from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace

    hq, hkv, d = MODELS[model]
    g = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g, device=device).mul_(3).to(DTYPE)
    qw = (1 + 0.3 * torch.randn(d, generator=g, device=device)).to(DTYPE)
    kw = (1 + 0.3 * torch.randn(d, generator=g, device=device)).to(DTYPE)
    pos = torch.randint(0, 8192, (T,), generator=g, device=device)
    n_pos = torch.unique(pos).numel()
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    freqs = torch.arange(MAX_POS, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    # (a), (b): contiguous q, k, v as separate projections give them (copied before timing)
    q_c, k_c, v_c = (t.contiguous() for t in qkv.split((hq * d, hkv * d, hkv * d), dim=-1))
    qo, ko, vo = (torch.empty(T, h, d, dtype=DTYPE, device=device) for h in (hq, hkv, hkv))

    def flashinfer_qk():
        rmsnorm(q_c.view(-1, d), qw, EPS, out=qo.view(-1, d))
        rmsnorm(k_c.view(-1, d), kw, EPS, out=ko.view(-1, d))
        apply_rope_with_cos_sin_cache_inplace(pos, qo.view(T, -1), ko.view(T, -1), d, cache, True)

    def flashinfer_norms():
        rmsnorm(q_c.view(-1, d), qw, EPS, out=qo.view(-1, d))
        rmsnorm(k_c.view(-1, d), kw, EPS, out=ko.view(-1, d))

    def flashinfer_qkv():
        flashinfer_qk()
        vo.copy_(v_c.view(T, hkv, d))

    def torch_qk():
        q = F.rms_norm(q_c.view(T, hq, d), (d,), qw, EPS)
        k = F.rms_norm(k_c.view(T, hkv, d), (d,), kw, EPS)
        apply_rope_with_cos_sin_cache_inplace(pos, q.view(T, -1), k.view(T, -1), d, cache, True)
        return q, k

    def triton(config=None, with_v=True):
        return lambda: qk_norm_rope(
            qkv, qw, kw, EPS, pos, cache, hq, hkv, d, qo, ko, vo if with_v else None, config=config
        )

    ref = qk_norm_rope_reference(qkv, qw, kw, EPS, pos, cache, hq, hkv, d, out_dtype=torch.float32)
    errors = {}
    flashinfer_qkv()
    errors["flashinfer"] = max(max_err(qo, ref[0]), max_err(ko, ref[1]))
    q, k = torch_qk()
    errors["torch"] = max(max_err(q, ref[0]), max_err(k, ref[1]))
    default = default_config(T, hq, hkv, d)
    triton(default)()
    errors["triton"] = max(max_err(qo, ref[0]), max_err(ko, ref[1]), max_err(vo, ref[2]))

    def ms(fn) -> float:
        return time_gpu(fn, device, warmup=10, iters=50).median_ms

    sweep = {}
    for cfg in CONFIGS:
        for t in (qo, ko, vo):
            t.zero_()
        triton(cfg)()
        sweep[str(cfg)] = {"us": 1e3 * ms(triton(cfg)), "correct": within_one_ulp((qo, ko, vo), ref)}
    best = min((c for c in CONFIGS if sweep[str(c)]["correct"]), key=lambda c: sweep[str(c)]["us"])
    # the serving layout: q and k normed and rotated in place in the GEMM's
    # output, v left there (each timed run rewrites the same buffer; checked on a fresh copy first)
    buf = qkv.clone()

    def in_place(config=None):
        return lambda: qk_norm_rope(
            buf, qw, kw, EPS, pos, cache, hq, hkv, d, *qkv_views(buf, hq, hkv, d)[:2], config=config
        )

    sweep_in_place = {}
    for cfg in CONFIGS:
        buf.copy_(qkv)
        in_place(cfg)()
        correct = within_one_ulp(qkv_views(buf, hq, hkv, d), ref)
        sweep_in_place[str(cfg)] = {"us": 1e3 * ms(in_place(cfg)), "correct": correct}
    default_ip = default_config(T, hq, hkv, d, in_place=True)
    ok_ip = [c for c in CONFIGS if sweep_in_place[str(c)]["correct"]]
    best_ip = min(ok_ip, key=lambda c: sweep_in_place[str(c)]["us"])
    paths = {
        "flashinfer rmsnorm q, k only": (ms(flashinfer_norms), None),
        "flashinfer qk": (ms(flashinfer_qk), False),
        "flashinfer qk+v": (ms(flashinfer_qkv), True),
        "torch qk": (ms(torch_qk), False),
        f"triton qk {default}": (ms(triton(default, with_v=False)), False),
        f"triton qk+v {default}": (ms(triton(default)), True),
        f"triton qk+v best {best}": (ms(triton(best)), True),
        f"triton qk in place {default_ip}": (ms(in_place(default_ip)), False),
        f"triton qk in place best {best_ip}": (ms(in_place(best_ip)), False),
    }
    rows = []
    for name, (t_ms, with_v) in paths.items():
        b = floor_bytes(T, hq, hkv, d, n_pos, with_v)
        floor_us = 1e6 * b / PEAK_BW
        rows.append(
            {"path": name, "us": 1e3 * t_ms, "floor_us": floor_us, "of_floor": floor_us / (1e3 * t_ms)}
        )
    return {
        "model": model,
        "tokens": T,
        "heads": [hq, hkv, d],
        "distinct_positions": n_pos,
        "default_config": list(default),
        "best_config": list(best),
        "max_abs_err_vs_fp32_reference": errors,
        "rows": rows,
        "sweep": sweep,
        "best_config_in_place": list(best_ip),
        "sweep_in_place": sweep_in_place,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--no-cold", action="store_true", help="skip the fresh-process compile timing")
    args = ap.parse_args()
    device = torch.device("cuda")
    result: dict = {"env": environment(device), "peak_bw": PEAK_BW, "configs": CONFIGS}
    # first: the fresh processes (before this one holds GPU memory)
    if not args.no_cold:
        result["first_call"] = first_call_times()
        print("first call (fresh process):", json.dumps(result["first_call"]))
    t0 = time.perf_counter()
    result["copy_bw_measured"] = copy_bandwidth(device)
    print(f"device-to-device copy: {result['copy_bw_measured'] / 1e12:.2f} TB/s (read + written)")
    shapes = []
    for model in MODELS:
        for T in TOKENS:
            try:
                shapes.append(bench_shape(model, T, device))
            except Exception as e:  # keep the other shapes' numbers
                print(f"{model} T={T}: {type(e).__name__}: {e}")
                shapes.append({"model": model, "tokens": T, "error": repr(e)})
            torch.cuda.empty_cache()
    result["shapes"] = shapes
    result["bench_s"] = time.perf_counter() - t0
    write_json(args.out / "qk_norm_rope.json", result)
    for s in shapes:
        if "rows" in s:
            sweep = ", ".join(f"{c}: {v['us']:.1f}" for c, v in s["sweep"].items())
            print(f"sweep {s['model']} T={s['tokens']} (us; BLOCK_T, BLOCK_H, warps, heads_fastest): {sweep}")
            sweep = ", ".join(f"{c}: {v['us']:.1f}" for c, v in s["sweep_in_place"].items())
            print(f"  in place: {sweep}")
            print(f"  max |err| vs fp32 reference: {s['max_abs_err_vs_fp32_reference']}")
    print("\n| model | T | path | us | floor us | of floor |\n| --- | --- | --- | --- | --- | --- |")
    for s in shapes:
        for r in s.get("rows", []):
            print(
                f"| {s['model']} | {s['tokens']} | {r['path']} | {r['us']:.1f} | {r['floor_us']:.1f} "
                f"| {r['of_floor']:.0%} |"
            )
    print(f"wrote {args.out / 'qk_norm_rope.json'}")


if __name__ == "__main__":
    main()
