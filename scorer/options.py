"""The values that settings and request options take, and their defaults, without torch: the
command line builds its parser from these, so ``scorer --help`` and an argument error answer
before the model stack (torch, transformers) is imported. The modules that act on a value
(attention, runtime, engine, prefix_cache, planning.choose, request) import it from here."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "torch", "flashinfer")
FALLBACKS = ("none", "torch")
MODEL_KERNELS = ("auto", "torch", "flashinfer", "fused")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "fp8")  # of the decoder's linear layers (models/quant.py)

SCORE_MODES = ("softmax", "logprob", "raw", "sigmoid")
TEMPLATE_NAMES = ("plain", "qwen3_reranker", "bge_reranker_gemma", "mxbai_rerank_v2")
"""The built-in prompt templates (request.TEMPLATES), named here so the parser is built without them."""
RAW_MODES = ("raw", "sigmoid")  # read the labels' logits, not log-probs over the vocabulary
TRUNCATE_MODES = ("error", "doc_end")
DOC_SPECIAL_TOKENS = ("parse", "text")  # the choices of special_tokens and doc_special_tokens
PREFIX_CACHE_MODES = ("off",)  # the choices of prefix_cache besides "" (use the cache)
MAX_DOCS = 1024  # documents per call
MAX_DOC_TOKENS = 8192  # tokens per document
MAX_DOC_BYTES = 1 << 20  # UTF-8 bytes of one doc's text
MAX_REQUEST_BYTES = 16 << 20  # of the prompt, instruction and every doc's text

CPU_AUTO_MIB = 64
"""``--prefix-cache-mib auto`` on the CPU."""
GPU_AUTO_SHARE = 0.4
"""``--prefix-cache-mib auto`` on a GPU: this share of the memory free after the model loaded
(the rest is left to activations, CUDA graphs and the K/V of plans off the cache)."""
GPU_MIN_CACHE_READ_TOKENS = 420
GPU_MIN_CACHE_READ_ROWS_PER_TOKEN = 22
"""On a GPU a batch reads its hits from the prefix cache where they save at least
``GPU_MIN_CACHE_READ_TOKENS`` rows plus one per ``GPU_MIN_CACHE_READ_ROWS_PER_TOKEN`` rows of the
batch computed whole: a batch on the pool pays ~1.1 ms + 0.07 ms per 1k rows for its paged reads,
and a row's forward costs less in a larger batch, so a read pays from more rows saved there. On the
H200 (bench/RESULTS.md, the prefix cache; Qwen3-0.6B): batches of 850-1,700 rows read faster from
between 352 and 576 rows saved; 3 E calls (4,200 rows) saving 576 ran 3% slower read; 11 (15,400
rows) saving 576 5.5% slower, saving 2,112 6.5% faster. 420 + rows / 22 lies within each: 459 at
850 rows, 493 at 1,600, 611 at 4,200, 1,120 at 15,400. A lone 300-token-prompt call that hits
saves 300."""


@dataclass(frozen=True)
class ScoreOptions:
    scheme: str = "auto"
    template: str = "qwen3_reranker"
    label_tokens: tuple[str, ...] = ()  # (): the default labels, yes and no
    label_token_ids: tuple[int, ...] = ()
    score_mode: str = ""
    """"": the template's (softmax for most); softmax: P(label 0) over the labels; logprob: log P(label 0)
    over the vocabulary (a score head's outputs); raw: label 0's logit; sigmoid: its sigmoid."""
    truncate: str = "error"
    max_doc_tokens: int = 0  # 0: the engine's limit
    group_size: int = 0  # for ``grouped``; 0: the engine's default
    doc_special_tokens: str = ""  # docs only: "" (special_tokens'), parse or text
    special_tokens: str = ""  # every caller text: "" (parse), parse or text (control tokens stay text)
    top_n: int = 0  # 0: every doc in input order; n: the best n by score, ties in input order
    return_label_logprobs: bool = False  # the answer carries each doc's label log-probs
    prefix_cache: str = ""  # "": read and write the prefix cache; "off": neither
    cache_salt: str = ""  # calls with different salts never share cached K/V
