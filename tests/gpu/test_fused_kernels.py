"""FlashInfer's fused norm, RoPE and SiLU-and-mul kernels against their torch semantics
(``fused_reference.TorchFused``, which the CPU tests wire into the model), and the fused model
against HF's op order on the GPU. Skipped without CUDA and flashinfer."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from fused_reference import TorchFused  # noqa: E402

from scorer.config import ModelConfig  # noqa: E402
from scorer.models import fused, triton_ops  # noqa: E402
from scorer.models.decoder import DecoderLM  # noqa: E402
from scorer.models.rope import Rope, RotaryEmbedding  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Within a couple of half-precision roundings (the kernels round once, in fp32 inside)."""
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def randn(*shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_and_heads(dtype):
    w = 1 + 0.1 * randn(128, dtype=dtype, seed=1)
    for shape in [(300, 128), (70, 16, 128)]:
        x = 3 * randn(*shape, dtype=dtype)
        out = torch.empty_like(x)
        got = fused.rms_norm(x, w, 1e-6, out=out)
        assert got.data_ptr() == out.data_ptr() and got.shape == x.shape
        close(got, TorchFused.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_in_place(dtype):
    x, r, w = (
        randn(200, 1024, dtype=dtype),
        randn(200, 1024, dtype=dtype, seed=2),
        randn(1024, dtype=dtype, seed=3),
    )
    x2, r2 = x.clone(), r.clone()
    fused.add_rms_norm_(x, r, w, 1e-6)
    TorchFused.add_rms_norm_(x2, r2, w, 1e-6)
    close(r, r2)
    close(x, x2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = randn(100, 2 * 3072, dtype=dtype)
    close(fused.silu_and_mul(x), TorchFused.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_hf_tables(dtype, checkpoint):
    """The fused RoPE from the cos|sin cache equals HF's rotate_half with bf16 tables (the torch
    path of the model), for Qwen3's default RoPE and Llama 3's scaled one."""
    hf = json.loads((checkpoint / "config.json").read_text())
    for rope_parameters in (
        {"rope_type": "default", "rope_theta": 1e6},
        {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "original_max_position_embeddings": 512,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ):
        config = ModelConfig.from_hf({**hf, "rope_parameters": rope_parameters, "rope_theta": 1e6})
        rotary = RotaryEmbedding(config)
        positions = torch.randint(0, config.max_position_embeddings, (257,), device="cuda")
        q, k = randn(257, 4, 128, dtype=dtype), randn(257, 2, 128, dtype=dtype, seed=4)
        want = Rope(*rotary.tables(positions, dtype)).apply(q, k)
        rotary.use_fused(torch.device("cuda"))
        q2, k2 = q.clone(), k.clone()
        got = rotary(positions, dtype).apply(q2, k2)
        assert got[0].data_ptr() == q2.data_ptr()
        close(got[0], want[0])
        close(got[1], want[1])


@pytest.mark.parametrize(
    "kernels", ["flashinfer", "fused", "fused/noaddmm", "fused/finorm", "fused/noswiglu"]
)
@torch.inference_mode()
def test_fused_model_matches_hf_op_order(checkpoint, kernels, monkeypatch):
    """ "fused/noaddmm": the residual adds outside the output and down GEMMs (``residual_in_gemm``
    off); "fused/finorm": FlashInfer's hidden-state norms instead of Triton's (``triton_norm``);
    "fused/noswiglu": gate/up on cuBLAS and FlashInfer's SiLU-and-mul, not Triton's one GEMM."""
    kernels, _, variant = kernels.partition("/")
    config = ModelConfig.from_hf(checkpoint)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = DecoderLM(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    model = model.to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (64,), device="cuda")
    pos = torch.arange(64, device="cuda")

    def attn(layer, q, k, v, out=None):
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        ).transpose(0, 1)
        return o if out is None else out.copy_(o)

    want = model.score_logits(model.forward_hidden(ids, pos, attn))
    monkeypatch.setattr(triton_ops, "SWIGLU_MIN_ROWS", 0)  # the 64 rows here run it too
    swiglu_calls = []
    real = triton_ops.gate_up_silu
    monkeypatch.setattr(triton_ops, "gate_up_silu", lambda *a, **k: swiglu_calls.append(1) or real(*a, **k))
    with torch.device("cuda"):
        fused_model = DecoderLM(config, kernels=kernels).to(torch.bfloat16)
    fused_model.load_state_dict(model.state_dict())
    fused_model.eval().finalize()
    fused_model.residual_in_gemm = variant != "noaddmm"
    assert fused_model.triton_norm == (kernels == "fused")
    fused_model.triton_norm = fused_model.triton_norm and variant != "finorm"
    assert fused_model.swiglu_gemm == (kernels == "fused")
    fused_model.swiglu_gemm = fused_model.swiglu_gemm and variant != "noswiglu"
    got = fused_model.score_logits(fused_model.forward_hidden(ids, pos, attn))
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert bool(swiglu_calls) == (kernels == "fused" and variant != "noswiglu" and hopper)
    want_lp, got_lp = want.log_softmax(-1), got.log_softmax(-1)
    assert (got_lp - want_lp).abs().max() < 0.05
