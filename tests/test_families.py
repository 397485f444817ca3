"""Every supported decoder family and head, end to end on the CPU: a tiny random checkpoint written
by transformers' own classes, loaded and scored by the engine under every scheme and ``auto``, with
and without the prefix cache, alone and in a batch with other calls, equal to transformers' forward
of ``prefix + item`` per document (fp32, within 1e-4)."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
from test_model import randomize_
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Gemma2Config,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from scorer.config import CheckpointError, ModelConfig
from scorer.engine import EngineConfig
from scorer.models import tiny
from scorer.planning import names
from scorer.request import Doc, InvalidInput, ScoreOptions, ScoreRequest
from scorer.runtime import build_engine, model_kernels

SMALL = dict(
    vocab_size=tiny.VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=tiny.VOCAB_SIZE - 5,  # <|endoftext|>: transformers' classification pooling needs one
)
GEMMA2 = dict(query_pre_attn_scalar=24, attn_logit_softcapping=0.5, final_logit_softcapping=0.3)
CASES = {
    "qwen2": Qwen2Config(**SMALL, architectures=["Qwen2ForCausalLM"]),
    "qwen2-score1": Qwen2Config(**SMALL, num_labels=1, architectures=["Qwen2ForSequenceClassification"]),
    "qwen2-score3": Qwen2Config(**SMALL, num_labels=3, architectures=["Qwen2ForSequenceClassification"]),
    "qwen3-score1": Qwen3Config(
        **SMALL, head_dim=16, num_labels=1, architectures=["Qwen3ForSequenceClassification"]
    ),
    "llama-score2": LlamaConfig(**SMALL, num_labels=2, architectures=["LlamaForSequenceClassification"]),
    "mistral": MistralConfig(**SMALL, head_dim=16, sliding_window=128, architectures=["MistralForCausalLM"]),
    "gemma": GemmaConfig(**SMALL, head_dim=32, architectures=["GemmaForCausalLM"]),
    "gemma2": Gemma2Config(
        **SMALL, head_dim=32, sliding_window=128, **GEMMA2, architectures=["Gemma2ForCausalLM"]
    ),
    "gemma2-score1": Gemma2Config(
        **SMALL, head_dim=32, num_labels=1, **GEMMA2, architectures=["Gemma2ForSequenceClassification"]
    ),
}
PROMPT = "what does the search engine rank first when every document mentions the query words?"
DOCS = [
    "The ranker reads the query and each document together and scores how well they match.",
    "Cats sleep most of the day.",
    "A search engine ranks documents by relevance to the query words and their meaning.",
    "Every document mentions the query words, but only one answers the question.",
]
OTHER = ScoreRequest("a second call", [Doc("something else entirely"), Doc("and more text")])


def write_checkpoint(config, path: Path, seed: int = 0) -> Path:
    """``config`` saved by transformers' own class (random weights, norms around 1) with the
    embedded tokenizer."""
    auto = (
        AutoModelForSequenceClassification
        if config.num_labels and _is_score(config)
        else AutoModelForCausalLM
    )
    model = auto.from_config(config, attn_implementation="eager")
    randomize_(model, seed)
    model.save_pretrained(path)
    tiny.write_tokenizer(path)
    return path


def _is_score(config) -> bool:
    return config.architectures[0].endswith("ForSequenceClassification")


@functools.lru_cache(maxsize=2)
def hf_model(path: Path):
    auto = AutoModelForSequenceClassification if _is_score(CASES[path.name]) else AutoModelForCausalLM
    return auto.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def reference_scores(path: Path, job, mode: str = "softmax", relevant: int = -1) -> list[float]:
    """transformers' forward of ``prefix + item`` for each doc of ``job``, read out as the engine
    documents it: the LM head's label log-probs, or the score head's output at the last token."""
    config = CASES[path.name]
    model = hf_model(path)
    out = []
    for item in job.items:
        ids = torch.tensor([job.prefix_ids + item])
        with torch.no_grad():
            logits = model(ids).logits[0]
        if not _is_score(config):
            lps = torch.log_softmax(logits[-1].double(), -1)[list(job.label_ids)]
            out.append(float(lps[0] - torch.logsumexp(lps, 0)) if mode == "softmax" else float(lps[0]))
        elif config.num_labels == 1:
            x = float(logits.reshape(-1)[0])
            out.append({"softmax": 1 / (1 + math.exp(-x)), "raw": x, "sigmoid": 1 / (1 + math.exp(-x))}[mode])
        else:
            probs = torch.softmax(logits.reshape(-1).double(), 0)
            out.append(float(probs[relevant]))
    return [math.exp(s) if not _is_score(config) and mode == "softmax" else s for s in out]


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    path = write_checkpoint(CASES[request.param], tmp_path_factory.mktemp("ckpt") / request.param)
    engine = build_engine(
        path,
        "torch",
        "cpu",
        config=EngineConfig(max_docs=64, max_doc_tokens=256),
        prefix_cache_mib=16,
        prefix_cache_admit=1,
    )
    return path, engine


def request(scheme: str, **options) -> ScoreRequest:
    return ScoreRequest(
        PROMPT,
        [Doc(d, id=str(i)) for i, d in enumerate(DOCS)],
        options=ScoreOptions(scheme=scheme, **options),
    )


def scores(result) -> list[float]:
    return [d.score for d in result.results]


def test_every_scheme_with_and_without_the_prefix_cache_equals_transformers(family):
    path, engine = family
    expected = reference_scores(path, engine.tokenize(request("naive", prefix_cache="off")))
    assert len(set(expected)) == len(expected)  # the docs score apart: an exact match means something
    for scheme in names():
        for cache in ("off", "", ""):  # off; then the prompt written to the cache, or read from it
            job = engine.tokenize(request(scheme, prefix_cache=cache))
            (result,) = engine.score_batch([job])
            torch.testing.assert_close(scores(result), expected, atol=1e-4, rtol=0, msg=f"{scheme} {cache!r}")
        assert result.usage.cached_prompt_tokens >= 16, scheme  # the last one read the cached prompt
    # in one batch with other calls of other schemes and prompts
    jobs = [
        engine.tokenize(OTHER),
        engine.tokenize(request("cascade")),
        engine.tokenize(request("multi_item")),
    ]
    for result in engine.score_batch(jobs)[1:]:
        torch.testing.assert_close(scores(result), expected, atol=1e-4, rtol=0)


def test_a_score_head_reads_its_outputs_and_refuses_label_options(family):
    path, engine = family
    config = CASES[path.name]
    if not _is_score(config):
        assert engine.info.head is None and engine.info.head_kind == "lm"
        return
    head = engine.info.head
    assert (head.num_labels, head.relevant) == (config.num_labels, config.num_labels - 1)
    assert engine.info.head_kind.startswith(f"score head ({config.architectures[0]}")
    for field, value in (("label_tokens", ("yes", "no")), ("label_token_ids", (1, 2))):
        with pytest.raises(InvalidInput, match=f"options.{field}: the model has a score head"):
            engine.tokenize(request("naive", **{field: value}))
    modes = ("raw", "sigmoid", "logprob") if config.num_labels == 1 else ("logprob",)
    for mode in modes:
        job = engine.tokenize(request("ragged", score_mode=mode))
        (result,) = engine.score_batch([job])
        if mode == "logprob":
            want = [math.log(s) for s in reference_scores(path, job)]
        else:
            want = reference_scores(path, job, mode)
        torch.testing.assert_close(scores(result), want, atol=1e-4, rtol=0, msg=mode)


def test_the_relevant_label_of_a_several_label_head_is_configurable(tmp_path):
    config = Qwen2Config(
        **SMALL,
        num_labels=3,
        id2label={0: "bad", 1: "fair", 2: "good"},
        label2id={"bad": 0, "fair": 1, "good": 2},
        architectures=["Qwen2ForSequenceClassification"],
    )
    CASES[tmp_path.name] = config  # reference_scores reads the case by the directory's name
    try:
        path = write_checkpoint(config, tmp_path)
        for label, index in (("", 2), ("0", 0), ("fair", 1), ("-3", 0)):
            engine = build_engine(path, "torch", "cpu", config=EngineConfig(score_label=label))
            assert engine.info.head.relevant == index
            job = engine.tokenize(request("cascade"))
            (result,) = engine.score_batch([job])
            torch.testing.assert_close(
                scores(result), reference_scores(path, job, relevant=index), atol=1e-4, rtol=0
            )
        with pytest.raises(ValueError, match="score label 'great' is not a label"):
            build_engine(path, "torch", "cpu", config=EngineConfig(score_label="great"))
    finally:
        del CASES[tmp_path.name]


def test_family_config_fields_and_refusals():
    qwen2 = ModelConfig.from_hf(CASES["qwen2"])
    assert (qwen2.attention_bias, qwen2.o_bias, qwen2.qk_norm, qwen2.head) == (True, False, False, "lm")
    gemma2 = ModelConfig.from_hf(CASES["gemma2"])
    assert (gemma2.gemma, gemma2.sandwich_norms, gemma2.hidden_act) == (True, True, "gelu_pytorch_tanh")
    assert (gemma2.attn_scale, gemma2.attn_soft_cap, gemma2.final_soft_cap) == (24**-0.5, 0.5, 0.3)
    assert (gemma2.sliding_window, gemma2.max_positions) == (128, 128) and not gemma2.plain_kernels
    assert ModelConfig.from_hf(CASES["qwen2-score3"]).head == "score"
    mistral = ModelConfig.from_hf(CASES["mistral"])
    assert (mistral.max_positions, mistral.plain_kernels) == (128, True)
    # Gemma's families keep the torch kernels; the others take the fused ones
    assert model_kernels("auto", "flashinfer", "cuda", gemma2.plain_kernels) == "torch"
    assert model_kernels("auto", "flashinfer", "cuda", mistral.plain_kernels) in ("fused", "flashinfer")
    with pytest.raises(ValueError, match="runs on the torch kernels only"):
        from scorer.models import DecoderLM

        with torch.device("meta"):
            DecoderLM(gemma2, "fused")
    for hf, message in (
        (
            Qwen2Config(**SMALL, hidden_act="relu", architectures=["Qwen2ForCausalLM"]),
            "unsupported hidden_act 'relu'",
        ),
        (
            LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
            "unsupported rope_type 'dynamic'",
        ),
        (Qwen2Config(**SMALL, architectures=["Qwen2ForTokenClassification"]), "unsupported architecture"),
        (
            Qwen2Config(
                **SMALL, quantization_config={"quant_method": "awq"}, architectures=["Qwen2ForCausalLM"]
            ),
            "quantization_config.quant_method 'awq' is not supported",
        ),
    ):
        with pytest.raises(CheckpointError, match=message):
            ModelConfig.from_hf(hf)


def test_a_document_past_the_sliding_window_is_refused_naming_it(family):
    path, engine = family
    window = ModelConfig.from_hf(path).sliding_window
    if not window or engine.info.max_positions != window:
        return
    long_doc = Doc(" ".join(["word"] * 2 * window))
    with pytest.raises(InvalidInput, match=f"sliding window of {window} tokens"):
        engine.tokenize(ScoreRequest(PROMPT, [long_doc]))


def test_scorer_score_runs_a_classification_checkpoint(tmp_path, capsys):
    """``scorer score --model DIR`` on a Qwen2ForSequenceClassification directory: the score head's
    sigmoid per doc, as transformers computes it."""
    import json

    from scorer.cli import main

    path = write_checkpoint(CASES["qwen2-score1"], tmp_path / "qwen2-score1")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d, "id": f"d{i}"}) + "\n" for i, d in enumerate(DOCS)))
    argv = [
        "score",
        "--model",
        str(path),
        "--prompt",
        PROMPT,
        "--docs",
        str(docs),
        "--attention-backend",
        "torch",
    ]
    assert main([*argv, "--scheme", "cascade"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    engine = build_engine(path, "torch", "cpu")
    want = reference_scores(path, engine.tokenize(request("naive")), "sigmoid")
    assert [line["id"] for line in lines] == [f"d{i}" for i in range(len(DOCS))]
    torch.testing.assert_close([line["score"] for line in lines], want, atol=1e-4, rtol=0)
    assert main([*argv, "--label-tokens", "yes", "no"]) == 2
    assert "options.label_tokens: the model has a score head" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen2-score3", "gemma2"])
def test_scorer_serve_runs_the_checkpoint(case, tmp_path):
    """``scorer serve --model DIR``: a Cohere-shaped call scores as transformers does, and /info
    names the head."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    path = write_checkpoint(CASES[case], tmp_path / case)
    ports = []
    for _ in range(3):  # gRPC, HTTP, metrics: free ones, not the defaults another server may hold
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cmd = [sys.executable, "-m", "scorer", "serve", "--model", str(path), "--attention-backend", "torch"]
    cmd += ["--port", str(ports[0]), "--http-port", str(ports[1]), "--metrics-port", str(ports[2])]
    cmd += ["--drain-seconds", "0"]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    try:
        url = f"http://127.0.0.1:{ports[1]}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                info = httpx.get(f"{url}/info", timeout=2)
                if info.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        head = "lm" if not _is_score(CASES[case]) else "score head (Qwen2ForSequenceClassification, 3 labels)"
        assert info.json()["head"] == head
        body = {"model": "m", "query": PROMPT, "documents": DOCS}
        results = httpx.post(f"{url}/v2/rerank", json=body, timeout=60).json()["results"]
        got = [r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])]
        engine = build_engine(path, "torch", "cpu")
        want = reference_scores(path, engine.tokenize(ScoreRequest(PROMPT, [Doc(d) for d in DOCS])))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
