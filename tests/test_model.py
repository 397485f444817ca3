"""DecoderLM against transformers' own implementations, and the embedded tiny model."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from fused_reference import TorchFused
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from scorer.attention import HeadSpec, TorchBackend
from scorer.config import CheckpointError, ModelConfig
from scorer.models import DecoderLM, tiny
from scorer.models.loader import load_model
from scorer.planning import REGISTRY, Shape

SEQ_LEN = 20
VOCAB = 300  # random ids below this; the test checkpoints carry the embedded tokenizer for load_model


def causal_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with a causal mask and GQA, in the op order of HF's eager attention."""
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    q, k, v = (
        q.transpose(0, 1),
        k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1),
    )
    scores = torch.matmul(q, k.transpose(1, 2)) * D**-0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(0, 1)


def reference_backend(model: DecoderLM, n: int) -> TorchBackend:
    """The engine's torch reference backend planned for one causal sequence of ``n`` tokens."""
    c = model.config
    backend = TorchBackend(
        HeadSpec(c.num_heads, c.num_kv_heads, c.head_dim, torch.float32, torch.device("cpu"))
    )
    backend.plan(REGISTRY["naive"].plan([Shape(n // 2, (n - n // 2,))]).passes[0])
    return backend


def ours_logits(
    model: DecoderLM, input_ids: torch.Tensor, positions: torch.Tensor, attn=causal_attention
) -> torch.Tensor:
    device = model.lm_head.weight.device
    with torch.no_grad():
        hidden = model.forward_hidden(input_ids.to(device), positions.to(device), attn)
        return model.score_logits(hidden).cpu()


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Replace HF's init (norm weights all ones, zero biases) so every parameter matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.05
            param.copy_(1.0 + noise if "norm" in name else noise)


def save_hf_checkpoint(config, path: Path, seed: int = 0) -> Path:
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize_(model, seed)
    model.save_pretrained(path)
    tiny.write_tokenizer(path)
    return path


def hf_logits(
    model_dir: Path, input_ids: torch.Tensor, positions: torch.Tensor, dtype=None, device: str = "cpu"
) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=dtype).to(
        device
    )
    with torch.no_grad():
        logits = model(input_ids[None].to(device), position_ids=positions[None].to(device)).logits
    return logits[0].float().cpu()


SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4
)
CASES = {
    "qwen3-tied": Qwen3Config(
        **SMALL,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
    ),
    "qwen3-untied": Qwen3Config(
        **SMALL,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    ),
    "llama3-rope": LlamaConfig(
        **SMALL,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        architectures=["LlamaForCausalLM"],
    ),
    "qwen2-qkv-bias": Qwen2Config(**SMALL, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"]),
    "llama-attention-bias": LlamaConfig(
        **SMALL, num_key_value_heads=4, attention_bias=True, mlp_bias=True, architectures=["LlamaForCausalLM"]
    ),
}


@pytest.mark.parametrize("start", [0, 200], ids=["pos0", "pos200"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(case: str, start: int, tmp_path: Path) -> None:
    model_dir = save_hf_checkpoint(CASES[case], tmp_path)
    input_ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(start, start + SEQ_LEN)
    expected = hf_logits(model_dir, input_ids, positions)
    model = load_model(model_dir, dtype=torch.float32)[0]
    actual = ours_logits(model, input_ids, positions)
    assert actual.dtype == torch.float32 and actual.shape == (SEQ_LEN, VOCAB)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    through_backend = ours_logits(model, input_ids, positions, reference_backend(model, SEQ_LEN).run)
    torch.testing.assert_close(through_backend, expected, atol=1e-4, rtol=0)


def test_config_fields(tmp_path: Path) -> None:
    llama = ModelConfig.from_hf(save_hf_checkpoint(CASES["llama3-rope"], tmp_path))
    assert (llama.architecture, llama.qk_norm, llama.rope_type, llama.rope_theta) == (
        "LlamaForCausalLM",
        False,
        "llama3",
        500000.0,
    )
    assert llama.head_dim == 16 and llama.num_kv_heads == 2 and not llama.tie_word_embeddings
    legacy = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            **SMALL,
            "rope_theta": 1234.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        }
    )
    assert (legacy.rope_type, legacy.rope_theta, legacy.hf_config.rope_parameters["factor"]) == (
        "linear",
        1234.0,
        2.0,
    )
    assert ModelConfig.from_hf(CASES["qwen3-tied"]) == ModelConfig.from_hf(CASES["qwen3-tied"].to_dict())
    # a sliding window bounds the positions a prompt + doc may span (within it attention is full)
    windowed = ModelConfig.from_hf(
        Qwen3Config(
            **SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=64, max_window_layers=1
        )
    )
    assert (windowed.sliding_window, windowed.max_positions) == (64, 64)
    unused = ModelConfig.from_hf(Qwen3Config(**SMALL, num_key_value_heads=2, sliding_window=64))
    assert (unused.sliding_window, unused.max_positions) == (0, unused.max_position_embeddings)


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path)
    AutoConfig.for_model("qwen3", **SMALL, num_key_value_heads=2).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(tmp_path)
    save_file({"model.embed_tokens.weight": torch.zeros(VOCAB, 64)}, str(tmp_path / "model.safetensors"))
    tiny.write_tokenizer(tmp_path)
    with pytest.raises(CheckpointError, match="missing"):
        load_model(tmp_path)


@pytest.mark.skipif(not os.environ.get("SCORER_TEST_MODEL_DIR"), reason="SCORER_TEST_MODEL_DIR not set")
def test_matches_transformers_on_real_checkpoint() -> None:
    model_dir = Path(os.environ["SCORER_TEST_MODEL_DIR"])
    dtype = ModelConfig.from_hf(model_dir).dtype or torch.bfloat16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model(model_dir, device=device, dtype=dtype)
    text = "Judge whether the document answers the query. Query: what is rope scaling? Document: RoPE rotates"
    input_ids = torch.tensor(tokenizer(text)["input_ids"])
    positions = torch.arange(len(input_ids))
    actual = ours_logits(model, input_ids, positions)[-1]
    del model
    expected = hf_logits(model_dir, input_ids, positions, dtype=dtype, device=device)[-1]
    scale = expected.abs().max().item()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual, expected, atol=tolerance * scale, rtol=0)
    assert actual.argmax() == expected.argmax()


def test_tiny_model_is_written_once_and_reloads_identically(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SCORER_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tiny.ensure_tiny_model()
    assert model_dir == tmp_path / "cache" / tiny.NAME
    stamps = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}

    def fail(_: Path) -> None:
        raise AssertionError("the cached tiny model was rewritten")

    monkeypatch.setattr(tiny, "write_tiny_checkpoint", fail)
    assert tiny.ensure_tiny_model() == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == stamps
    monkeypatch.undo()

    other_dir = tiny.ensure_tiny_model(tmp_path / "other")
    assert (other_dir / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    first, _ = load_model(model_dir)
    second, _ = load_model(other_dir)
    assert first.lm_head.weight is first.model.embed_tokens.weight
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b), name


TOKENIZER_SHA256 = "8cfb05798dc4354f65303b0ae0cdf4a58141239ba365ad04077a0b23a0c13c88"
TOKENIZER_CONFIG_SHA256 = "876192ea3fdf45f0c0edfd65d1900f5cd825824dd0a518735575cd89d89bb6e2"


def test_tiny_checkpoint_writes_the_shipped_tokenizer_byte_for_byte(tmp_path: Path) -> None:
    """Every machine writes the same tokenizer files, whatever its ``tokenizers`` and
    ``transformers`` versions: scripts/train_tokenizer.py trained the shipped file once, and a
    change to it is deliberate (a new checkpoint NAME, the golden file regenerated)."""
    assert hashlib.sha256(tiny.TOKENIZER_JSON.read_bytes()).hexdigest() == TOKENIZER_SHA256
    tiny.write_tiny_checkpoint(tmp_path)
    assert hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest() == TOKENIZER_SHA256
    config = (tmp_path / "tokenizer_config.json").read_bytes()
    assert hashlib.sha256(config).hexdigest() == TOKENIZER_CONFIG_SHA256


def test_tiny_model_tokens_and_logits(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SCORER_CACHE_DIR", str(tmp_path))
    model, tokenizer = load_model(tiny.ensure_tiny_model())
    assert model.config.vocab_size == len(tokenizer) == tiny.VOCAB_SIZE
    ids = tokenizer.convert_tokens_to_ids(["yes", "no", "Ġno", *tiny.SPECIAL_TOKENS])
    assert None not in ids and len(set(ids)) == len(ids)
    assert ids[3:] == list(range(tiny.VOCAB_SIZE - len(tiny.SPECIAL_TOKENS), tiny.VOCAB_SIZE))  # last
    for word, tid in zip(["yes", "no", " no", *tiny.SPECIAL_TOKENS], ids, strict=True):
        assert tokenizer.encode(word, add_special_tokens=False) == [tid], word
    assert tokenizer.decode(tokenizer.encode("héllo <|im_end|>")) == "héllo <|im_end|>"
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        tiny.CONFIG["eos_token_id"],
        tiny.CONFIG["pad_token_id"],
    )
    # a BPE vocabulary, not bytes: here 28 tokens for 16 words (a byte-level one: 88, one a character)
    text = "The quick brown fox jumps over the lazy dog, and the search engine ranks every document."
    assert len(tokenizer.encode(text)) <= 2 * len(text.split())

    input_ids = torch.tensor(tokenizer.encode("is this relevant? yes"))
    with torch.no_grad():
        hidden = model.forward_hidden(input_ids, torch.arange(len(input_ids)), causal_attention)
        logits = model.score_logits(hidden[-1:])
    assert logits.shape == (1, model.config.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0.1 and logits[0, ids[0]] != logits[0, ids[1]]


@pytest.mark.parametrize("max_tokens", [1, 16, 17, 100, 16384])
def test_graph_buckets_cover_every_count_with_bounded_padding(max_tokens: int) -> None:
    from scorer.models.graphs import buckets

    b = buckets(max_tokens)
    assert b == sorted(set(b)) and b[-1] == max_tokens
    assert all(x % 16 == 0 for x in b[:-1])
    for n in range(1, max_tokens + 1, 7):
        fit = next(x for x in b if x >= n)
        assert fit - n < max(16, n // 8 + 16)
        if n >= max_tokens // 4:  # where a loaded server's passes land: steps of max / 128
            assert fit - n < max(16, max_tokens // 128), (n, fit)
    assert len(b) <= len(buckets(max_tokens, fine=None)) + 96


@pytest.mark.parametrize("kernels", ["flashinfer", "fused"])
@pytest.mark.parametrize("case", ["qwen3-tied", "llama3-rope", "llama-attention-bias", "qwen2-qkv-bias"])
def test_fused_kernel_wiring_matches_the_eager_model(
    case: str, kernels: str, tmp_path: Path, monkeypatch
) -> None:
    """The model built with kernels="flashinfer" (merged gate/up, in-place residual add, RoPE cache
    layout) or "fused" (also one QKV GEMM into the q/k norm + RoPE kernel, here its torch
    statement), eagerly and through the graph segments, against the torch-kernel model; FlashInfer
    swapped for TorchFused."""
    from scorer.models import fused
    from scorer.models.graphs import GraphedDecoder

    for name in ("rms_norm", "add_rms_norm_", "silu_and_mul", "rope_"):
        monkeypatch.setattr(fused, name, getattr(TorchFused, name))
    model_dir = save_hf_checkpoint(CASES[case], tmp_path)
    input_ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(100, 100 + SEQ_LEN)
    expected = ours_logits(load_model(model_dir, dtype=torch.float32)[0], input_ids, positions)
    model = load_model(model_dir, dtype=torch.float32, kernels=kernels)[0]
    attn0 = model.model.layers[0].self_attn
    assert (attn0.qkv_proj is not None) == (kernels == "fused")
    if attn0.qkv_proj is not None:
        assert attn0.v_proj.weight.data_ptr() > attn0.q_proj.weight.data_ptr() == attn0.qkv_proj[0].data_ptr()
    assert model.fused and model.model.layers[0].mlp.gate_proj.weight.data_ptr() == (
        model.model.layers[0].mlp.gate_up[0].data_ptr()
    )
    assert model.qkv_in_place == (kernels == "fused")
    # Triton's norms on CUDA tensors only: here, on the CPU, the (patched) FlashInfer ones run
    assert model.triton_norm == (kernels == "fused")
    model.triton_norm = False
    assert not model.triton_norm and not model.model.norm.triton
    model.triton_norm = kernels == "fused"

    def attn(layer, q, k, v, out=None):
        return out.copy_(causal_attention(layer, q, k, v))

    # "fused": q/k normed in place in the QKV GEMM's output and v left there (strided heads), or
    # the heads written to buffers of their own
    for in_place in (True, False) if kernels == "fused" else (False,):
        model.qkv_in_place = in_place
        torch.testing.assert_close(ours_logits(model, input_ids, positions), expected, atol=1e-4, rtol=0)
        graphs = GraphedDecoder(model, 32, capture=False)
        graphs.warm_up()
        assert (graphs.qkv is not None) == in_place
        if in_place:
            assert graphs.v.data_ptr() > graphs.k.data_ptr() > graphs.q.data_ptr() == graphs.qkv.data_ptr()
        with torch.no_grad():
            hidden = graphs.forward_hidden(input_ids, positions, attn)
            torch.testing.assert_close(model.score_logits(hidden), expected, atol=1e-4, rtol=0)
        assert graphs.stats["graphed_forwards"] == 1


@pytest.mark.parametrize("case", ["qwen3-tied", "llama-attention-bias"])
def test_residual_adds_in_the_gemms_match_the_eager_model(case: str, tmp_path: Path, monkeypatch) -> None:
    """``residual_in_gemm`` (on) or not: the output and down projections add into the residual
    stream themselves (``h.addmm_``; biases after), eagerly and over the graph runner's buffers,
    against the torch-kernel model; FlashInfer swapped for TorchFused."""
    from scorer.models import fused
    from scorer.models.graphs import GraphedDecoder

    for name in ("rms_norm", "add_rms_norm_", "silu_and_mul", "rope_"):
        monkeypatch.setattr(fused, name, getattr(TorchFused, name))
    model_dir = save_hf_checkpoint(CASES[case], tmp_path)
    input_ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(SEQ_LEN)
    expected = ours_logits(load_model(model_dir, dtype=torch.float32)[0], input_ids, positions)
    model = load_model(model_dir, dtype=torch.float32, kernels="fused")[0]
    assert model.residual_in_gemm  # the default of the fused kernels
    for in_gemm in (True, False):
        model.residual_in_gemm = in_gemm
        torch.testing.assert_close(ours_logits(model, input_ids, positions), expected, atol=1e-4, rtol=0)
        graphs = GraphedDecoder(model, 32, capture=False)
        graphs.warm_up()
        with torch.no_grad():
            hidden = graphs.forward_hidden(input_ids, positions, causal_attention_out)
            torch.testing.assert_close(model.score_logits(hidden), expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="merged gate/up"):
        load_model(model_dir, dtype=torch.float32)[0].residual_in_gemm = True


def causal_attention_out(layer, q, k, v, out=None):
    o = causal_attention(layer, q, k, v)
    return o if out is None else out.copy_(o)
