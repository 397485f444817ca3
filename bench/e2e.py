"""Model-level benchmark: one scoring forward per scheme on a Qwen3-0.6B-shaped random bf16 model.

A scheme changes both the attention kernels and the number of tokens through the GEMMs (naive
recomputes the prompt for every doc), so the cost model is fitted to these times, not to the
kernel table. ``forward_ms`` is the wall time of ``ModelRunner.forward`` (backend ``plan()`` of every
pass, 28 layers, the score rows), synchronised before and after, with the engine's piecewise CUDA
graphs (``results``); the held-out shapes also in the configurations named by ``--compare``, side
by side: ``results_eager`` (eager forward, HF's op order) and ``results_fa2`` (the serving
configuration on FA2 kernels instead of FA3). The Python planner is timed apart (``planner_ms``).
The shapes are fixed here, before any fit: ``TRAIN`` for fitting, ``HELDOUT`` (the article's
eight cells and thirteen off-grid ones) only for evaluation.

    python -m bench.e2e --out out/
    python -m bench.e2e --split heldout --compare fa2 --out out/
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from scorer.attention.base import HeadSpec
from scorer.attention.flashinfer import FlashInferBackend
from scorer.config import ModelConfig
from scorer.models.decoder import DecoderLM
from scorer.models.graphs import GraphedDecoder
from scorer.planning import REGISTRY, Shape, get, plan_batch
from scorer.runner import ModelRunner

from .timing import environment, time_host, write_json

SCHEMES = tuple(n for n, s in REGISTRY.items() if not s.grouped)

QWEN3_06B: dict = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
    "attention_bias": False,
}
TRAIN = [(p, s, m) for p in (32, 256, 2048, 8192) for s in (4, 32, 256) for m in (1, 8, 64, 256)]
HELDOUT = [(p, s, m) for p in (96, 8196) for s in (4, 256) for m in (2, 32)] + [
    (64, 12, 3),
    (64, 100, 40),
    (150, 500, 24),
    (500, 10, 100),
    (500, 60, 12),
    (700, 200, 2),
    (1200, 24, 160),
    (1500, 300, 100),
    (3000, 16, 20),
    (3000, 120, 6),
    (5000, 8, 48),
    (12000, 6, 200),
    (12000, 40, 30),
]
SMOKE = [(96, 4, 2), (300, 20, 9)]
GROUP_SIZES = (4, 16, 64)
EAGER_CURVE = (16, 64, 256, 1024, 4096, 16384, 65536)
MAX_MASK_TOKENS = 8_448
NAIVE_DOMINATED = (3.0, 32_768)  # naive rows over the others' rows, and absolute rows


def variants(m: int, only: tuple[str, ...] = ()) -> list[tuple[str, int]]:
    """Every ungrouped scheme and the grouped ones of each size below ``m``; ``only``: these labels."""
    out = [(s, 0) for s in SCHEMES] + [("grouped", g) for g in GROUP_SIZES if g < m]
    return [v for v in out if not only or get(v[0]).label(v[1]) in only]


def skip_reason(scheme: str, shape: Shape) -> str | None:
    p, m, s = shape.prefix_len, len(shape.item_lens), shape.item_lens[0]
    naive_rows, rows = m * (p + s), shape.num_tokens
    if scheme == "naive" and naive_rows > NAIVE_DOMINATED[0] * rows and naive_rows > NAIVE_DOMINATED[1]:
        return f"dominated: naive computes {naive_rows} rows against {rows}"
    if scheme == "custom_mask" and rows > MAX_MASK_TOKENS:
        return f"explicit mask over {rows} tokens (cap {MAX_MASK_TOKENS})"
    return None


def build_model(
    device: torch.device, layers: int, kernels: str = "torch", shape: dict = QWEN3_06B
) -> DecoderLM:
    """A model of ``shape`` (Qwen3-0.6B's by default) with seeded random bf16 weights (equal
    whatever ``kernels``)."""
    config = ModelConfig.from_hf({**shape, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device(device):
        model = DecoderLM(config, kernels)
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            torch.nn.init.normal_(p, std=0.02)
    return model.to(torch.bfloat16).eval().requires_grad_(False).finalize()


def shape_inputs(shape: Shape, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and the positions of the logical token space (prefix, then each item)."""
    g = torch.Generator().manual_seed(shape.num_tokens)
    ids = torch.randint(0, vocab, (shape.num_tokens,), generator=g)
    pos = [torch.arange(shape.prefix_len)] + [
        torch.arange(shape.prefix_len, shape.prefix_len + n) for n in shape.item_lens
    ]
    return ids.to(device), torch.cat(pos).to(device)


def _no_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out=None) -> torch.Tensor:
    return q if out is None else out.copy_(q)


def gemm_curve(model, device: torch.device, counts, vocab: int) -> dict[int, float]:
    """Forward time with attention replaced by the identity: the GEMMs, norms, RoPE and launches
    (``model``: the DecoderLM, eager, or the engine's GraphedDecoder)."""
    out = {}
    for n in counts:
        ids = torch.randint(0, vocab, (n,), device=device)
        pos = torch.arange(n, device=device)
        with torch.inference_mode():
            model.forward_hidden(ids, pos, _no_attention)
            out[n] = time_host(lambda ids=ids, pos=pos: model.forward_hidden(ids, pos, _no_attention), device)
    return out


@contextmanager
def gc_paused():
    """A collection first, then none until the block ends (timed host work)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def time_planner(scheme: str, group: int, shape: Shape):
    """The plan and the planner's host ms (with the plan check): the median of 3 runs, one run
    when it takes over 50 ms, with the garbage collector paused as for the forwards (with it
    running, one H200 run timed a planner at 24.9 ms against its neighbours' 1.1-1.5)."""
    times = []
    with gc_paused():
        while len(times) < (3 if not times or times[0] < 50 else 1):
            t0 = time.perf_counter()
            plan = plan_batch([(shape, get(scheme), group or 8)], 0, 1 << 30)
            times.append((time.perf_counter() - t0) * 1e3)
    return plan, statistics.median(times)


def measure_cell(
    engine: ModelRunner, shape: Shape, ids, pos, repeats: int, only: tuple[str, ...] = ()
) -> dict[str, dict]:
    """Every variant of one shape, timed round-robin so that drift (clocks, host load) hits all
    variants alike; ``forward_ms`` is the median of ``repeats`` rounds (2 for forwards over 0.3 s),
    with the garbage collector paused."""
    out: dict[str, dict] = {}
    runs = {}
    for scheme, group in variants(len(shape.item_lens), only):
        name = get(scheme).label(group)
        why = skip_reason(scheme, shape)
        if why:
            out[name] = {"skipped": why}
            continue
        try:
            plan, planner_ms = time_planner(scheme, group, shape)
            with torch.inference_mode():
                engine.forward(plan, ids, pos)
                first = time_host(lambda plan=plan: engine.forward(plan, ids, pos), engine.device, iters=1)
            runs[name] = (plan, [first])
            out[name] = {"planner_ms": planner_ms, "rows": plan.num_slots, "passes": len(plan.passes)}
            out[name]["calls"] = plan.num_attention_calls
        except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
            out[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
            torch.cuda.empty_cache()
    rounds = repeats if max((t[0] for _, t in runs.values()), default=0) < 300 else 2
    with gc_paused(), torch.inference_mode():
        for r in range(rounds - 1):
            names = list(runs)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                plan, times = runs[name]
                fwd = partial(engine.forward, plan, ids, pos)
                times.append(time_host(fwd, engine.device, iters=1))
    for name, (_, times) in runs.items():
        out[name].update(forward_ms=statistics.median(times), runs_ms=[round(t, 3) for t in times])
    return out


Cell = tuple[str, tuple[int, int, int]]


def run(
    cells: list[Cell],
    layers: int,
    out: Path,
    deadline: float,
    device: torch.device,
    repeats: int = 5,
    graph_max_tokens: int = 16384,
    compare: tuple[str, ...] = ("eager",),
    kernels: str = "flashinfer",
    only: tuple[str, ...] = (),
) -> dict:
    model = build_model(device, layers, kernels)  # the serving configuration: fused kernels, graphs
    reference = build_model(device, layers)  # equal weights, HF's op order, eager
    mc = model.config
    backend = FlashInferBackend(HeadSpec(mc.num_heads, mc.num_kv_heads, mc.head_dim, torch.bfloat16, device))
    engine = ModelRunner(model, backend, graph_max_tokens)
    eager = ModelRunner(reference, backend)
    others = {}
    if "eager" in compare:
        others["results_eager"] = eager
    if "fa2" in compare:
        others["results_fa2"] = copy.copy(engine)  # the same model and graphs, FA2 attention
        others["results_fa2"].backend = FlashInferBackend(backend.spec, kernels="fa2")
    for name in ("flashinfer", "fused"):
        if name in compare and name != kernels:  # the same weights, other model kernels, graphs
            others[f"results_{name}"] = ModelRunner(
                build_model(device, layers, name), backend, graph_max_tokens
            )
            others[f"results_{name}"].capture_graphs()
    result = {"env": environment(device), "model": {**QWEN3_06B, "num_hidden_layers": layers}}
    result["compare"] = list(others)
    result["kernels"] = getattr(backend, "kernels", backend.name)
    result["model_kernels"] = {"results": kernels, "results_eager": "torch"}
    result["timing"] = (
        "wall ms of ModelRunner.forward, synchronised before and after; median of round-robin runs"
    )
    result["graph_capture_s"] = engine.capture_graphs()
    result["graph_buckets"] = engine.graphs.buckets if engine.graphs else []
    counts = sorted({*result["graph_buckets"], *(n * graph_max_tokens for n in (2, 4) if layers == 28)})
    eager_counts = EAGER_CURVE[: 3 if layers < 28 else None]
    curves = {"graphs+fused": gemm_curve(engine.graphs or model, device, counts, mc.vocab_size)}
    if not only:  # a run of some schemes, to fill a full run's cells, needs its GEMM curve alone
        curves["eager+fused"] = gemm_curve(model, device, eager_counts, mc.vocab_size)
        curves["eager+torch"] = gemm_curve(reference, device, eager_counts, mc.vocab_size)
    if device.type == "cuda" and graph_max_tokens and not only:
        torch_graphs = GraphedDecoder(reference, graph_max_tokens)
        torch_graphs.warm_up()
        curves["graphs+torch"] = gemm_curve(torch_graphs, device, counts, mc.vocab_size)
        del torch_graphs
    result["gemm_curve"] = curves["graphs+fused"]
    result["gemm_curves"] = curves
    for name, curve in curves.items():
        print(f"forward without attention, {name}:", {n: round(t, 2) for n, t in curve.items()}, flush=True)
    result["cells"] = []
    for split, (p, s, m) in cells:
        cell = {"split": split, "P": p, "S": s, "M": m, "results": {}}
        result["cells"].append(cell)
        if time.monotonic() > deadline:
            cell["skipped"] = "time budget of the run"
            continue
        shape = Shape(p, (s,) * m)
        ids, pos = shape_inputs(shape, mc.vocab_size, device)
        cell["results"] = measure_cell(engine, shape, ids, pos, repeats, only)
        if split == "heldout":
            for key, other in others.items():
                cell[key] = measure_cell(other, shape, ids, pos, repeats, only)
        for key in ("results", *others):
            timed = [(r["forward_ms"], k) for k, r in cell.get(key, {}).items() if "forward_ms" in r]
            if timed:
                print(f"{split} P={p} S={s} M={m} {key}: best {min(timed)}", flush=True)
        write_json(out / "e2e.json", result)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="2 layers, 2 shapes")
    ap.add_argument("--split", choices=("all", "train", "heldout"), default="all")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; later cells are skipped")
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--graph-max-tokens", type=int, default=16384, help="0: eager forwards only")
    ap.add_argument(
        "--compare",
        default="eager",
        help="held-out cells also in: eager, fa2, flashinfer, fused (comma-separated)",
    )
    ap.add_argument(
        "--model-kernels",
        default="flashinfer",
        help="of the main runs (the cost model is fitted to flashinfer)",
    )
    ap.add_argument(
        "--schemes",
        default="",
        help="comma-separated labels (e.g. cascade,grouped:16): only these, to fill an earlier run's cells",
    )
    a = ap.parse_args(argv)
    if a.smoke:
        cells = [("smoke", c) for c in SMOKE]
    else:
        cells = [("heldout", c) for c in HELDOUT if a.split in ("all", "heldout")]
        cells += [("train", c) for c in TRAIN if a.split in ("all", "train")]
    layers = 2 if a.smoke else QWEN3_06B["num_hidden_layers"]
    deadline = time.monotonic() + a.budget
    compare = tuple(x for x in a.compare.split(",") if x)
    run(
        cells,
        layers,
        a.out,
        deadline,
        torch.device(a.device),
        a.repeats,
        a.graph_max_tokens,
        compare,
        a.model_kernels,
        tuple(x for x in a.schemes.split(",") if x),
    )


if __name__ == "__main__":
    main()
