"""Engine scores on the GPU (bf16, FlashInfer, piecewise CUDA graphs) against the CPU (fp32,
torch reference) and the eager GPU forward, and a forward pass with no host synchronisation.
Skipped without CUDA and flashinfer."""

from __future__ import annotations

import random
from itertools import combinations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from scorer.attention.kvpool import KVPool  # noqa: E402
from scorer.engine import EngineConfig, logical_tokens  # noqa: E402
from scorer.request import Doc, ScoreOptions, ScoreRequest  # noqa: E402
from scorer.runtime import build_engine  # noqa: E402

TOL = 0.05
BF16 = torch.bfloat16
SCHEMES = ["naive", "split_cache", "ragged", "cascade", "multi_item", "custom_mask", "grouped", "auto"]
WORDS = "the of shared prefix attention kernel scoring query ranking flash cascade merge item".split()  # noqa: SIM905


def requests(scheme: str, seed: int = 0, n: int = 4) -> list[ScoreRequest]:
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    return [
        ScoreRequest(
            prompt=text(rng.randint(3, 60)),
            docs=[Doc(text=text(rng.randint(1, 40)), id=str(i)) for i in range(rng.randint(1, 12))],
            options=ScoreOptions(scheme=scheme, score_mode="logprob", group_size=3),
        )
        for _ in range(n)
    ]


def scores(engine, scheme: str) -> list[float]:
    out = []
    for r in engine.score_batch([engine.tokenize(q) for q in requests(scheme)]):
        out += [d.score for d in r.results]
    return out


@pytest.fixture(scope="module")
def cpu_engine(checkpoint):
    return build_engine(checkpoint, "torch", "cpu", torch.float32)


@pytest.fixture(scope="module")
def gpu_engine(checkpoint):
    """The serving configuration: FlashInfer and the CUDA graphs captured (default buckets)."""
    engine = build_engine(checkpoint, "flashinfer", "cuda", torch.bfloat16, EngineConfig())
    assert engine.runner.backend.name == "flashinfer" and engine.runner.model.fused
    assert engine.runner.capture_graphs() > 0
    return engine


@pytest.fixture(scope="module")
def gpu_scores(gpu_engine) -> dict[str, list[float]]:
    gpu_engine.runner.graphs.stats.clear()
    out = {s: scores(gpu_engine, s) for s in SCHEMES}
    stats = gpu_engine.runner.graphs.stats  # naive batches of 4 x 12 docs can exceed the largest bucket
    assert stats["graphed_forwards"] > stats["eager_forwards"]
    return out


@pytest.fixture(scope="module")
def eager_scores(checkpoint) -> dict[str, list[float]]:
    """FlashInfer attention in an eager forward with HF's op order for everything else."""
    engine = build_engine(
        checkpoint, "flashinfer", "cuda", torch.bfloat16, kernels="torch", cuda_graph_max_tokens=0
    )
    assert engine.runner.graphs is None and not engine.runner.model.fused
    return {s: scores(engine, s) for s in SCHEMES}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_graphed_fused_scores_match_the_eager_hf_order_forward(scheme, gpu_scores, eager_scores):
    worst = max(abs(a - b) for a, b in zip(gpu_scores[scheme], eager_scores[scheme], strict=True))
    assert worst < TOL, f"{scheme}: max |graphed, fused - eager, HF order| = {worst:.4f}"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bf16_gpu_scores_match_fp32_cpu(scheme, gpu_scores, cpu_engine):
    ref = scores(cpu_engine, "naive")
    got = gpu_scores[scheme]
    worst = max(abs(a - b) for a, b in zip(got, ref, strict=True))
    assert worst < TOL, f"{scheme}: max |bf16 gpu - fp32 cpu| = {worst:.4f}"
    wrong = [(i, j) for i, j in combinations(range(len(ref)), 2) if abs(ref[i] - ref[j]) > TOL]
    wrong = [(i, j) for i, j in wrong if (ref[i] > ref[j]) != (got[i] > got[j])]
    assert not wrong, f"{scheme}: order differs from the CPU for doc pairs {wrong[:5]}"
    assert any(abs(ref[i] - ref[j]) > TOL for i, j in combinations(range(len(ref)), 2))


def test_swiglu_gemm_in_the_graphs_scores_as_cublas_and_silu(checkpoint, gpu_scores, cpu_engine, monkeypatch):
    """Triton's gate/up GEMM (``DecoderLM.swiglu_gemm``) captured in every bucket's graphs (its
    row threshold lowered to 0: this file's passes are small) against the engine without it (the
    fixture's, whose passes are all under the threshold) and the CPU's fp32."""
    from scorer.models import triton_ops

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("gate_up_silu needs Hopper")
    monkeypatch.setattr(triton_ops, "SWIGLU_MIN_ROWS", 0)
    calls = []
    real = triton_ops.gate_up_silu
    monkeypatch.setattr(triton_ops, "gate_up_silu", lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = build_engine(checkpoint, "flashinfer", "cuda", torch.bfloat16, EngineConfig())
    assert engine.runner.model.swiglu_gemm
    assert engine.runner.capture_graphs() > 0 and calls  # captured into the graphs
    ref = scores(cpu_engine, "naive")
    for scheme in ("ragged", "cascade", "multi_item", "auto"):
        got = scores(engine, scheme)
        for other, name in ((gpu_scores[scheme], "cuBLAS + SiLU-and-mul"), (ref, "fp32 cpu")):
            worst = max(abs(a - b) for a, b in zip(got, other, strict=True))
            assert worst < TOL, f"{scheme}: max |swiglu GEMM - {name}| = {worst:.4f}"
    assert engine.runner.graphs.stats["graphed_forwards"] > 0


def test_schemes_agree_with_each_other_on_gpu(gpu_scores):
    for a, b in combinations(SCHEMES, 2):
        worst = max(abs(x - y) for x, y in zip(gpu_scores[a], gpu_scores[b], strict=True))
        assert worst < TOL, f"{a} vs {b}: {worst:.4f}"


def test_mixed_scheme_batch_matches_single_scheme_scores(gpu_engine, gpu_scores):
    batch = [q for i, s in enumerate(SCHEMES) for q in requests(s)[i % 4 : i % 4 + 1]]
    results = gpu_engine.score_batch([gpu_engine.tokenize(q) for q in batch])
    for i, (s, r) in enumerate(zip(SCHEMES, results, strict=True)):
        k = i % 4
        start = sum(len(q.docs) for q in requests(s)[:k])
        expected = gpu_scores[s][start : start + len(r.results)]
        assert max(abs(d.score - e) for d, e in zip(r.results, expected, strict=True)) < TOL


@torch.inference_mode()
def _layer_loop(engine, plan, ids, positions, logicals, graphed: bool) -> torch.Tensor:
    """The engine's forward (in inference mode, as the engine runs it) with the plan's row maps
    already on the device."""
    runner = engine.runner
    mc = runner.model.config
    pool = KVPool(plan, mc.num_layers, mc.num_kv_heads, mc.head_dim, runner.dtype, runner.device)
    hidden = None
    for p, logical in zip(plan.passes, logicals, strict=True):
        runner.backend.plan(p)

        def attn(layer, q, k, v, out=None, p=p):
            return runner.backend.run(layer, q, *pool.write(layer, p, k, v), out=out)

        model = runner.graphs if graphed else runner.model
        hidden = model.forward_hidden(ids[logical], positions[logical], attn)
    return hidden


@pytest.mark.parametrize("graphed", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("scheme", SCHEMES[:-1])
def test_layer_loop_runs_without_host_sync(gpu_engine, scheme, graphed):
    batch = [gpu_engine.tokenize(q) for q in requests(scheme, seed=5, n=2)]
    plan = gpu_engine.plan(batch)
    ids, positions = logical_tokens([batch[i] for i in plan.requests], gpu_engine.device)
    logicals = [p.logical.to(gpu_engine.device) for p in plan.passes]
    _layer_loop(gpu_engine, plan, ids, positions, logicals, graphed)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _layer_loop(gpu_engine, plan, ids, positions, logicals, graphed)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("scheme", ["cascade", "auto"])
def test_engine_launch_runs_without_host_sync(gpu_engine, scheme):
    """Planning, inputs, every pass, the LM head and the copy of the scores to the host are all
    queued without waiting for the device: the server plans the next batch meanwhile."""
    batch = [gpu_engine.tokenize(q) for q in requests(scheme, seed=6, n=2)]
    expected = [[d.score for d in r.results] for r in gpu_engine.score_batch(batch)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        collect = gpu_engine.launch(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got = [[d.score for d in r.results] for r in collect()]
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g == pytest.approx(e, abs=1e-5)


@pytest.mark.parametrize(
    "scheme", ["ragged", "split_cache", "multi_item", "cascade", "grouped", "custom_mask"]
)
def test_launch_does_not_wait_for_the_work_queued_before_it(gpu_engine, scheme):
    """With the device busy (a 1 s spin kernel queued), launching a batch returns at once: no copy
    to the device waits for the stream (a pageable-memory copy would), so the server plans and
    queues the next batch while the device still runs the last."""
    import time

    batch = [gpu_engine.tokenize(q) for q in requests(scheme, seed=8, n=2)]
    expected = [[d.score for d in r.results] for r in gpu_engine.score_batch(batch)]
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about 1 s of device time
    t0 = time.perf_counter()
    collect = gpu_engine.launch(batch)
    took = time.perf_counter() - t0
    got = [[d.score for d in r.results] for r in collect()]
    assert took < 0.25, f"{scheme}: launch took {took:.3f} s behind a busy device"
    assert got == [pytest.approx(e, abs=1e-5) for e in expected]


@pytest.mark.parametrize("scheme", ["naive", "ragged", "cascade", "multi_item", "custom_mask"])
def test_qkv_in_place_equals_the_copied_heads(gpu_engine, scheme):
    """q and k normed and rotated in place in the QKV GEMM's output and v left there, so that
    FlashInfer reads strided heads (paged, contiguous and merged calls), against the same kernel
    writing three contiguous tensors: the same scores, eager forwards both."""
    model, graphs = gpu_engine.runner.model, gpu_engine.runner.graphs
    batch = [gpu_engine.tokenize(q) for q in requests(scheme, seed=9)]
    assert model.qkv_in_place
    gpu_engine.runner.graphs = None
    try:
        in_place = [d.score for r in gpu_engine.score_batch(batch) for d in r.results]
        model.qkv_in_place = False
        copied = [d.score for r in gpu_engine.score_batch(batch) for d in r.results]
    finally:
        model.qkv_in_place = True
        gpu_engine.runner.graphs = graphs
    assert in_place == pytest.approx(copied, abs=1e-4)
    graphed = [d.score for r in gpu_engine.score_batch(batch) for d in r.results]
    assert graphed == pytest.approx(in_place, abs=TOL)


@pytest.mark.parametrize("scheme", ["ragged", "cascade", "multi_item", "naive"])
def test_a_split_request_recomputing_its_prompt_scores_as_one_pass(checkpoint, gpu_engine, scheme):
    """A request over the token budget, its prompt computed again in each pass (no K/V pool) or
    reused from the pool, against the same request in one pass."""
    rng = random.Random(4)
    req = ScoreRequest(
        prompt=" ".join(rng.choice(WORDS) for _ in range(20)),
        docs=[Doc(text=" ".join(rng.choice(WORDS) for _ in range(30)), id=str(i)) for i in range(12)],
        options=ScoreOptions(scheme=scheme, score_mode="logprob"),
    )
    whole = [d.score for d in gpu_engine.score(req).results]
    for share in (0.0, 10.0):
        cfg = EngineConfig(max_tokens_per_pass=150, prompt_recompute_share=share)
        split = build_engine(checkpoint, "flashinfer", "cuda", torch.bfloat16, cfg, cuda_graph_max_tokens=0)
        got = [d.score for d in split.score(req).results]
        assert split.runner.stats["forward_passes"] > 1
        assert split.runner.stats["pooled_forwards"] == (share == 0 and scheme != "naive")
        assert max(abs(a - b) for a, b in zip(got, whole, strict=True)) < TOL, (scheme, share)
