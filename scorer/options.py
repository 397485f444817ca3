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
GPU_MIN_CACHE_READ_TOKENS = 1024
"""On the H200 a batch on the cache's pool pays ~1.1 ms + 0.07 ms per 1k rows for its paged reads
against the same batch off it, and a row of the 0.6B model's forward ~2 us (measured batches of
the 200 + 20 x 60 workload: 3 calls that hit, 576 rows saved, ran 3% slower than computing their
prompts; 3 of 11 calls that hit, 576 rows, 5.5% slower; 11 that hit, 2,112 rows, 6.5% faster): a
read pays from ~600-1,100 rows saved, more in larger batches. A lone 300-token-prompt call that
hits saves 300."""


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
