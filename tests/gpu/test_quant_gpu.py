"""FP8 linears on the GPU (``torch._scaled_mm``, rowwise scales) against the CPU reference on the
same FP8 weights, inside the CUDA graphs, and every scheme against FP8 naive. Skipped without
CUDA, flashinfer or an FP8 GPU (compute capability 8.9+)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 GEMMs need compute capability 8.9+", allow_module_level=True)

from test_flashinfer_engine import SCHEMES, scores  # noqa: E402

from scorer.engine import EngineConfig  # noqa: E402
from scorer.models import fp8_kernels, triton_ops  # noqa: E402
from scorer.models.quant import Fp8Linear, quantize_rows, reference_mm  # noqa: E402
from scorer.runtime import build_engine  # noqa: E402

BF16 = torch.bfloat16
FP8_TOL = 0.2
"""FP8's own rounding in a score: every scheme against FP8 naive differed by 0.06-0.11 log-prob on
an H100 (this checkpoint; the same with torch, FlashInfer or fused kernels, eager or graphed), where
bf16 differs by 0.01-0.02: a bf16 difference in an activation moves it across an FP8 rounding
boundary, which per-token scaling then carries into the whole row."""


@pytest.mark.parametrize("rows", [1, 37, 4096])
def test_scaled_mm_is_the_cpu_reference_on_the_same_fp8_values(rows):
    g = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(512, 768, bias=False, dtype=BF16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(768, 512, generator=g) * 0.05)
    fp8 = Fp8Linear.quantize(linear.cuda())
    x = (torch.randn(rows, 512, generator=g) * 3).to(BF16)
    qx, sx = quantize_rows(x.cuda())
    cq, cs = quantize_rows(x)
    assert torch.equal(sx.cpu(), cs)  # the same absmax, the same product
    # x * (1 / scale) rounds to FP8 on either side of a tie by device (measured on an H100: rows of 37 of
    # 512 values differ in a few elements): at most one FP8 step apart, and rarely
    gq, cq32 = qx.cpu().float(), cq.float()
    assert ((gq - cq32).abs() <= cq32.abs() * 2**-3 + 2**-9).all()
    assert (gq != cq32).float().mean() < 0.01
    got = fp8(x.cuda()).float().cpu()
    want = reference_mm(qx.cpu(), sx.cpu(), fp8.weight.cpu(), fp8.weight_scale.cpu())
    # bf16 output: 2^-8 of the value, plus the fp32 accumulation's order
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3 * want.abs().max().item())


def test_fp8_linear_replays_from_a_cuda_graph():
    linear = torch.nn.Linear(256, 512, bias=False, dtype=BF16, device="cuda")
    fp8 = Fp8Linear.quantize(linear)
    x = torch.randn(300, 256, dtype=BF16, device="cuda")
    eager = fp8(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fp8(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8(x)
    x.mul_(2.0)  # new activations, new scales: computed on the device at replay
    graph.replay()
    torch.testing.assert_close(out, fp8(x), rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(out, eager * 2, rtol=2**-7, atol=1e-2)


def _one_step_apart(got: fp8_kernels.Quantized, want: tuple[torch.Tensor, torch.Tensor], share: float):
    """``got`` within one FP8 step of ``want`` everywhere (a bf16 input a ulp apart, or a scale
    from another summation order, moves a value across a rounding boundary), differing in at most
    ``share`` of the values."""
    g, w = got.q.float() * got.scale, want[0].float() * want[1]
    step = want[0].float().abs() * 2**-3 * want[1] + want[1] * 2**-9
    assert ((g - w).abs() <= step * 1.01 + 1e-30).all()
    assert (got.q.float() != want[0].float()).float().mean().item() <= share


@pytest.mark.parametrize("rows,width", [(1, 1024), (37, 2048), (5000, 4096), (300, 12288)])
def test_the_quantize_kernel_gives_quantize_rows_bits(rows, width):
    spread = torch.logspace(-3, 3, rows, device="cuda")[:, None]  # rows of every magnitude
    x = (torch.randn(rows, width, device="cuda") * spread).to(BF16)
    x[0] = 0.0  # a graph bucket's padding row
    got = fp8_kernels.quantize(x)
    q, s = quantize_rows(x)
    assert torch.equal(got.scale, s) and torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("rows,width", [(1, 1024), (999, 1024), (77, 4096), (3, 5120)])
def test_the_norm_kernels_quantize_the_norm(rows, width):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, width, device="cuda", generator=g).to(BF16)
    res = (torch.randn(rows, width, device="cuda", generator=g) * 4).to(BF16)
    w = (torch.rand(width, device="cuda", generator=g) + 0.5).to(BF16)
    want = quantize_rows(triton_ops.rms_norm(x, w, 1e-6))
    _one_step_apart(fp8_kernels.rms_norm_quant(x, w, 1e-6), want, 0.01)
    want_res = (res.float() + x.float()).to(BF16)
    got = fp8_kernels.rms_norm_quant(x, w, 1e-6, residual=res)
    assert torch.equal(res, want_res)  # the residual stream, added in fp32 and rounded once
    _one_step_apart(got, quantize_rows(triton_ops.rms_norm(want_res, w, 1e-6)), 0.01)


@pytest.mark.parametrize("rows,width", [(1, 3072), (2048, 3072), (64, 12288), (5, 25600)])
def test_the_silu_kernel_quantizes_silu_and_mul(rows, width):
    gu = (torch.randn(rows, 2 * width, device="cuda") * 3).to(BF16)
    _one_step_apart(fp8_kernels.silu_mul_quant(gu), quantize_rows(fp8_kernels.silu_mul_reference(gu)), 0.01)


@pytest.mark.parametrize("rows,hidden,inter", [(1536, 1024, 3072), (2500, 4096, 12288)])
def test_the_fp8_gate_up_silu_gemm_is_its_reference(rows, hidden, inter):
    """Triton's gate/up + SiLU GEMM on FP8 operands and their scales (``DecoderLM.swiglu_gemm`` with
    ``--quantization fp8``) against the same FP8 values dequantized, multiplied in fp32. Hopper's FP8
    MMA accumulates a K loop in reduced precision (~14 bits of mantissa, which Triton does not
    promote to fp32 by default; cuBLAS does): on an H100, 9 of 30.7M outputs of the 8B shape fell
    outside bf16's rounding, the worst by 0.6% of the largest output."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", generator=g).to(BF16)
    w = (torch.randn(2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).to(BF16)
    (qx, sx), (qw, sw) = quantize_rows(x), quantize_rows(w)
    assert triton_ops.gate_up_silu_supported(qx, qw)
    got = triton_ops.gate_up_silu(qx, qw, x_scale=sx, w_scale=sw.reshape(1, -1)).float()
    want = triton_ops.gate_up_silu_reference(qx.float() * sx, qw.float() * sw)
    top = want.abs().max().item()
    off = (got - want).abs() > 2**-7 * want.abs() + 1e-3 * top
    assert off.float().mean().item() < 2e-6 and (got - want).abs().max().item() < 0.02 * top


def test_the_fp8_kernels_replay_from_a_cuda_graph():
    x = torch.randn(300, 1024, dtype=BF16, device="cuda")
    res = torch.randn(300, 1024, dtype=BF16, device="cuda")
    w = torch.rand(1024, dtype=BF16, device="cuda")
    gu = torch.randn(300, 6144, dtype=BF16, device="cuda")
    run = lambda: (fp8_kernels.rms_norm_quant(x, w, 1e-6, res), fp8_kernels.silu_mul_quant(gu))  # noqa: E731
    res0 = res.clone()
    run()  # compiles
    res.copy_(res0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        norm, act = run()
    res.copy_(res0)
    x.mul_(2.0)
    gu.mul_(-1.0)
    graph.replay()
    want_res = res0.clone()
    want = fp8_kernels.rms_norm_quant(x, w, 1e-6, want_res)
    assert torch.equal(res, want_res) and torch.equal(norm.scale, want.scale)
    assert torch.equal(act.q.view(torch.uint8), fp8_kernels.silu_mul_quant(gu).q.view(torch.uint8))


@pytest.fixture(scope="module")
def fp8_gpu(checkpoint):
    """The serving configuration with FP8 linears: FlashInfer, fused kernels, CUDA graphs."""
    engine = build_engine(checkpoint, "flashinfer", "cuda", BF16, EngineConfig(), quantization="fp8")
    layer = engine.runner.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, Fp8Linear)
    # the fused path: merged FP8 GEMMs, their inputs quantized by the kernels that make them
    assert isinstance(layer.mlp.gate_up, Fp8Linear) and layer.input_layernorm.quantize
    assert engine.runner.capture_graphs() > 0
    return engine


@pytest.fixture(scope="module")
def fp8_cpu(checkpoint, fp8_gpu):
    """The CPU reference (torch attention, the FP8 GEMMs dequantized in fp32) on the GPU model's FP8
    weights and scales, with bf16 activations as on the GPU: against an fp32 reference, whose
    activations round to other FP8 values, the GPU's scores differed by 0.22-0.25 log-prob (H100)."""
    engine = build_engine(checkpoint, "torch", "cpu", BF16, quantization="fp8")
    gpu = dict(fp8_gpu.runner.model.named_buffers())
    for name, buf in engine.runner.model.named_buffers():
        if name.endswith(("weight", "weight_scale")) and name in gpu:
            buf.copy_(gpu[name].cpu())
    return engine


@pytest.fixture(scope="module")
def fp8_scores(fp8_gpu) -> dict[str, list[float]]:
    fp8_gpu.runner.graphs.stats.clear()
    out = {s: scores(fp8_gpu, s) for s in SCHEMES}
    assert fp8_gpu.runner.graphs.stats["graphed_forwards"] > 0
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fp8_gpu_scores_match_the_cpu_reference(scheme, fp8_scores, fp8_cpu):
    ref = scores(fp8_cpu, "naive")
    worst = max(abs(a - b) for a, b in zip(fp8_scores[scheme], ref, strict=True))
    assert worst < FP8_TOL, f"{scheme}: max |fp8 gpu - fp8 cpu reference| = {worst:.4f}"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_scores_as_fp8_naive(scheme, fp8_scores):
    worst = max(abs(a - b) for a, b in zip(fp8_scores[scheme], fp8_scores["naive"], strict=True))
    assert worst < FP8_TOL, f"{scheme}: max |{scheme} - naive| in FP8 = {worst:.4f}"


def test_fp8_scores_with_the_prefix_cache(checkpoint, fp8_scores):
    reads = EngineConfig(min_cache_read_tokens=0)  # every hit read, however small
    engine = build_engine(
        checkpoint, "flashinfer", "cuda", BF16, reads, quantization="fp8", prefix_cache_mib=64,
        prefix_cache_admit=1,
    )  # fmt: skip
    assert engine.runner.capture_graphs(engine.cache) > 0  # the graphs write the pool themselves
    for scheme in ("ragged", "cascade", "auto"):
        scores(engine, scheme)  # writes the prompts
        got = scores(engine, scheme)  # reads them
        worst = max(abs(a - b) for a, b in zip(got, fp8_scores["naive"], strict=True))
        assert worst < FP8_TOL, f"{scheme} on the prefix cache: max |fp8 - fp8 naive| = {worst:.4f}"
    assert engine.cache.stats["hit_tokens"] > 0


def test_linears_a_checkpoint_left_unquantized_serve_in_bf16(checkpoint, tmp_path):
    """A compressed-tensors checkpoint leaving layer 0's down projection and layer 1's k projection
    unquantized (so its q/k/v run dequantized): on the fused path with CUDA graphs those units run
    in bf16 beside the FP8 ones, within FP8's rounding of the CPU reference of the same checkpoint."""
    from test_quant import ignoring_checkpoint

    path = ignoring_checkpoint(checkpoint, tmp_path / "ignored")
    engine = build_engine(path, "flashinfer", "cuda", BF16, EngineConfig(), quantization="fp8")
    first, second = engine.runner.model.model.layers[:2]
    assert isinstance(first.mlp.gate_up, Fp8Linear) and not first.mlp.quantize
    assert not second.input_layernorm.quantize and isinstance(second.self_attn.qkv_proj, tuple)
    assert engine.runner.capture_graphs() > 0
    cpu = build_engine(path, "torch", "cpu", BF16, quantization="fp8")
    ref = scores(cpu, "naive")
    for scheme in ("naive", "multi_item", "auto"):
        worst = max(abs(a - b) for a, b in zip(scores(engine, scheme), ref, strict=True))
        assert worst < FP8_TOL, f"{scheme}: max |mixed fp8 gpu - cpu reference| = {worst:.4f}"
