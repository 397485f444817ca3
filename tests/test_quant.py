"""FP8 linears on the CPU: the quantization's round trip, the quantized engine against a reference
written here from the definition (weights per output channel and activations per token rounded to
FP8, dequantized, multiplied in fp32), every scheme against naive with and without the prefix
cache, and the pre-quantized checkpoint formats (compressed-tensors FP8_DYNAMIC, fine-grained
block FP8) against the reference built from their dequantized weights."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_prefix_cache import request

from scorer import cli
from scorer.attention import HeadSpec, TorchBackend
from scorer.engine import Engine, EngineConfig
from scorer.models import fp8_kernels, triton_ops
from scorer.models.fp8_checkpoint import UnsupportedQuantization, checkpoint_format
from scorer.models.fp8_kernels import FP8, FP8_MAX, quantize_rows
from scorer.models.loader import load_model
from scorer.models.quant import ATTENTION_LINEARS, MLP_LINEARS, Fp8Linear, dequantize, quantize_model
from scorer.models.tiny import ensure_tiny_model
from scorer.planning import REGISTRY
from scorer.prefix_cache import PrefixCache
from scorer.request import ScoreRequest
from scorer.runner import ModelRunner
from scorer.settings import Settings, scorer_args_model

VOCAB = 256
CONFIG = EngineConfig(max_docs=64, max_doc_tokens=512)
SCHEME_TOL = 1e-3
"""Every scheme against naive on the FP8 model. The activations are quantized per token, so a
batch's other rows never change a row's scales, but the fp32 rounding of another attention order
can move a value across an FP8 rounding boundary, which then moves the score by more than fp32's
1e-4: measured 1.6e-4 in one call of the prefix-cache test, under 1e-5 in the others."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


def engine_of(model, tokenizer, cache: PrefixCache | None = None) -> Engine:
    c = model.config
    backend = TorchBackend(
        HeadSpec(c.num_heads, c.num_kv_heads, c.head_dim, torch.float32, torch.device("cpu"))
    )
    return Engine(ModelRunner(model, backend), tokenizer, CONFIG, cache=cache)


def loaded(path: Path, quantization: str) -> Engine:
    return engine_of(*load_model(path, "cpu", torch.float32, "torch", quantization))


def fake_quantized(path: Path, round_weights: bool = True, only: set[str] | None = None) -> Engine:
    """The reference: the checkpoint's model (FP8 weights dequantized) with every decoder linear's
    (or ``only`` those named, ``model.layers.0.mlp.down_proj``) input rounded to FP8 per token and
    (``round_weights``) its weight rounded to FP8 per output channel, both dequantized; the linears
    then multiply in fp32. Hooks on the plain model, no ``Fp8Linear``. A per-channel FP8
    checkpoint's dequantized weights are the reference's as they are (``round_weights=False``)."""
    model, tokenizer = load_model(path, "cpu", torch.float32, "torch", "none")

    def round_input(_module, args):
        (x,) = args
        return (dequantize(*quantize_rows(x.reshape(-1, x.shape[-1]))).view_as(x).to(x.dtype),)

    for i, layer in enumerate(model.model.layers):
        for owner, part, names in (
            (layer.self_attn, "self_attn", ATTENTION_LINEARS),
            (layer.mlp, "mlp", MLP_LINEARS),
        ):
            for name in names:
                linear = getattr(owner, name)
                if only is not None and f"model.layers.{i}.{part}.{name}" not in only:
                    continue
                if round_weights:
                    linear.weight.data = dequantize(*quantize_rows(linear.weight))
                linear.register_forward_pre_hook(round_input)
    return engine_of(model, tokenizer)


def random_request(seed: int, scheme: str = "auto", **options) -> ScoreRequest:
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 120))]
    docs = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(rng.randint(1, 12))]
    return request(prompt, docs, scheme, **options)


def logprobs(result) -> torch.Tensor:
    return torch.tensor([d.label_logprobs for d in sorted(result.results, key=lambda d: d.index)])


def test_quantize_rows_round_trips_within_half_an_fp8_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-6, 4, 64).unsqueeze(1)
    x[3] = 0.0  # a padding row
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (64, 1) and scale.dtype == torch.float32
    back = dequantize(q, scale)
    assert torch.isfinite(back).all() and (back[3] == 0).all()
    # e4m3: 3 mantissa bits, so half a step is 2^-4 of a normal value; below 2^-6 (subnormals)
    # the step is 2^-9 of the scale
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10)
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    rows = torch.arange(64) != 3
    assert (q.float().abs().amax(1)[rows] == FP8_MAX).all()  # each row's largest maps to 448 exactly


def test_fp8_linear_is_the_product_of_the_dequantized_operands():
    g = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(96, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 96, generator=g) * 0.05)
        linear.bias.copy_(torch.randn(48, generator=g))
    x = torch.randn(5, 7, 96, generator=g)
    fp8 = Fp8Linear.quantize(linear)
    got = fp8(x)
    qx, sx = quantize_rows(x.reshape(-1, 96))
    qw, sw = quantize_rows(linear.weight.detach())
    assert torch.equal(fp8.weight, qw) and torch.equal(fp8.weight_scale, sw.reshape(1, -1))
    want = (qx.float() * sx) @ (qw.float() * sw).t() + linear.bias
    torch.testing.assert_close(got, want.view(5, 7, 48), atol=1e-5, rtol=1e-5)
    exact = linear(x)
    assert ((got - exact).norm() / exact.norm()).item() < 0.05  # measured 0.014


def test_quantized_engine_scores_equal_the_reference(tiny):
    fp8, ref = loaded(tiny, "fp8"), fake_quantized(tiny)
    for seed in range(6):
        req = random_request(seed)
        torch.testing.assert_close(logprobs(fp8.score(req)), logprobs(ref.score(req)), atol=1e-5, rtol=0)
    layer = fp8.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    assert fp8.runner.model.lm_head.weight.dtype == torch.float32  # the LM head stays


def test_q_k_v_and_gate_up_quantize_their_input_once(tiny, monkeypatch):
    """Four quantizations of activations a layer (q/k/v, o, gate/up, down), not seven; a linear
    called again on the same tensor quantizes it again."""
    from scorer.models import quant

    model, _ = load_model(tiny, "cpu", torch.float32, "torch", "fp8")
    seen = []
    monkeypatch.setattr(quant, "quantize_rows", lambda x: seen.append(x.shape) or quantize_rows(x))
    ids = torch.arange(20)
    with torch.no_grad():
        hidden = model.forward_hidden(ids, ids, lambda i, q, k, v: q)  # attention: any [T, Hq, D]
    assert len(seen) == 4 * model.num_layers and hidden.shape == (20, 64)
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, 64)
    seen.clear()
    attn.q_proj(x), attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert len(seen) == 2  # the second q_proj call: fresh; k and v: that one's


def test_merged_fp8_linears_are_their_parts_side_by_side():
    g = torch.Generator().manual_seed(2)
    parts = []
    for n, bias in ((48, True), (16, False), (32, True)):
        linear = torch.nn.Linear(64, n, bias=bias)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, 64, generator=g) * 0.1)
        parts.append(Fp8Linear.quantize(linear))
    x = torch.randn(9, 64, generator=g)
    separate = torch.cat([p(x) for p in parts], dim=1)
    merged = Fp8Linear.merge(*parts)
    assert merged.out_features == 96 and merged.bias[48:64].eq(0).all()  # the bias-less part's zeros
    torch.testing.assert_close(merged(x), separate, atol=1e-6, rtol=0)
    # the parts read the merged storage: one copy of the weights, still under their own names
    assert parts[1].weight.untyped_storage().data_ptr() == merged.weight.untyped_storage().data_ptr()
    torch.testing.assert_close(torch.cat([p(x) for p in parts], dim=1), separate, atol=0, rtol=0)


def test_the_fused_path_scores_as_the_linears_one_by_one(tiny):
    """``quantize_model``'s fused path (merged QKV and gate/up in FP8, inputs quantized by the norm
    and SiLU-and-mul kernels, here their torch statements) gives the per-linear path's scores: the
    same FP8 values reach the same GEMMs (measured: within 1e-6 in fp32)."""
    model, tokenizer = load_model(tiny, "cpu", torch.float32, "fused", "none")
    quantize_model(model, fused=True)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and isinstance(layer.mlp.gate_up, Fp8Linear)
    assert layer.input_layernorm.quantize and layer.post_attention_layernorm.quantize
    assert not model.model.norm.quantize  # the LM head's input stays in the model's dtype
    fused, one_by_one = engine_of(model, tokenizer), loaded(tiny, "fp8")
    for seed in range(6):
        req = random_request(seed)
        torch.testing.assert_close(
            logprobs(fused.score(req)), logprobs(one_by_one.score(req)), atol=1e-5, rtol=0
        )


def test_the_residual_add_in_the_next_norm_changes_no_bit(tiny):
    """On the fused path each layer's MLP output is added to the residual stream by the next
    layer's input norm (``DecoderLM.residual_in_norm``): the same bf16 sum, so the same hidden
    states to the bit as with the add on its own, eagerly and over the graph runner's segments."""
    from scorer.models.graphs import GraphedDecoder

    model, _ = load_model(tiny, "cpu", torch.bfloat16, "fused", "none")
    quantize_model(model, fused=True)
    assert model.residual_in_norm and all(x.defers_residual for x in model.model.layers)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (37,), generator=gen)
    pos = torch.arange(37)

    def attn(_i, q, k, v, out=None):  # a stand-in mixing heads and rows: not the identity
        o = (q + k.repeat_interleave(q.shape[1] // k.shape[1], 1)).roll(1, 0) * 0.5
        return o if out is None else out.copy_(o)

    def hidden(defer: bool, graphed: bool) -> torch.Tensor:
        model.residual_in_norm = defer
        if graphed:
            graphs = GraphedDecoder(model, 64, capture=False)
            graphs.warm_up()
            return graphs.forward_hidden(ids, pos, attn).clone()
        return model.forward_hidden(ids, pos, attn)

    with torch.inference_mode():
        base = hidden(False, False)
        for defer, graphed in ((True, False), (True, True), (False, True)):
            torch.testing.assert_close(hidden(defer, graphed), base, atol=0, rtol=0)


def test_the_kernels_torch_statements():
    """What the Triton kernels compute, on the CPU: the residual updated in place before the norm,
    SiLU-and-mul in fp32 rounded once, then ``quantize_rows`` of the result."""
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(5, 32, generator=g).bfloat16(), torch.randn(5, 32, generator=g).bfloat16()
    w = torch.rand(32, generator=g).bfloat16()
    want_res = (x.float() + res.float()).bfloat16()
    got = fp8_kernels.rms_norm_quant(x, w, 1e-6, residual=res)
    assert torch.equal(res, want_res)
    want = quantize_rows(triton_ops.rms_norm_reference(want_res, w, 1e-6))
    assert torch.equal(got.q.float(), want[0].float()) and torch.equal(got.scale, want[1])
    gu = torch.randn(5, 64, generator=g).bfloat16()
    act = (torch.nn.functional.silu(gu[:, :32].float()) * gu[:, 32:].float()).bfloat16()
    got = fp8_kernels.silu_mul_quant(gu)
    assert torch.equal(got.q.float(), quantize_rows(act)[0].float())


def test_a_score_head_model_quantizes_its_decoder(tmp_path):
    """A ``*ForSequenceClassification`` checkpoint (no LM head) in FP8: the decoder's linears
    quantized, the score head kept, the scores those of the reference."""
    from test_families import CASES, OTHER, write_checkpoint

    path = write_checkpoint(CASES["qwen2-score1"], tmp_path / "qwen2-score1")
    fp8, ref = loaded(path, "fp8"), fake_quantized(path)
    assert isinstance(fp8.runner.model.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert fp8.runner.model.score.weight.dtype == torch.float32
    torch.testing.assert_close(logprobs(fp8.score(OTHER)), logprobs(ref.score(OTHER)), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def fp8_engine(tiny) -> Engine:
    return loaded(tiny, "fp8")


@pytest.mark.parametrize("scheme", [*REGISTRY, "auto"])
def test_every_scheme_scores_as_naive_on_the_quantized_model(fp8_engine, scheme):
    for seed in range(4):
        naive = fp8_engine.score(random_request(seed, "naive"))
        got = fp8_engine.score(random_request(seed, scheme, group_size=3))
        torch.testing.assert_close(logprobs(got), logprobs(naive), atol=SCHEME_TOL, rtol=0)


@pytest.mark.parametrize("scheme", [*REGISTRY, "auto"])
def test_the_prefix_cache_keeps_the_quantized_scores(fp8_engine, scheme):
    mc = fp8_engine.runner.model.config
    cache = PrefixCache(4000, mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.float32, "cpu", admit=1)
    on = Engine(fp8_engine.runner, fp8_engine.tokenizer, CONFIG, cache=cache)
    rng = random.Random(7)
    prompt = [rng.randrange(VOCAB) for _ in range(80)]
    for i in range(3):  # the first call writes the prompt's blocks, the others read them
        docs = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(5)]
        got = on.score(request(prompt, docs, scheme, group_size=2))
        assert (got.usage.cached_prompt_tokens > 0) == (i > 0)
        naive = fp8_engine.score(request(prompt, docs, "naive"))
        torch.testing.assert_close(logprobs(got), logprobs(naive), atol=SCHEME_TOL, rtol=0)


def test_quantized_scores_stay_near_the_unquantized_model(tiny, fp8_engine):
    """A loose bound: on the tiny random model FP8 moved these calls' label log-probs by at most
    0.12 (measured), where the first label's log-prob spreads by up to 1.6 across a call's docs."""
    plain = loaded(tiny, "none")
    diffs = [
        (logprobs(fp8_engine.score(random_request(s))) - logprobs(plain.score(random_request(s)))).abs().max()
        for s in range(6)
    ]
    assert max(diffs).item() < 0.25


def test_the_fused_kernels_run_the_linears_one_by_one(tiny):
    """Quantizing a model built for the fused kernels undoes what reads the bf16 weights."""
    try:
        model, _ = load_model(tiny, "cpu", torch.float32, "fused", "fp8")
    except (ImportError, RuntimeError) as e:  # the fused RoPE cache needs FlashInfer's build
        pytest.skip(f"fused kernels not buildable here: {e}")
    assert not (model.qkv_in_place or model.swiglu_gemm or model.residual_in_gemm)
    for layer in model.model.layers:
        assert layer.self_attn.qkv_proj is None and layer.mlp.gate_up is None


# pre-quantized checkpoints


def _linears(state: dict) -> list[str]:
    return [k.removesuffix(".weight") for k in state if k.endswith(("_proj.weight",)) and ".layers." in k]


def _write(src: Path, dst: Path, state: dict, quantization_config: dict) -> Path:
    shutil.copytree(src, dst)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return dst


FP8_DYNAMIC = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
            },
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
            "output_activations": None,
        }
    },
}


def compressed_tensors_checkpoint(tiny: Path, dst: Path) -> Path:
    """The tiny model as llm-compressor's FP8_DYNAMIC writes it: ``weight`` e4m3, ``weight_scale``
    [N, 1] in the model's dtype; scales off the absmax (so the round trip is not exact)."""
    state = load_file(str(tiny / "model.safetensors"))
    for name in _linears(state):
        w = state.pop(f"{name}.weight")
        scale = w.abs().amax(1, keepdim=True) / FP8_MAX * 1.25
        state[f"{name}.weight"] = (w / scale).to(FP8)
        state[f"{name}.weight_scale"] = scale
    return _write(tiny, dst, state, FP8_DYNAMIC)


def block_checkpoint(tiny: Path, dst: Path, block=(24, 40)) -> Path:
    """The tiny model in Qwen's fine-grained format: ``weight`` e4m3 and ``weight_scale_inv`` per
    ``block`` (partial blocks at the edges: 64 = 24 + 24 + 16 rows)."""
    state = load_file(str(tiny / "model.safetensors"))
    bn, bk = block
    for name in _linears(state):
        w = state.pop(f"{name}.weight")
        n, k = w.shape
        rows, cols = -(-n // bn), -(-k // bk)
        scale = torch.zeros(rows, cols)
        for i in range(rows):
            for j in range(cols):
                scale[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max() / FP8_MAX
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        state[f"{name}.weight"] = (w / full).to(FP8)
        state[f"{name}.weight_scale_inv"] = scale
    qc = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block),
    }
    return _write(tiny, dst, state, qc)


def test_compressed_tensors_fp8_dynamic_loads_its_fp8_weights_as_they_are(tiny, tmp_path):
    path = compressed_tensors_checkpoint(tiny, tmp_path / "ct")
    stored = load_file(str(path / "model.safetensors"))
    model, _ = load_model(path, "cpu", torch.float32, "torch", "fp8")
    q = model.model.layers[1].mlp.down_proj
    assert torch.equal(q.weight, stored["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(q.weight_scale, stored["model.layers.1.mlp.down_proj.weight_scale"].reshape(1, -1))
    plain, _ = load_model(path, "cpu", torch.float32, "torch", "none")  # dequantized
    deq = (
        stored["model.layers.1.mlp.down_proj.weight"].float()
        * stored["model.layers.1.mlp.down_proj.weight_scale"]
    )
    assert torch.equal(plain.model.layers[1].mlp.down_proj.weight, deq)
    fp8, ref = engine_of(model, _), fake_quantized(path, round_weights=False)
    for seed in range(4):
        req = random_request(seed)
        torch.testing.assert_close(logprobs(fp8.score(req)), logprobs(ref.score(req)), atol=1e-5, rtol=0)


def test_block_fp8_is_dequantized_and_quantized_again_per_channel(tiny, tmp_path):
    path = block_checkpoint(tiny, tmp_path / "blocks")
    assert checkpoint_format(path).block == (24, 40)
    fp8, ref = loaded(path, "fp8"), fake_quantized(path)
    for seed in range(4):
        req = random_request(seed)
        torch.testing.assert_close(logprobs(fp8.score(req)), logprobs(ref.score(req)), atol=1e-5, rtol=0)
    # the blocks dequantized are the tiny model's weights within FP8's rounding
    plain, _ = load_model(path, "cpu", torch.float32, "torch", "none")
    original = load_file(str(tiny / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    got = plain.model.layers[0].self_attn.q_proj.weight
    assert ((got - original).abs() <= original.abs() * 2**-4 + 1e-6).all()


UNQUANTIZED = ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.k_proj")
"""Linears a checkpoint leaves in its dtype: a unit of its own, and one of q/k/v (its q and v,
stored FP8, then run dequantized with it)."""


def fp8_names(model) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def ignoring_checkpoint(src: Path, dst: Path, ignore=UNQUANTIZED) -> Path:
    """``src`` as llm-compressor's FP8_DYNAMIC writes it with the linears ``ignore`` names on its
    ignore list: those stored as they were."""
    state = load_file(str(src / "model.safetensors"))
    stored = load_file(
        str(compressed_tensors_checkpoint(src, dst.with_name(dst.name + "-all")) / "model.safetensors")
    )
    for name in ignore:
        del stored[f"{name}.weight_scale"]
        stored[f"{name}.weight"] = state[f"{name}.weight"]
    return _write(src, dst, stored, {**FP8_DYNAMIC, "ignore": ["lm_head", *ignore]})


def test_the_linears_a_checkpoint_left_unquantized_stay_in_its_dtype(tiny, tmp_path):
    state = load_file(str(tiny / "model.safetensors"))
    path = ignoring_checkpoint(tiny, tmp_path / "ignored")
    model, tokenizer = load_model(path, "cpu", torch.float32, "torch", "fp8")
    every = set(_linears(state))
    dense = {"model.layers.0.mlp.down_proj", *(f"model.layers.1.self_attn.{p}_proj" for p in "qkv")}
    assert fp8_names(model) == every - dense
    down = model.model.layers[0].mlp.down_proj
    assert torch.equal(down.weight, state["model.layers.0.mlp.down_proj.weight"])
    ref = fake_quantized(path, round_weights=False, only=every - dense)
    fp8 = engine_of(model, tokenizer)
    for seed in range(4):
        req = random_request(seed)
        torch.testing.assert_close(logprobs(fp8.score(req)), logprobs(ref.score(req)), atol=1e-5, rtol=0)


def test_the_fused_path_runs_a_unit_left_unquantized_in_the_models_dtype(tiny, monkeypatch):
    """The fused path's norms and gate/up write FP8 only for an FP8 reader: a layer whose q/k/v
    stay in fp32 gets its input norm in fp32, one whose down projection does gets SiLU-and-mul's
    output in fp32; the scores are the per-linear reference's (FlashInfer's kernels swapped for
    their torch semantics)."""
    from fused_reference import TorchFused

    from scorer.models import fused as fused_kernels

    for name in ("rms_norm", "add_rms_norm_", "silu_and_mul", "rope_"):
        monkeypatch.setattr(fused_kernels, name, getattr(TorchFused, name))
    model, tokenizer = load_model(tiny, "cpu", torch.float32, "fused", "none")
    weights = {
        n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n
    }
    dense = {"model.layers.0.mlp.down_proj", *(f"model.layers.1.self_attn.{p}_proj" for p in "qkv")}
    given = {}  # FP8 weights and per-channel scales, as a pre-quantized checkpoint's loader gives them
    for n, w in weights.items():
        if n not in dense:
            q, scale = quantize_rows(w)
            given[n] = (q, scale.reshape(-1))
    with pytest.raises(ValueError, match="layers.1.self_attn.q_proj"):  # q without k and v
        quantize_model(
            model, {**given, "model.layers.1.self_attn.q_proj": given["model.layers.0.self_attn.q_proj"]}
        )
    quantize_model(model, given, fused=True)
    first, second = model.model.layers
    assert isinstance(first.mlp.gate_up, Fp8Linear) and not first.mlp.quantize
    assert first.input_layernorm.quantize and first.post_attention_layernorm.quantize
    assert isinstance(second.self_attn.qkv_proj, tuple) and not second.input_layernorm.quantize
    assert second.mlp.quantize and isinstance(second.self_attn.o_proj, Fp8Linear)
    assert fp8_names(model) >= set(given)
    fused, ref = engine_of(model, tokenizer), fake_quantized(tiny, only=set(given))
    for seed in range(6):
        req = random_request(seed)
        torch.testing.assert_close(logprobs(fused.score(req)), logprobs(ref.score(req)), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("quantization_config", "named"),
    [
        ({"quant_method": "awq", "bits": 4}, "'awq'"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
        (
            {
                **FP8_DYNAMIC,
                "config_groups": {
                    "group_0": {
                        **FP8_DYNAMIC["config_groups"]["group_0"],
                        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
                    }
                },
            },
            "weights type='int'",
        ),
    ],
)
def test_a_quantization_the_engine_cannot_run_is_refused_in_one_line(
    tiny, tmp_path, capsys, quantization_config, named
):
    path = _write(tiny, tmp_path / "q", load_file(str(tiny / "model.safetensors")), quantization_config)
    with pytest.raises(UnsupportedQuantization, match=named):
        load_model(path, "cpu")
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "a doc"}\n')
    assert (
        cli.main(["score", "--prompt", "q", "--docs", str(docs), "--model", str(path), "--device", "cpu"])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and named in err and "--model" in err


def test_the_setting_names_its_field_and_reaches_ray():
    with pytest.raises(ValueError, match=r"--quantization \(quantization\): 'int4' is not one of none, fp8"):
        Settings(quantization="int4")
    assert scorer_args_model()(quantization="fp8").quantization == "fp8"


def test_cli_scores_with_fp8(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SCORER_CACHE_DIR", str(tiny.parent))
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "alpha beta"}\n{"text": "gamma"}\n')
    argv = [
        "score",
        "--prompt",
        "greek letters",
        "--docs",
        str(docs),
        "--device",
        "cpu",
        "--attention-backend",
        "torch",
    ]
    assert cli.main([*argv, "--quantization", "fp8"]) == 0
    fp8 = [json.loads(line)["score"] for line in capsys.readouterr().out.splitlines()]
    assert cli.main(argv) == 0
    plain = [json.loads(line)["score"] for line in capsys.readouterr().out.splitlines()]
    assert len(fp8) == 2 and fp8 != plain and fp8 == pytest.approx(plain, abs=0.05)


def test_the_benchmark_runs_on_the_cpu(tmp_path):
    """bench.fp8 --cpu-smoke: both systems' docs/s and their ranking against fp32, in the JSON and
    the table."""
    from bench import fp8

    result = fp8.main(["--cpu-smoke", "--out", str(tmp_path)])
    (rec,) = result["models"]
    assert json.loads((tmp_path / "fp8.json").read_text())["models"][0]["systems"].keys() == {"bf16", "fp8"}
    assert "fp32_reference" not in rec
    for system in fp8.SYSTEMS:
        out = rec["systems"][system]
        assert out["throughput"]["A"]["docs_s"] > 0
        for w in fp8.RANKED:
            m = out["ranking"][w]
            assert m["calls"] == 2 and 0 <= m["logprob_err_mean"] <= m["logprob_err_p99"] < 1
            assert -1 <= m["spearman_min"] <= m["spearman_mean"] <= 1 and 0 <= m["top3_mean"] <= 1
    bf16, q = (rec["systems"][s]["ranking"]["A"]["logprob_err_mean"] for s in fp8.SYSTEMS)
    assert q > bf16 > 0  # FP8 rounds more than bf16, and both round
    assert "| smoke | A | fp8 |" in (tmp_path / "fp8.md").read_text()


def test_spearman_and_top3_agreement():
    from bench.fp8 import spearman, top_k_agreement

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert top_k_agreement([5, 4, 3, 2, 1], [5, 4, 0, 9, 1]) == pytest.approx(2 / 3)


def test_the_throughput_benchmark_has_an_fp8_system(tmp_path, monkeypatch):
    from bench import throughput

    ran = []
    forward = Fp8Linear.forward
    monkeypatch.setattr(Fp8Linear, "forward", lambda self, x: ran.append(1) or forward(self, x))
    throughput.main(
        ["--device", "cpu", "--models", "smoke", "--workloads", "A", "--calls", "2", "--seconds", "0.05",
         "--systems", "auto@fp8", "--out", str(tmp_path)]
    )  # fmt: skip
    (rec,) = json.loads((tmp_path / "throughput.json").read_text())["records"]
    assert rec["system"] == "auto@fp8" and rec["docs_s"] > 0, rec
    assert ran  # the linears ran in FP8


def test_a_prequantized_checkpoint_loads_for_the_fused_kernels(tiny, tmp_path):
    """The fused kernels merge q/k/v and gate/up at ``finalize``, before the FP8 linears replace
    them: the placeholders of the FP8 weights leave nothing on the meta device."""
    path = compressed_tensors_checkpoint(tiny, tmp_path / "ct")
    try:
        model, _ = load_model(path, "cpu", torch.float32, "fused", "fp8")
    except (ImportError, RuntimeError) as e:  # the fused RoPE cache needs FlashInfer's build
        pytest.skip(f"fused kernels not buildable here: {e}")
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert isinstance(model.model.layers[1].self_attn.v_proj, Fp8Linear)
