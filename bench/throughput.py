"""Docs/s per GPU: this engine against transformers on the same calls, with MFU.

Random bf16 weights in the shapes of Qwen3-0.6B and Qwen3-8B, template ``plain``, token ids, two
label ids. For each workload (prompt + N docs of S tokens) and system:

* an engine system (``auto`` or a forced scheme; ``auto@flashinfer`` is ``auto`` on the model's
  FlashInfer kernels instead of the fused ones, ``auto@fa3`` or ``@fa2`` with FlashInfer's prefill
  kernel forced instead of chosen per call, ``auto@coarse`` on CUDA-graph buckets growing by 1/8
  alone, ``auto@topq`` with them fine in the top quarter alone (``graphs.TOP_QUARTER``), ``auto@lt`` with
  its GEMMs captured from cuBLASLt instead of cuBLAS, ``auto@exact`` with cuBLAS's reduced-
  precision bf16 split-K reductions off, ``BLAS``; ``@paged`` with every attention call through
  the paged pool, also those that read one run of slots; ``@copyv`` with q, k and v written to
  three buffers instead of left in the QKV GEMM's output; ``@noaddmm`` with the residual adds
  outside the output and down GEMMs (``DecoderLM.residual_in_gemm``); ``@finorm`` with
  FlashInfer's hidden-state norms instead of Triton's (``DecoderLM.triton_norm``); ``@noswiglu``
  with the MLP's gate/up on cuBLAS and FlashInfer's SiLU-and-mul instead of Triton's one GEMM
  (``DecoderLM.swiglu_gemm``); ``@fp8`` with the decoder's linears in FP8 (``--quantization fp8``,
  ``scorer.models.quant``; ``@fp8lin`` with each linear quantizing its input, ``@fp8noswiglu``
  with cuBLAS's FP8 gate/up GEMM and the SiLU-and-mul kernel instead of Triton's FP8 gate/up +
  SiLU, ``@fp8sepadd`` with the MLP's residual add a kernel of its own); ``@nomat`` with
  long docs' attention paged instead of on FA3 over a gathered copy of their keys; ``@pool`` with a split
  call's passes reusing its prompt's K/V from a pool, never computing it again): batches of at
  most ``--budget`` tokens formed as the server's batcher forms them at saturation
  (``full_batches``: no runt at the list's end) and pipelined as it runs them (the next batch
  launched before the last is collected); docs/s at saturation, one idle call's p50/p95, peak GPU
  memory;
* ``hf_naive``: transformers (SDPA) on every [prompt + doc] as a row of a batch;
* ``hf_prefix``: the prompt's KV cache computed once and repeated over a batch of docs;
  both at their best batch size of ``HF_BATCHES``.

MFU = useful FLOPs / time / the rate of an 8192^3 bf16 matmul timed in the same run, with useful
FLOPs of a call of prompt P and N docs of S tokens, L layers, hidden h, MLP width i, q width q,
kv width kv, vocabulary V: ``2L(h(q+2kv) + qh + 3hi)(P+NS) + 4Lq(P^2/2 + NS(P+S/2)) + 2hVN``.
The JSON (``throughput.json``) is written after every record. ``--rounds R`` measures every
engine system R times, the systems of a workload interleaved (R rounds of A, B, ...), and records
the median docs/s and each round's (``docs_s_rounds``): on an H200 one system's docs/s spread 3% between
single runs, as much as the changes being compared.

The prefix cache (``auto+cache``: ``auto`` with a pool of ``CACHE_GIB``, beside ``auto`` without
one, in the same run) is measured on calls that repeat what search backends resend: ``D-repeat``
(an 8,000-token context reused by 50 consecutive calls of 32 x 4-token docs, then the next
context), ``B-repeat`` (2,000 + 100 x 100, 10 calls per context) and ``A-text`` (the load tool's
text calls of A with the reranker template, tokenized by the embedded tokenizer: only the template
head repeats). These run once through their calls in order, each tokenized just before its batch
is formed (so ``auto`` and the batch's token count see what is cached, as in the server), and
record the hit rate and the pool's size; A-text's systems without the cache run tokenized
beforehand, as the engine's reference for served text calls (``PRETOKENIZED``).

    python -m bench.throughput --out out/ [--models qwen3-0.6b] [--workloads A,E] [--systems auto,hf_naive]
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from scorer.attention import HeadSpec
from scorer.attention.torch_ref import TorchBackend
from scorer.engine import Engine, EngineConfig
from scorer.models.graphs import FINE, TOP_QUARTER, buckets
from scorer.models.quant import quantize_model
from scorer.planning import REGISTRY
from scorer.prefix_cache import PrefixCache
from scorer.request import Doc, ScoreOptions, ScoreRequest
from scorer.runner import ModelRunner

from .e2e import QWEN3_06B, build_model
from .timing import environment, sync, write_json

SPACED_GAP_S = 0.02

QWEN3_8B = {
    **QWEN3_06B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
SMOKE = {**QWEN3_06B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
MODELS = {"qwen3-0.6b": QWEN3_06B, "qwen3-8b": QWEN3_8B, "smoke": SMOKE}
WORKLOADS = {  # prompt tokens, docs, doc tokens (a float: log-normal around it)
    "A": (300, 10, 50),
    "A'": (300, 10, 50.0),
    "B": (2000, 100, 100),
    "C": (100, 50, 400),
    "D": (8000, 32, 4),
    "E": (200, 20, 60),
    "D-repeat": (8000, 32, 4),
    "B-repeat": (2000, 100, 100),
    "A-text": (300, 10, 50),
}
REUSE = {"D-repeat": 50, "B-repeat": 10}
"""Consecutive calls that share one context (the prompt), per repeat workload."""
STREAMED = ("D-repeat", "B-repeat", "A-text")
PRETOKENIZED = ("A-text",)
"""Streamed workloads whose systems without the cache run tokenized beforehand, as the other
workloads: the engine's reference for the served text calls (streamed, it timed the tokenizer
inline: 3,168 docs/s on an H200 against the replica's 4,765)."""
CACHE_GIB = 16
"""The pool of the ``+cache`` systems (an H200 has room; the CPU smoke run allocates it lazily)."""
DEFAULT = {
    "qwen3-0.6b": ("A", "A'", "B", "C", "D", "E", "D-repeat", "B-repeat", "A-text"),
    "qwen3-8b": ("A", "B"),
    "smoke": ("A", "A'"),
}
HF_BATCHES = (8, 32, 128)
LABELS = (1, 2)


def calls(workload: str, n: int, vocab: int, seed: int = 0) -> list[ScoreRequest]:
    if workload == "A-text":
        return text_calls(n, seed)
    p, m, s = WORKLOADS[workload]
    rng = random.Random(seed)
    reuse = REUSE.get(workload, 1)

    def doc_len() -> int:
        return max(1, round(rng.lognormvariate(math.log(s), 0.5))) if isinstance(s, float) else s

    out = []
    for i in range(n):
        if i % reuse == 0:
            prompt = tuple(rng.randrange(vocab) for _ in range(p))
        docs = [
            Doc(id=str(j), token_ids=tuple(rng.randrange(vocab) for _ in range(doc_len()))) for j in range(m)
        ]
        out.append(
            ScoreRequest(
                "",
                docs,
                prompt_token_ids=prompt,
                options=ScoreOptions(template="plain", label_token_ids=LABELS),
                request_id=str(i),
            )
        )
    return out


def text_calls(n: int, seed: int = 0) -> list[ScoreRequest]:
    """The load tool's text calls of A (300-token prompt, 10 docs of 50 tokens, the reranker
    template), in the embedded tokenizer's tokens."""
    from loadtest.gen import GenConfig, TextSource, generate, load_tokenizer, parse_dist
    from loadtest.words import WORDS
    from scorer.models.tiny import ensure_tiny_model
    from scorer.server.convert import request_from_proto

    source = TextSource(WORDS, False, load_tokenizer(str(ensure_tiny_model())), 1.3)
    cfg = GenConfig(
        requests=n,
        docs=parse_dist("10"),
        prompt_tokens=parse_dist("fixed:300", source),
        doc_tokens=parse_dist("fixed:50", source),
        schemes={"auto": 1.0},
        seed=seed,
        template="qwen3_reranker",
    )
    return [request_from_proto(r, str(i)) for i, r in enumerate(generate(cfg, source))]


def useful_flops(cfg: dict, p: int, lens: list[int]) -> float:
    L, h, i, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    tokens = p + sum(lens)
    attention = p * p / 2 + sum(s * (p + s / 2) for s in lens)
    return (
        2 * L * (h * (q + 2 * kv) + q * h + 3 * h * i) * tokens
        + 4 * L * q * attention
        + 2 * h * V * len(lens)
    )


def matmul_tflops(device: torch.device) -> float:
    """The rate of an 8192^3 bf16 matmul (1024^3 on the CPU, for a smoke run)."""
    k = 8192 if device.type == "cuda" else 1024
    a = torch.randn(k, k, dtype=torch.bfloat16, device=device)
    b = torch.randn(k, k, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    sync(device)
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    sync(device)
    return 2 * k**3 * n / (time.perf_counter() - t0) / 1e12


def batches(jobs: list, budget: int) -> list[list]:
    out, cur, n = [], [], 0
    for job in jobs:
        if cur and n + job.tokens > budget:
            out.append(cur)
            cur, n = [], 0
        cur.append(job)
        n += job.tokens
    return out + ([cur] if cur else [])


def full_batches(jobs: list, budget: int) -> list[list]:
    """``batches`` as a saturated server's batcher forms them: the last one is dropped when another
    call would still have fit (the end of the list, not of the queue; cycling over the batches
    would otherwise run that runt once per pass, e.g. 4 calls of A after three batches of 20)."""
    out = batches(jobs, budget)
    if len(out) > 1 and sum(j.tokens for j in out[-1]) + min(j.tokens for j in jobs) <= budget:
        out.pop()
    return out


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan


def engine_system(
    engine: Engine, reqs: list[ScoreRequest], scheme: str, seconds: float, budget: int, idle: bool = True
) -> dict:
    from dataclasses import replace

    device = engine.device
    jobs = [engine.tokenize(replace(r, options=replace(r.options, scheme=scheme))) for r in reqs]
    todo = full_batches(jobs, budget)
    for b in todo[:2]:
        engine.score_batch(b)
    sync(engine.device)
    _reset_peak(device)
    docs, t0, waiting, k = 0, time.perf_counter(), None, 0
    while time.perf_counter() - t0 < seconds or k < 3:
        b = todo[k % len(todo)]
        launched = engine.launch(b)
        if waiting is not None:
            waiting()
        waiting = launched
        docs += sum(len(j.items) for j in b)
        k += 1
    waiting()
    wall = time.perf_counter() - t0

    def alone(gap_s: float) -> list[float]:
        """Milliseconds of each of 30 calls scored alone, ``gap_s`` after the last one ended."""
        out = []
        for job in jobs[:30]:
            sync(engine.device)
            time.sleep(gap_s)
            t1 = time.perf_counter()
            engine.score_batch([job])
            out.append((time.perf_counter() - t1) * 1e3)
        return out

    out = {
        "docs_s": docs / wall,
        "peak_gib": _peak_gib(device),
        "scheme_used": sorted({j.scheme.name for j in jobs}),
    }
    if idle:
        one = alone(0.0)
        spaced = alone(SPACED_GAP_S)  # the same calls 20 ms apart (A's 10% load): the device idles between
        out |= {
            "idle_p50_ms": statistics.median(one),
            "idle_p95_ms": statistics.quantiles(one, n=20)[18],
            "idle_spaced_p50_ms": statistics.median(spaced),
        }
    return out


def streamed_system(
    engine: Engine, reqs: list[ScoreRequest], scheme: str, seconds: float, budget: int
) -> dict:
    """One pass through ``reqs`` in order (at most ``seconds``), each call tokenized just before
    its batch is formed, batches under ``budget`` tokens pipelined as the server runs them."""
    from dataclasses import replace

    reqs = [replace(r, options=replace(r.options, scheme=scheme)) for r in reqs]
    engine.score_batch([engine.tokenize(reqs[-1])])  # warm the kernels on a shape of the workload
    if engine.cache is not None:
        engine.cache.clear()  # and start from an empty pool
    sync(engine.device)
    _reset_peak(engine.device)
    docs, prompt, cached, t0, waiting, i = 0, 0, 0, time.perf_counter(), None, 0
    while i < len(reqs) and time.perf_counter() - t0 < seconds:
        batch, n = [], 0
        while i < len(reqs):
            job = engine.tokenize(reqs[i])
            if batch and n + job.tokens > budget:
                break
            batch.append(job)
            n += job.tokens
            i += 1
        launched = engine.launch(batch)
        if waiting is not None:
            done = waiting()
            cached += sum(r.usage.cached_prompt_tokens for r in done)
            prompt += sum(r.usage.prompt_tokens for r in done)
        waiting = launched
        docs += sum(len(j.items) for j in batch)
    done = waiting()
    cached += sum(r.usage.cached_prompt_tokens for r in done)
    prompt += sum(r.usage.prompt_tokens for r in done)
    wall = time.perf_counter() - t0
    out = {
        "docs_s": docs / wall,
        "calls": i,
        "peak_gib": _peak_gib(engine.device),
        "prefix_cache": engine.cache is not None,
        "hit_rate": cached / max(prompt, 1),
    }
    if engine.cache is not None:
        out |= {"pool_gib": engine.cache.capacity * engine.cache.slot_bytes / 2**30, **engine.cache.stats}
    return out


def hf_model(cfg: dict, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(
        "qwen3", **{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    )
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


@torch.inference_mode()
def hf_system(model, reqs: list[ScoreRequest], prefix_cache: bool, seconds: float) -> dict:
    """The best batch size's docs/s; each call's docs scored from the hidden state of their last
    token (the LM head on those rows only, as the engine does)."""
    device = next(model.parameters()).device
    best = None
    for bsz in HF_BATCHES:
        _reset_peak(device)
        try:
            run = _hf_prefix if prefix_cache else _hf_naive
            run(model, reqs[0], bsz, device)
            sync(device)
            docs, t0, k = 0, time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds / len(HF_BATCHES) or k < 2:
                run(model, reqs[k % len(reqs)], bsz, device)
                docs += len(reqs[k % len(reqs)].docs)
                k += 1
            sync(device)
            rate = docs / (time.perf_counter() - t0)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            continue
        if best is None or rate > best["docs_s"]:
            best = {"docs_s": rate, "batch": bsz, "peak_gib": _peak_gib(device)}
    return best or {"error": "out of memory at every batch size"}


def _last_rows(model, hidden: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    rows = hidden[torch.arange(len(last), device=hidden.device), last]
    return model.lm_head(model.model.norm(rows)).float().log_softmax(-1)[:, list(LABELS)]


def _hf_naive(model, req: ScoreRequest, bsz: int, device) -> None:
    seqs = [req.prompt_token_ids + d.token_ids for d in req.docs]
    for i in range(0, len(seqs), bsz):
        chunk = seqs[i : i + bsz]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, s in enumerate(chunk):
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s)] = 1
        hidden = model.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        _last_rows(model, hidden, torch.tensor([len(s) - 1 for s in chunk], device=device))


def _hf_prefix(model, req: ScoreRequest, bsz: int, device) -> None:
    prompt = torch.tensor([req.prompt_token_ids], device=device)
    cache = model.model(input_ids=prompt, use_cache=True).past_key_values
    p = prompt.shape[1]
    docs = [d.token_ids for d in req.docs]
    for i in range(0, len(docs), bsz):
        chunk = docs[i : i + bsz]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.ones(len(chunk), p + width, dtype=torch.long)
        for r, s in enumerate(chunk):
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, p + len(s) :] = 0
        c = copy.deepcopy(cache)
        c.batch_repeat_interleave(len(chunk))
        out = model.model(input_ids=ids.to(device), attention_mask=mask.to(device), past_key_values=c)
        _last_rows(model, out.last_hidden_state, torch.tensor([len(s) - 1 for s in chunk], device=device))


BLAS = ("default", "lt", "exact")
"""How the GEMMs of the CUDA graphs are chosen at capture: torch's defaults (cuBLAS, reduced-
precision bf16 reductions allowed), cuBLASLt preferred, or reduced-precision reductions off (the
kernel profile shows a memset before every GEMM of the graphs: a split-K or stream-K workspace)."""


@contextmanager
def blas_choice(blas: str) -> Iterator[None]:
    """torch's cuBLAS switches for ``blas`` (one of ``BLAS``) while the block runs."""
    if blas not in BLAS:
        raise ValueError(f"unknown blas {blas!r}; expected one of {BLAS}")
    cuda, matmul = torch.backends.cuda, torch.backends.cuda.matmul
    before = (cuda.preferred_blas_library(), matmul.allow_bf16_reduced_precision_reduction)
    try:
        if blas == "lt":
            cuda.preferred_blas_library("cublaslt")
        if blas == "exact":
            matmul.allow_bf16_reduced_precision_reduction = False
        yield
    finally:
        cuda.preferred_blas_library(before[0])
        matmul.allow_bf16_reduced_precision_reduction = before[1]


def engine_for(
    cfg: dict,
    device: torch.device,
    kernels: str,
    budget: int,
    attention: str = "auto",
    fine: tuple[float, int] | None = FINE,
    blas: str = "default",
    contiguous: bool = True,
    qkv_in_place: bool = True,
    recompute: bool = True,
    residual_in_gemm: bool = True,
    triton_norm: bool = True,
    materialize: bool = True,
    swiglu_gemm: bool = True,
    fp8: str = "",
) -> Engine:
    """The serving configuration (FlashInfer, CUDA graphs); the torch reference on the CPU (smoke);
    the embedded tokenizer, for the text calls. ``attention``: FlashInfer's prefill kernels
    (``auto``: per call, ``fa2``, ``fa3``);
    ``fine``: the CUDA-graph buckets' fine steps (``graphs.buckets``; None: the 1/8 growth alone);
    ``blas``: how the graphs' GEMMs are chosen (``BLAS``); ``contiguous=False``: every attention call
    through the paged pool (``FlashInferBackend``'s ``contiguous``); ``qkv_in_place=False``: the
    heads copied out of the QKV GEMM's output (``DecoderLM.qkv_in_place``); ``recompute=False``: a
    split call never computes its prompt again (``EngineConfig.prompt_recompute_share`` 0);
    ``residual_in_gemm``, ``triton_norm``, ``swiglu_gemm``: ``DecoderLM``'s settings of those names;
    ``materialize=False``: long docs' calls paged, not on FA3 over a copy of their keys
    (``FlashInferBackend``'s ``materialize``); ``fp8``: the decoder's linears in FP8
    (``quant.quantize_model``): ``fused`` (the serving default), ``linears`` (each linear quantizing
    its own input), ``noswiglu`` (``fused`` with cuBLAS's FP8 gate/up GEMM and the SiLU-and-mul
    kernel quantizing, instead of Triton's FP8 gate/up + SiLU GEMM), ``sepadd`` (``fused`` with the MLP's
    residual add a kernel of its own, not in the next input norm)."""
    cuda = device.type == "cuda"
    model = build_model(device, cfg["num_hidden_layers"], kernels if cuda else "torch", cfg)
    model.qkv_in_place = model.qkv_in_place and qkv_in_place
    model.residual_in_gemm = model.residual_in_gemm and residual_in_gemm
    model.triton_norm = model.triton_norm and triton_norm
    model.swiglu_gemm = model.swiglu_gemm and swiglu_gemm
    if fp8:
        quantize_model(model, fused=False if fp8 == "linears" else None)
        model.swiglu_gemm = model.swiglu_gemm and fp8 != "noswiglu"
        model.residual_in_norm = model.residual_in_norm and fp8 != "sepadd"
    mc = model.config
    spec = HeadSpec(mc.num_heads, mc.num_kv_heads, mc.head_dim, torch.bfloat16, device)
    if cuda:
        from scorer.attention.flashinfer import FlashInferBackend

        backend = FlashInferBackend(spec, kernels=attention, contiguous=contiguous, materialize=materialize)
    else:
        backend = TorchBackend(spec)
    runner = ModelRunner(model, backend, 16384 if cuda else 0)
    if runner.graphs is not None and fine != FINE:
        runner.graphs.buckets = buckets(runner.graphs.max_tokens, fine=fine)
    with blas_choice(blas):
        runner.capture_graphs()
    config = EngineConfig(
        max_tokens_per_pass=budget,
        auto_policy="calibrated",
        prompt_recompute_share=None if recompute else 0.0,
    )
    return Engine(runner, embedded_tokenizer(), config)


def embedded_tokenizer():
    from transformers import AutoTokenizer

    from scorer.models.tiny import ensure_tiny_model

    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()), local_files_only=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--workloads", default="", help="comma-separated (default: every one of the model)")
    ap.add_argument(
        "--systems",
        default="",
        help="auto, auto@flashinfer, auto@fa3, auto@lt, auto@paged, auto@copyv, auto@noaddmm, auto@finorm,"
        " auto@noswiglu, auto@nomat, auto@pool, auto@fp8, auto@fp8lin, auto@fp8noswiglu,"
        " auto@fp8sepadd, a scheme, hf_naive,"
        " hf_prefix",
    )
    ap.add_argument("--seconds", type=float, default=4.0, help="per system, at saturation")
    ap.add_argument("--cache-systems", default="auto,auto+cache", help="the systems of the repeat workloads")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument(
        "--repeat-calls", type=int, default=500, help="calls of a repeat workload, run once in order"
    )
    ap.add_argument("--budget", type=int, default=16384, help="tokens per batch, as the server's batcher")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget-s", type=float, default=1e9, help="no new record after this many seconds")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="engine systems measured this many times, interleaved; docs/s their median (docs_s_rounds)",
    )
    a = ap.parse_args(argv)
    stop_at = time.monotonic() + a.budget_s
    device = torch.device(a.device)
    result = {**environment(device), "matmul_tflops": matmul_tflops(device), "records": []}
    peak = result["matmul_tflops"] * 1e12
    print(f"bf16 matmul 8192^3: {result['matmul_tflops']:.1f} TFLOP/s", flush=True)
    print(
        "| model | workload | system | docs/s | MFU | idle p50 ms | idle p95 ms | 20 ms apart p50 ms"
        " | peak GiB |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|", flush=True)
    for name in a.models.split(","):
        cfg = MODELS[name]
        default_systems = (
            ("auto", "ragged", "multi_item", "hf_naive", "hf_prefix")
            if name == "qwen3-8b"
            else ("auto", "auto@flashinfer", *REGISTRY, "hf_naive", "hf_prefix")
        )
        systems = [s for s in (a.systems.split(",") if a.systems else default_systems) if s]
        cache_systems = [s for s in a.cache_systems.split(",") if s]
        workloads = a.workloads.split(",") if a.workloads else DEFAULT[name]
        engines: dict[str, object] = {}  # built on first use, kept for every workload
        for w in workloads:
            streamed = w in STREAMED
            reqs = calls(w, a.repeat_calls if streamed else a.calls, cfg["vocab_size"])
            p = WORKLOADS[w][0]
            per_doc = statistics.mean(
                useful_flops(cfg, p, [len(d.token_ids) for d in r.docs]) / len(r.docs) for r in reqs
            )
            rows: dict[str, dict] = {}
            for rnd in range(a.rounds):
                last = rnd == a.rounds - 1
                for system in cache_systems if streamed else systems:
                    rec = rows.setdefault(system, {"model": name, "workload": w, "system": system})
                    again = rnd > 0 and (system.startswith("hf_") or streamed)  # measured once
                    done = "error" in rec or "skipped" in rec or again
                    if not done and time.monotonic() <= stop_at:
                        measure(rec, engines, cfg, device, a, w, reqs, streamed, idle=last)
                    elif not done and "docs_s" not in rec:
                        rec["skipped"] = "time budget of the run"
                    if not last:
                        continue
                    rounds = rec.get("docs_s_rounds", [])
                    if len(rounds) > 1:
                        rec["docs_s"] = statistics.median(rounds)
                    else:
                        rec.pop("docs_s_rounds", None)
                    if "docs_s" in rec and not streamed:  # a cached prompt is not "useful FLOPs" run
                        rec["mfu"] = rec["docs_s"] * per_doc / peak
                        rec["roofline_docs_s"] = peak / per_doc
                    result["records"].append(rec)
                    write_json(a.out / "throughput.json", result)
                    print(_row(rec), flush=True)
        engines.clear()
        torch.cuda.empty_cache()


FP8_SYSTEMS = {"fp8": "fused", "fp8lin": "linears", "fp8noswiglu": "noswiglu", "fp8sepadd": "sepadd"}
"""``auto@X``: the FP8 variant of ``engine_for``'s ``fp8``."""


def measure(rec: dict, engines: dict, cfg: dict, device, a, w: str, reqs, streamed: bool, idle: bool) -> None:
    """One round of ``rec``'s system on workload ``w`` into ``rec`` (its docs/s appended to
    ``docs_s_rounds``; the idle calls only where ``idle``); the engine built on first use."""
    system = rec["system"]
    at = system.partition("@")[2].removesuffix("+cache")  # kernels, attention, buckets
    attention = at if at in ("fa2", "fa3") else "auto"
    kernels = "hf" if system.startswith("hf_") else at if at == "flashinfer" else "fused"
    blas = at if at in BLAS else "default"
    key = f"{kernels}/{attention}/{blas}/{at}" + ("+cache" if system.endswith("+cache") else "")
    scheme = system.split("@")[0].removesuffix("+cache")
    try:
        built = key.removesuffix("+cache")
        if built not in engines:
            engines[built] = (
                hf_model(cfg, device)
                if kernels == "hf"
                else engine_for(
                    cfg,
                    device,
                    kernels,
                    a.budget,
                    attention=attention,
                    fine={"coarse": None, "topq": TOP_QUARTER}.get(at, FINE),
                    blas=blas,
                    contiguous=at != "paged",
                    qkv_in_place=at != "copyv",
                    recompute=at != "pool",
                    residual_in_gemm=at != "noaddmm",
                    triton_norm=at != "finorm",
                    materialize=at != "nomat",
                    swiglu_gemm=at != "noswiglu",
                    fp8=FP8_SYSTEMS.get(at, ""),
                )
            )
        if key not in engines:  # the same model and runner, with a pool
            base = engines[built]
            mc = base.runner.model.config
            cache = PrefixCache.for_model(CACHE_GIB << 10, mc, base.runner.dtype, device)
            engines[key] = Engine(base.runner, base.tokenizer, base.config, cache=cache)
        if kernels == "hf":
            out = hf_system(engines[key], reqs, system == "hf_prefix", a.seconds)
        elif streamed and (w not in PRETOKENIZED or system.endswith("+cache")):
            out = streamed_system(engines[key], reqs, scheme, a.seconds, a.budget)
        else:
            out = engine_system(engines[key], reqs, scheme, a.seconds, a.budget, idle=idle)
    except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
        torch.cuda.empty_cache()
        return
    if "docs_s" in out:
        rec.setdefault("docs_s_rounds", []).append(out["docs_s"])
    rec |= out


def _row(r: dict) -> str:
    if "docs_s" not in r:
        why = r.get("error") or r.get("skipped", "?")
        return f"| {r['model']} | {r['workload']} | {r['system']} | {why} | | | | |"
    cells = [
        f"{r['docs_s']:,.0f}",
        f"{r.get('mfu', math.nan):.3f}",
        f"{r.get('idle_p50_ms', math.nan):.1f}",
        f"{r.get('idle_p95_ms', math.nan):.1f}",
        f"{r.get('idle_spaced_p50_ms', math.nan):.1f}",
        f"{r.get('peak_gib', math.nan):.1f}",
    ]
    return f"| {r['model']} | {r['workload']} | {r['system']} | " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
