"""FP8 linears against bf16: the engine's docs/s and the ranking against an fp32 forward.

On the random Qwen3-0.6B- and 8B-shaped models of ``bench.throughput`` (seeded bf16 weights,
template ``plain``, token ids, two label ids), for each model:

1. the fp32 reference: the same bf16 weights in fp32 (``kernels=torch``, torch attention, eager),
   scoring ``--calls`` calls of A and of E (``--calls-8b`` on the 8B: an fp32 forward of 8B runs
   at fp32's rate, ~1/15 of bf16's; ``--calls`` of both there would take ~10 minutes), then freed;
2. ``bf16``: the serving engine (FlashInfer, fused kernels, CUDA graphs): docs/s at saturation on
   the model's workloads (A and E on 0.6B, A and B on 8B; ``bench.throughput.engine_system``) and
   the same calls scored, then freed;
3. ``fp8``: the same model with ``--quantization fp8``'s linears (``scorer.models.quant``), as 2.

The three models are never resident together (8B: 32 GB in fp32, 16 in bf16). Per system and
workload of the reference's calls: the label log-prob error against fp32 (mean and p99 over every
doc's labels), and per call the Spearman correlation of the docs' scores with fp32's and the share
of fp32's top 3 in the system's top 3 (means over calls, and the fewest). ``ref_score_std`` (the
mean over calls of the spread of fp32's scores across a call's docs) against ``score_err_mean``
says whether the ranking metrics measure anything: random weights put every doc near the same
score, and where the spread is within the error the ranking is noise.

    python -m bench.fp8 --out out/ [--models qwen3-0.6b,qwen3-8b] [--calls 1000] [--calls-8b 100]
    python -m bench.fp8 --cpu-smoke --out out/   (a toy model on the CPU, bf16 attention on the
    torch reference: the code path in ~1 minute, no numbers worth reading)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch

from scorer.attention import HeadSpec
from scorer.attention.torch_ref import TorchBackend
from scorer.engine import Engine, EngineConfig
from scorer.models.quant import quantize_model
from scorer.runner import ModelRunner

from .e2e import build_model
from .throughput import MODELS, batches, calls, embedded_tokenizer, engine_system
from .timing import environment, write_json

THROUGHPUT = {"qwen3-0.6b": ("A", "E"), "qwen3-8b": ("A", "B"), "smoke": ("A",)}
RANKED = ("A", "E")
SYSTEMS = ("bf16", "fp8")


def engine(model, device: torch.device, budget: int, fp32: bool = False) -> Engine:
    """The serving engine of ``model`` (FlashInfer, CUDA graphs); the torch reference attention
    without graphs on the CPU or for the fp32 model."""
    mc = model.config
    dtype = torch.float32 if fp32 else torch.bfloat16
    spec = HeadSpec(mc.num_heads, mc.num_kv_heads, mc.head_dim, dtype, device)
    graphs = device.type == "cuda" and not fp32
    if graphs:
        from scorer.attention.flashinfer import FlashInferBackend

        backend = FlashInferBackend(spec)
    else:
        backend = TorchBackend(spec)
    runner = ModelRunner(model, backend, 16384 if graphs else 0)
    runner.capture_graphs()
    config = EngineConfig(max_tokens_per_pass=budget, auto_policy="calibrated")
    return Engine(runner, embedded_tokenizer(), config)


def score_all(e: Engine, reqs, budget: int) -> list[list[tuple[float, tuple[float, ...]]]]:
    """Per call, (score, label log-probs) of each doc in input order; batches of ``budget`` tokens."""
    out = []
    for batch in batches([e.tokenize(r) for r in reqs], budget):
        for r in e.score_batch(batch):
            docs = sorted(r.results, key=lambda d: d.index)
            out.append([(d.score, tuple(d.label_logprobs)) for d in docs])
    return out


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    for r, i in enumerate(order):
        ranks[i] = float(r)
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (no ties among float scores); 1.0 for fewer than two docs."""
    if len(a) < 2:
        return 1.0
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 1.0


def top_k_agreement(a: list[float], b: list[float], k: int = 3) -> float:
    k = min(k, len(a))
    top = lambda xs: set(sorted(range(len(xs)), key=lambda i: -xs[i])[:k])  # noqa: E731
    return len(top(a) & top(b)) / k


def ranking(got, ref) -> dict:
    """The metrics of one system's calls against fp32's (see the module)."""
    errs, score_errs, rho, top3, spread = [], [], [], [], []
    for g, r in zip(got, ref, strict=True):
        for (gs, glp), (rs, rlp) in zip(g, r, strict=True):
            errs += [abs(x - y) for x, y in zip(glp, rlp, strict=True)]
            score_errs.append(abs(gs - rs))
        gs, rs = [d[0] for d in g], [d[0] for d in r]
        rho.append(spearman(gs, rs))
        top3.append(top_k_agreement(gs, rs))
        spread.append(statistics.pstdev(rs) if len(rs) > 1 else 0.0)
    errs.sort()
    return {
        "calls": len(ref),
        "logprob_err_mean": statistics.fmean(errs),
        "logprob_err_p99": errs[min(len(errs) - 1, int(0.99 * len(errs)))],
        "score_err_mean": statistics.fmean(score_errs),
        "ref_score_std": statistics.fmean(spread),
        "spearman_mean": statistics.fmean(rho),
        "spearman_min": min(rho),
        "top3_mean": statistics.fmean(top3),
        "top3_min": min(top3),
    }


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_model(name: str, device: torch.device, a, result: dict) -> None:
    cfg = MODELS[name]
    layers = cfg["num_hidden_layers"]
    n = a.calls_8b if name == "qwen3-8b" else a.calls
    ranked = {w: calls(w, n, cfg["vocab_size"], seed=1) for w in RANKED}
    rec = {"model": name, "ranked_calls": n, "systems": {}}
    result["models"].append(rec)
    t0 = time.perf_counter()
    ref_scores = {}
    try:
        ref = engine(build_model(device, layers, "torch", cfg).float(), device, a.budget, fp32=True)
        with torch.inference_mode():
            ref_scores = {w: score_all(ref, reqs, a.budget) for w, reqs in ranked.items()}
        del ref
    except torch.OutOfMemoryError as e:
        rec["fp32_reference"] = f"did not fit: {e}"[:200]
    _free()
    rec["fp32_reference_s"] = time.perf_counter() - t0
    for system in SYSTEMS:
        t0 = time.perf_counter()
        model = build_model(device, layers, "fused" if device.type == "cuda" else "torch", cfg)
        if system == "fp8":
            quantize_model(model)
        e = engine(model, device, a.budget)
        out = rec["systems"].setdefault(system, {"throughput": {}, "ranking": {}})
        for w in THROUGHPUT[name] if a.seconds > 0 else ():
            reqs = calls(w, a.throughput_calls, cfg["vocab_size"])
            got = engine_system(e, reqs, "auto", a.seconds, a.budget, idle=False)
            out["throughput"][w] = {k: got[k] for k in ("docs_s", "peak_gib", "scheme_used")}
        for w, ref in ref_scores.items():
            with torch.inference_mode():
                out["ranking"][w] = ranking(score_all(e, ranked[w], a.budget), ref)
        out["seconds"] = time.perf_counter() - t0
        del e, model
        _free()
        write_json(a.out / "fp8.json", result)


def table(result: dict) -> str:
    lines = [
        "| model | workload | bf16 docs/s | fp8 docs/s | fp8 / bf16 |",
        "|---|---|---:|---:|---:|",
    ]
    for rec in result["models"]:
        s = rec["systems"]
        for w in THROUGHPUT[rec["model"]]:
            b, f = (
                s.get(x, {}).get("throughput", {}).get(w, {}).get("docs_s", float("nan")) for x in SYSTEMS
            )
            if b == b:  # measured (NaN where --seconds 0 left docs/s out)
                lines.append(f"| {rec['model']} | {w} | {b:,.0f} | {f:,.0f} | {f / b:.2f}x |")
    lines += [
        "",
        "| model | workload | system | calls | logprob err mean | p99 | score err mean | fp32 score std"
        " | Spearman mean | min | top-3 mean | min |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in result["models"]:
        if "fp32_reference" in rec:
            lines.append(f"| {rec['model']} | | | fp32 reference {rec['fp32_reference']} | | | | | | | | |")
        for system in SYSTEMS:
            for w, m in rec["systems"].get(system, {}).get("ranking", {}).items():
                lines.append(
                    f"| {rec['model']} | {w} | {system} | {m['calls']} | {m['logprob_err_mean']:.2e}"
                    f" | {m['logprob_err_p99']:.2e} | {m['score_err_mean']:.2e} | {m['ref_score_std']:.2e}"
                    f" | {m['spearman_mean']:.4f} | {m['spearman_min']:.3f} | {m['top3_mean']:.3f}"
                    f" | {m['top3_min']:.2f} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--calls", type=int, default=1000, help="calls of A and of E ranked against fp32")
    ap.add_argument("--calls-8b", type=int, default=100, help="--calls on the 8B (its fp32 forward is slow)")
    ap.add_argument("--throughput-calls", type=int, default=64, help="calls cycled through for docs/s")
    ap.add_argument(
        "--seconds",
        type=float,
        default=3.0,
        help="per system and workload, at saturation (0: ranking only)",
    )
    ap.add_argument("--budget", type=int, default=16384, help="tokens per batch, as the server's batcher")
    ap.add_argument("--cpu-smoke", action="store_true", help="a toy model on the CPU, a few calls")
    a = ap.parse_args(argv)
    device = torch.device("cuda")
    if a.cpu_smoke:
        device, a.models, a.calls, a.throughput_calls, a.seconds = torch.device("cpu"), "smoke", 2, 1, 0.01
    result = {**environment(device), "args": {k: str(v) for k, v in vars(a).items()}, "models": []}
    for name in a.models.split(","):
        run_model(name, device, a, result)
        print(f"{name}: done", flush=True)
    write_json(a.out / "fp8.json", result)
    md = table(result)
    (a.out / "fp8.md").write_text(md + "\n")
    print(md, flush=True)
    return result


if __name__ == "__main__":
    main()
