"""The Triton q/k-norm + RoPE kernel (``scorer.models.triton_ops``) against its fp32 torch reference
on the GPU (marked ``gpu``; skipped without CUDA or triton), and the reference against HF's op
order on the CPU (unmarked: runs in the CPU CI, which has neither)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from scorer.models.triton_ops import (
    gate_up_config,
    gate_up_silu,
    gate_up_silu_reference,
    gate_up_silu_supported,
    qk_norm_rope,
    qk_norm_rope_reference,
    rms_norm,
    rms_norm_reference,
)

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs CUDA and triton")
DTYPES = [torch.bfloat16, torch.float16]
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # relative spacing at the low end of a binade
EPS = 1e-6
MAX_POS = 8192


def cos_sin_cache(max_pos: int, head_dim: int, theta: float = 1e6, device="cpu") -> torch.Tensor:
    """As ``RotaryEmbedding.use_fused`` builds it: row p is cos | sin of p * inv_freq."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    freqs = torch.arange(max_pos, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def inputs(T, hq, hkv, d, dtype, norm, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32)

    qkv = (3 * randn(T, (hq + 2 * hkv) * d)).to(dtype)
    qw = (1 + 0.3 * randn(d)).to(dtype) if norm else None
    kw = (1 + 0.3 * randn(d)).to(dtype) if norm else None
    pos = torch.randint(0, MAX_POS, (T,), generator=g, device=device)
    return qkv, qw, kw, pos


def assert_one_rounding(got: torch.Tensor, ref32: torch.Tensor, max_flipped: float = 0.01) -> None:
    """Within one ulp of the unrounded fp32 result everywhere, and equal to its rounding almost
    everywhere (fp32 differences inside the kernel may flip a rounding now and then: at most
    ``max_flipped`` of the elements)."""
    assert got.dtype in ULP and ref32.dtype == torch.float32 and got.shape == ref32.shape
    err = (got.float() - ref32).abs()
    bound = ULP[got.dtype] * ref32.abs() + 1e-5
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} elements off by more than 1 ulp; max err {err.max():.3g}"
    flipped = (got != ref32.to(got.dtype)).float().mean().item()
    assert flipped < max_flipped, f"{flipped:.2%} of the elements differ from the rounded reference"


HEADS = [(16, 8), (12, 2)]  # Qwen3-0.6B's q/kv heads, and another ratio (not powers of two)


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("T", [1, 7, 300, 4097])
def test_kernel_matches_reference(dtype, head_dim, heads, norm, T):
    hq, hkv = heads
    qkv, qw, kw, pos = inputs(T, hq, hkv, head_dim, dtype, norm, "cuda", seed=T)
    cache = cos_sin_cache(MAX_POS, head_dim, device="cuda")
    q, k, v = qk_norm_rope(qkv, qw, kw, EPS, pos, cache, hq, hkv, head_dim)
    rq, rk, rv = qk_norm_rope_reference(
        qkv, qw, kw, EPS, pos, cache, hq, hkv, head_dim, out_dtype=torch.float32
    )
    assert q.shape == (T, hq, head_dim) and k.shape == (T, hkv, head_dim) and v.shape == (T, hkv, head_dim)
    assert q.dtype == k.dtype == v.dtype == dtype
    assert_one_rounding(q, rq)
    assert_one_rounding(k, rk)
    assert torch.equal(v, rv)
    # without v_out, v is a view of qkv's v columns (no copy)
    assert v.data_ptr() == qkv.data_ptr() + (hq + hkv) * head_dim * qkv.element_size()


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_kernel_writes_into_given_buffers(dtype):
    T, hq, hkv, d = 517, 16, 8, 128
    qkv, qw, kw, pos = inputs(T, hq, hkv, d, dtype, True, "cuda")
    pos = pos.to(torch.int32)  # int32 positions too
    cache = cos_sin_cache(MAX_POS, d, device="cuda")
    # q_out with padding rows beyond T and a token stride wider than Hq * D (strided outs)
    q_big = torch.full((T + 5, hq, d + 64), 7.0, dtype=dtype, device="cuda")
    q_out = q_big[:T, :, :d]
    k_out, v_out = (torch.empty(T, hkv, d, dtype=dtype, device="cuda") for _ in range(2))
    qk_norm_rope(qkv, qw, kw, EPS, pos, cache, hq, hkv, d, q_out, k_out, v_out)  # compiles
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    q, k, v = qk_norm_rope(qkv, qw, kw, EPS, pos, cache, hq, hkv, d, q_out, k_out, v_out)
    assert torch.cuda.memory_allocated() == before
    assert (q.data_ptr(), k.data_ptr(), v.data_ptr()) == (
        q_out.data_ptr(),
        k_out.data_ptr(),
        v_out.data_ptr(),
    )
    rq, rk, rv = qk_norm_rope_reference(qkv, qw, kw, EPS, pos, cache, hq, hkv, d, out_dtype=torch.float32)
    assert_one_rounding(q_out, rq)
    assert_one_rounding(k_out, rk)
    assert torch.equal(v_out, rv)
    assert (q_big[T:] == 7).all() and (q_big[:, :, d:] == 7).all()  # nothing written outside q_out


@gpu
@needs_gpu
def test_kernel_replays_in_a_cuda_graph():
    T, hq, hkv, d, dtype = 300, 16, 8, 128, torch.bfloat16
    qkv, qw, kw, pos = inputs(T, hq, hkv, d, dtype, True, "cuda")
    cache = cos_sin_cache(MAX_POS, d, device="cuda")
    outs = [torch.empty(T, h, d, dtype=dtype, device="cuda") for h in (hq, hkv, hkv)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compile) outside the capture
        qk_norm_rope(qkv, qw, kw, EPS, pos, cache, hq, hkv, d, *outs)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qk_norm_rope(qkv, qw, kw, EPS, pos, cache, hq, hkv, d, *outs)
    for seed in (1, 2):
        new_qkv, _, _, new_pos = inputs(T, hq, hkv, d, dtype, True, "cuda", seed=seed)
        qkv.copy_(new_qkv)
        pos.copy_(new_pos)
        graph.replay()
        torch.cuda.synchronize()
        rq, rk, rv = qk_norm_rope_reference(qkv, qw, kw, EPS, pos, cache, hq, hkv, d, out_dtype=torch.float32)
        assert_one_rounding(outs[0], rq)
        assert_one_rounding(outs[1], rk)
        assert torch.equal(outs[2], rv)


def hf_order(qkv, qw, kw, eps, positions, hq, hkv, d, theta=1e6):
    """HF Qwen3's attention prologue in fp32, written the plain way: q_norm/k_norm of the heads,
    then ``x * cos + rotate_half(x) * sin`` with cos/sin of ``cat(freqs, freqs)``."""
    T = qkv.shape[0]
    x = qkv.float()
    q, k, v = x.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k, v = q.view(T, hq, d), k.view(T, hkv, d), v.view(T, hkv, d)

    def rms_norm(h, w):
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w.float() * h

    if qw is not None:
        q, k = rms_norm(q, qw), rms_norm(k, kw)
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]

    def rotate_half(h):
        return torch.cat((-h[..., d // 2 :], h[..., : d // 2]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


@pytest.mark.parametrize("norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_is_hf_op_order(norm, head_dim):
    """CPU, torch only: the reference (fp32 out) is HF's norm-then-RoPE in fp32; rounded once;
    v a view or a copy; and ``qk_norm_rope`` on CPU tensors is the reference."""
    T, hq, hkv, d = 33, 6, 2, head_dim
    qkv, qw, kw, pos = inputs(T, hq, hkv, d, torch.bfloat16, norm, "cpu")
    cache = cos_sin_cache(MAX_POS, d)
    q32, k32, v = qk_norm_rope_reference(qkv, qw, kw, EPS, pos, cache, hq, hkv, d, out_dtype=torch.float32)
    hq32, hk32, hv = hf_order(qkv, qw, kw, EPS, pos, hq, hkv, d)
    torch.testing.assert_close(q32, hq32, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k32, hk32, rtol=1e-5, atol=1e-5)
    assert torch.equal(v.float(), hv) and v.dtype == torch.bfloat16
    q, k, v2 = qk_norm_rope_reference(qkv, qw, kw, EPS, pos, cache, hq, hkv, d)
    assert q.dtype == k.dtype == torch.bfloat16
    assert torch.equal(q, q32.to(torch.bfloat16)) and torch.equal(k, k32.to(torch.bfloat16))
    assert v2.data_ptr() == qkv.data_ptr() + (hq + hkv) * d * qkv.element_size()
    outs = [torch.empty(T, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv)]
    got = qk_norm_rope(qkv, qw, kw, EPS, pos, cache, hq, hkv, d, *outs)
    assert [g.data_ptr() for g in got] == [o.data_ptr() for o in outs]
    assert torch.equal(outs[0], q) and torch.equal(outs[1], k) and torch.equal(outs[2], v2)
    # the norm matters (a reference that skipped it would not pass the comparison above)
    if norm:
        assert not torch.allclose(q32, hf_order(qkv, None, None, EPS, pos, hq, hkv, d)[0], atol=1e-2)


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("width", [1024, 4096, 128, 1000])
@pytest.mark.parametrize("T", [1, 7, 300, 4097])
def test_rms_norm_matches_reference_and_flashinfer(dtype, width, T):
    """One rounding of the fp32 result, into a new tensor, a given one, or in place over strided
    rows (a column slice, as a GEMM's output may be); and FlashInfer's ``rmsnorm`` (the kernel it
    replaces) to the same rounding almost everywhere."""
    g = torch.Generator(device="cuda").manual_seed(T + width)
    base = (3 * torch.randn(T, width + 64, generator=g, device="cuda")).to(dtype)
    x = base[:, 32 : 32 + width]  # strided rows
    w = (1 + 0.3 * torch.randn(width, generator=g, device="cuda")).to(dtype)
    ref32 = rms_norm_reference(x, w, EPS, out=torch.empty(T, width, device="cuda"))
    assert_one_rounding(rms_norm(x, w, EPS), ref32)
    out = torch.empty(T, width, dtype=dtype, device="cuda")
    assert rms_norm(x, w, EPS, out).data_ptr() == out.data_ptr()
    assert_one_rounding(out, ref32)
    if importlib.util.find_spec("flashinfer") is not None:
        from flashinfer.norm import rmsnorm

        theirs = rmsnorm(x.contiguous(), w, EPS)
        assert (theirs != out).float().mean().item() < 0.01
    rms_norm(x, w, EPS, x)  # in place
    assert_one_rounding(x, ref32)


@gpu
@needs_gpu
def test_rms_norm_replays_in_a_cuda_graph():
    dtype, T, width = torch.bfloat16, 300, 1024
    x = torch.randn(T, width, device="cuda").to(dtype)
    w = torch.randn(width, device="cuda").to(dtype)
    out = torch.empty_like(x)
    rms_norm(x, w, EPS, out)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rms_norm(x, w, EPS, out)
    for seed in (1, 2):
        x.copy_(
            torch.randn(T, width, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda")
        )
        graph.replay()
        torch.cuda.synchronize()
        assert_one_rounding(out, rms_norm_reference(x, w, EPS, out=torch.empty(T, width, device="cuda")))


def test_rms_norm_on_the_cpu_is_the_reference():
    x, w = torch.randn(5, 64).to(torch.bfloat16), torch.randn(64).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, w, EPS), rms_norm_reference(x, w, EPS))
    x32 = x.float()
    want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)
    assert torch.equal(rms_norm_reference(x, w, EPS), want)


GEMM_FLIPS = 0.03
"""A GEMM's fp32 sums in another order than torch's reference flip more roundings (fp16 on one row:
1.1% of 3,072 on the H200)."""


def gate_up_inputs(T, h, n, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, h, generator=g, device="cuda").to(dtype)
    w = (torch.randn(2 * n, h, generator=g, device="cuda") / h**0.5).to(dtype)
    return x, w


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1024, 3072), (256, 512)], ids=["0.6b", "small"])
@pytest.mark.parametrize("T", [1, 7, 300, 4097])
def test_gate_up_silu_matches_reference(dtype, shape, T):
    """One rounding of the fp32 ``silu(x @ gate.T) * (x @ up.T)``, into a new tensor or a given
    one (here a column slice: strided rows, as the model's buffers may be)."""
    h, n = shape
    x, w = gate_up_inputs(T, h, n, dtype, seed=T)
    if not gate_up_silu_supported(x, w):
        pytest.skip("gate_up_silu needs Hopper")
    ref32 = gate_up_silu_reference(x, w, torch.empty(T, n, device="cuda"))
    assert_one_rounding(gate_up_silu(x, w), ref32, GEMM_FLIPS)
    base = torch.empty(T, n + 64, dtype=dtype, device="cuda")
    out = base[:, 64:]
    assert gate_up_silu(x, w, out).data_ptr() == out.data_ptr()
    assert_one_rounding(out, ref32, GEMM_FLIPS)


@gpu
@needs_gpu
def test_gate_up_silu_every_benchmarked_shape():
    """Each program shape ``bench.triton_gemm`` sweeps that compiles here computes the same result
    (any of them may become the default; one Triton cannot build cannot)."""
    from bench.triton_gemm import SWIGLU_CONFIGS

    x, w = gate_up_inputs(1000, 1024, 3072, torch.bfloat16)
    if not gate_up_silu_supported(x, w):
        pytest.skip("gate_up_silu needs Hopper")
    ref32 = gate_up_silu_reference(x, w, torch.empty(1000, 3072, device="cuda"))
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    built = 0
    for config in SWIGLU_CONFIGS:
        try:
            got = gate_up_silu(x, w, config=config)
        except (CompilationError, OutOfResources):
            continue
        assert_one_rounding(got, ref32, GEMM_FLIPS)
        built += 1
    assert built >= 1
    assert {gate_up_config(1000, 1024, 3072), gate_up_config(1000, 4096, 12288)} <= set(SWIGLU_CONFIGS)


@gpu
@needs_gpu
def test_gate_up_silu_replays_in_a_cuda_graph():
    x, w = gate_up_inputs(300, 1024, 3072, torch.bfloat16)
    if not gate_up_silu_supported(x, w):
        pytest.skip("gate_up_silu needs Hopper")
    out = torch.empty(300, 3072, dtype=x.dtype, device="cuda")
    gate_up_silu(x, w, out)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gate_up_silu(x, w, out)
    for seed in (1, 2):
        x.copy_(gate_up_inputs(300, 1024, 3072, x.dtype, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        want = gate_up_silu_reference(x, w, torch.empty(300, 3072, device="cuda"))
        assert_one_rounding(out, want, GEMM_FLIPS)


def test_gate_up_silu_on_the_cpu_is_the_reference():
    x, w = torch.randn(5, 64).to(torch.bfloat16), torch.randn(256, 64).to(torch.bfloat16)
    assert torch.equal(gate_up_silu(x, w), gate_up_silu_reference(x, w))
    g, u = x.float() @ w[:128].float().t(), x.float() @ w[128:].float().t()
    want = (torch.nn.functional.silu(g) * u).to(x.dtype)
    torch.testing.assert_close(gate_up_silu_reference(x, w), want, rtol=2.0**-7, atol=1e-5)
