"""Every decoder family and head on the GPU: FlashInfer attention, the serving kernels and the CUDA
graphs, bf16, against transformers' fp32 forward of ``prefix + item`` per document (within 0.05 and
the same ranking), under every scheme and ``auto``, with the prefix cache read. Head_dim 128 runs
the GPU kit's prebuilt FlashInfer kernels; Gemma's 256 (and Gemma 2's logit soft-cap) builds its
kernels on first use: the test prints how long that took (run with ``-s``). Skipped without CUDA and
flashinfer."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Gemma2Config,
    GemmaConfig,
    MistralConfig,
    Qwen2Config,
)

from scorer.engine import EngineConfig  # noqa: E402
from scorer.models import tiny  # noqa: E402
from scorer.planning import names  # noqa: E402
from scorer.request import Doc, ScoreOptions, ScoreRequest  # noqa: E402
from scorer.runtime import build_engine  # noqa: E402

TOL = 0.05
SMALL = dict(
    vocab_size=tiny.VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    pad_token_id=tiny.VOCAB_SIZE - 5,
)
CASES = {  # name: (config, head_dim 256: FlashInfer compiles its kernels on first use)
    "qwen2": (Qwen2Config(**SMALL, architectures=["Qwen2ForCausalLM"]), False),
    "qwen2-score1": (
        Qwen2Config(**SMALL, num_labels=1, architectures=["Qwen2ForSequenceClassification"]),
        False,
    ),
    "mistral": (
        MistralConfig(**SMALL, head_dim=128, sliding_window=None, architectures=["MistralForCausalLM"]),
        False,
    ),
    "gemma": (GemmaConfig(**SMALL, head_dim=256, architectures=["GemmaForCausalLM"]), True),
    "gemma2": (
        Gemma2Config(
            **SMALL,
            head_dim=256,
            query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            architectures=["Gemma2ForCausalLM"],
        ),
        True,
    ),
}
WORDS = "the of shared prefix attention kernel scoring query ranking flash cascade merge item panda".split()  # noqa: SIM905
PROMPT = " ".join(WORDS[i % len(WORDS)] for i in range(0, 70, 3))
DOCS = [" ".join(WORDS[(i * 7 + j * (i + 2)) % len(WORDS)] for j in range(5 + 9 * i)) for i in range(6)]


def is_score(config) -> bool:
    return config.architectures[0].endswith("ForSequenceClassification")


def write_checkpoint(config, path: Path) -> Path:
    """transformers' own class, seeded random weights of a spread that separates the docs' scores."""
    auto = AutoModelForSequenceClassification if is_score(config) else AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator) * 0.05
            p.copy_(
                noise if "norm" not in name else (noise if "Gemma" in type(model).__name__ else 1 + noise)
            )
    model.save_pretrained(path)
    tiny.write_tokenizer(path)
    return path


def reference(path: Path, config, job) -> list[float]:
    """transformers' fp32 forward on the GPU of prefix + item per doc: the LM head's label
    log-prob (logprob mode), or the score head's logit (raw)."""
    auto = AutoModelForSequenceClassification if is_score(config) else AutoModelForCausalLM
    model = auto.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).cuda().eval()
    out = []
    for item in job.items:
        with torch.no_grad():
            logits = model(torch.tensor([job.prefix_ids + item], device="cuda")).logits[0].float()
        if is_score(config):
            out.append(float(logits.reshape(-1)[0]))
        else:
            out.append(float(torch.log_softmax(logits[-1], -1)[job.label_ids[0]]))
    del model
    torch.cuda.empty_cache()
    return out


def request(scheme: str, cache: str, config) -> ScoreRequest:
    mode = "raw" if is_score(config) else "logprob"
    options = ScoreOptions(scheme=scheme, score_mode=mode, prefix_cache=cache, group_size=2)
    return ScoreRequest(PROMPT, [Doc(d, id=str(i)) for i, d in enumerate(DOCS)], options=options)


def same_ranking(got: list[float], want: list[float]) -> bool:
    """Every pair the reference tells apart by more than twice the tolerance, in the same order."""
    return all(
        (got[i] > got[j]) == (want[i] > want[j])
        for i in range(len(want))
        for j in range(i + 1, len(want))
        if abs(want[i] - want[j]) > 2 * TOL
    )


@pytest.mark.timeout(1800)  # a head_dim-256 model's first FlashInfer build (JIT) takes minutes
@pytest.mark.parametrize("name", list(CASES))
def test_every_family_on_flashinfer_matches_transformers(name, tmp_path):
    config, jit = CASES[name]
    path = write_checkpoint(config, tmp_path / name)
    started = time.perf_counter()
    # every hit read (a GPU's default declines reads that save under 1,024 rows), so that the cache's
    # reads are checked on every family
    engine = build_engine(
        path,
        "flashinfer",
        "cuda",
        torch.bfloat16,
        EngineConfig(min_cache_read_tokens=0),
        prefix_cache_mib=64,
        prefix_cache_admit=1,
    )
    assert engine.runner.backend.name == "flashinfer"
    assert engine.runner.model.fused == (name not in ("gemma", "gemma2"))  # Gemma's: the torch kernels
    engine.runner.capture_graphs()
    want = reference(path, config, engine.tokenize(request("naive", "off", config)))
    assert max(want) - min(want) > 4 * TOL  # the docs score apart
    first = None
    for scheme in names():
        for cache in ("off", "", ""):  # off; the prompt written to the cache; read from it
            (result,) = engine.score_batch([engine.tokenize(request(scheme, cache, config))])
            if first is None:
                first = time.perf_counter() - started
            got = [d.score for d in result.results]
            assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < TOL, (scheme, cache, got, want)
            assert same_ranking(got, want), (scheme, cache, got, want)
        assert result.usage.cached_prompt_tokens > 0, scheme
    if jit:
        print(
            f"\n{name}: head_dim 256, engine built and first batch scored in {first:.1f} s (FlashInfer JIT)"
        )
