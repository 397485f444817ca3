"""The engine: tokenized requests -> plan -> forward passes -> label log-probs per item.

The engine owns the per-layer K/V: a single-pass plan uses each layer's own K/V as the page
pool; a multi-pass plan writes every pass's K/V into a pool so later passes read earlier ones.
Only the rows that score an item reach the LM head.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain

import numpy as np
import torch

from .attention.base import AttentionBackend
from .attention.kvpool import KVPool
from .models.decoder import DecoderLM
from .models.graphs import GraphedDecoder
from .planning import Plan, Shape, article_choice, check_plan, combine, planner
from .planning.split import split_to_budget
from .request import InvalidInput, Limits, ScoreRequest, Tokenized, tokenize

log = logging.getLogger(__name__)
AUTO_POLICIES = ("default", "calibrated", "article", "ragged")
MODEL_KERNELS = ("auto", "torch", "flashinfer")


@dataclass(frozen=True)
class EngineConfig:
    max_docs: int = 1024
    max_doc_tokens: int = 8192
    group_size: int = 8
    max_custom_mask_tokens: int = 32768
    max_tokens_per_pass: int = 0  # 0: no limit; a larger request is split, reusing its prompt's K/V
    auto_policy: str = "default"  # see auto_policy()
    cuda_graph_max_tokens: int = 16384  # CUDA only: passes up to this many tokens replay graphs; 0: eager
    model_kernels: str = "auto"  # see model_kernels()


@dataclass(frozen=True)
class DocScore:
    index: int
    id: str
    score: float
    label_logprobs: tuple[float, ...]
    doc_tokens: int
    truncated_tokens: int


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    doc_tokens: int
    tokens_computed: int
    tokens_saved: int


@dataclass(frozen=True)
class ScoreResult:
    results: tuple[DocScore, ...]  # in input order
    scheme: str
    usage: Usage


class Engine:
    def __init__(
        self,
        model: DecoderLM,
        tokenizer,
        backend: AttentionBackend,
        config: EngineConfig | None = None,
        model_name: str = "",
    ):
        self.model = model
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.backend = backend
        self.config = config or EngineConfig()
        self.device = next(model.parameters()).device
        mc = model.config
        self.limits = Limits(
            max_docs=self.config.max_docs,
            max_doc_tokens=self.config.max_doc_tokens,
            max_positions=mc.max_position_embeddings,
            vocab_size=mc.vocab_size,
        )
        self.stats: Counter = Counter()
        policy = auto_policy(self.config.auto_policy, backend.name, self.device.type)
        self._auto = lru_cache(maxsize=4096)(policy)
        kernels = model_kernels(self.config.model_kernels, backend.name, self.device.type)
        if kernels == "flashinfer" and not model.fused:
            model.use_fused_kernels()
        n = self.config.cuda_graph_max_tokens
        self.graphs = GraphedDecoder(model, n) if n > 0 and self.device.type == "cuda" else None

    def capture_graphs(self) -> float:
        """Capture the CUDA graphs of every token bucket (seconds taken; 0 without graphs). Until
        then every forward runs eagerly; so does every forward when the capture runs out of
        memory (logged: lower ``cuda_graph_max_tokens``)."""
        if self.graphs is None:
            return 0.0
        try:
            return self.graphs.warm_up()
        except torch.OutOfMemoryError as e:
            log.warning(
                "CUDA graphs up to %d tokens do not fit (%s); forwards run eagerly", self.graphs.max_tokens, e
            )
            self.graphs = None
            torch.cuda.empty_cache()
            return 0.0

    def tokenize(self, req: ScoreRequest) -> Tokenized:
        t = tokenize(req, self.tokenizer, self.limits)
        if self.resolve_scheme(t) == "custom_mask":
            shape, budget, cap = t.shape, self.config.max_tokens_per_pass, self.config.max_custom_mask_tokens
            largest = shape.num_tokens
            if budget and largest > budget:
                largest = max(budget, shape.prefix_len + max(shape.item_lens))
            if largest > cap:
                raise InvalidInput(
                    "options.scheme",
                    f"custom_mask over {largest} tokens exceeds its cap of {cap}; use multi_item",
                )
        return t

    def resolve(self, t: Tokenized) -> tuple[str, int]:
        """The concrete scheme of a request ("auto" resolved on its shape) and its group size
        (0 unless the scheme is ``grouped``)."""
        scheme = t.request.options.scheme or "auto"
        if scheme == "auto":
            scheme, group = self._auto(t.shape)
            if scheme == "grouped" and group:
                return scheme, group
        return scheme, (t.request.options.group_size or self.config.group_size) if scheme == "grouped" else 0

    def resolve_scheme(self, t: Tokenized) -> str:
        return self.resolve(t)[0]

    def num_tokens(self, t: Tokenized, scheme: str | None = None) -> int:
        """Tokens the request puts through the model under its (concrete) scheme."""
        shape = t.shape
        items = sum(shape.item_lens)
        n = len(shape.item_lens) if (scheme or self.resolve_scheme(t)) == "naive" else 1
        return shape.prefix_len * n + items

    def score(self, req: ScoreRequest) -> ScoreResult:
        return self.score_batch([self.tokenize(req)])[0]

    def plan(self, batch: Sequence[Tokenized]) -> tuple[Plan, list[int], list[str]]:
        """One plan for the batch: requests grouped by scheme; returns the plan, the request
        order inside it, and each request's concrete scheme."""
        keys = [self.resolve(t) for t in batch]
        schemes = [scheme for scheme, _ in keys]
        budget = self.config.max_tokens_per_pass
        if len(batch) == 1 and budget and self.num_tokens(batch[0], schemes[0]) > budget:
            scheme, group = keys[0]
            plan = split_to_budget(planner(scheme, group), scheme, batch[0].shape, budget, group)
            order = [0]
        else:
            parts, order = [], []
            for key in dict.fromkeys(keys):
                members = [i for i, k in enumerate(keys) if k == key]
                parts.append(planner(*key)([batch[i].shape for i in members]))
                order += members
            plan = combine(parts)
        check_plan(plan, self.config.max_custom_mask_tokens)
        return plan, order, schemes

    def score_batch(self, batch: Sequence[Tokenized]) -> list[ScoreResult]:
        return self.launch(batch)()

    @torch.inference_mode()
    def launch(self, batch: Sequence[Tokenized]) -> Callable[[], list[ScoreResult]]:
        """Start scoring a batch: plan it and queue all of its device work without waiting for
        the device. Returns the function that waits for the scores and returns the results, in
        batch order; a server starts the next batch before calling it, so that its planning
        overlaps this batch's forward."""
        plan, order, schemes = self.plan(batch)
        ordered = [batch[i] for i in order]
        ids, positions = logical_tokens(ordered, self.device)
        rows = self.forward(plan, ids, positions)
        labels = [t.label_ids for t in ordered for _ in t.items]
        picked = self._label_logprobs(rows, labels)
        done = None
        if picked.is_cuda:
            host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
            picked = host.copy_(picked, non_blocking=True)
            done = torch.cuda.Event()
            done.record()

        def collect() -> list[ScoreResult]:
            if done is not None:
                done.synchronize()
            return self._results(order, ordered, schemes, per_item(picked.tolist(), labels))

        return collect

    def _results(
        self,
        order: list[int],
        ordered: list[Tokenized],
        schemes: list[str],
        logprobs: list[tuple[float, ...]],
    ) -> list[ScoreResult]:
        """Each request's result, in batch order, from the label log-probs of every item in plan
        order."""
        results: list[ScoreResult | None] = [None] * len(order)
        at = 0
        for pos, t in zip(order, ordered, strict=True):
            n = len(t.items)
            results[pos] = self._result(t, schemes[pos], logprobs[at : at + n])
            at += n
        return results  # type: ignore[return-value]

    def forward(self, plan: Plan, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run every pass; returns the final hidden state of each item's last token, in plan order."""
        mc = self.model.config
        dtype = next(self.model.parameters()).dtype
        pool = KVPool(plan, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, self.device)
        per_pass = [[] for _ in plan.passes]
        for r, locs in enumerate(plan.items):
            for i, loc in enumerate(locs):
                per_pass[loc.pass_idx].append((r, i, loc.score_row))
        out: dict[tuple[int, int], torch.Tensor] = {}
        for pi, p in enumerate(plan.passes):
            self.backend.plan(p)
            logical = p.logical.to(self.device, non_blocking=True)

            def attn(layer, q, k, v, out=None, p=p):
                return self.backend.run(layer, q, *pool.write(layer, p, k, v), out=out)

            hidden = (self.graphs or self.model).forward_hidden(ids[logical], positions[logical], attn)
            score_rows = torch.tensor([row for _, _, row in per_pass[pi]], dtype=torch.long)
            score_rows = score_rows.to(self.device, non_blocking=True)
            for (r, i, _), h in zip(per_pass[pi], hidden[score_rows], strict=True):
                out[(r, i)] = h
            self.stats["forward_passes"] += 1
            self.stats["tokens_computed"] += p.num_rows
        self.stats["lm_head_rows"] += len(out)
        return torch.stack([out[(r, i)] for r, locs in enumerate(plan.items) for i in range(len(locs))])

    def _label_logprobs(self, rows: torch.Tensor, labels: list[tuple[int, ...]]) -> torch.Tensor:
        """Full-vocabulary log-probs of each item's label tokens, from its last hidden row, flat
        in item order (on the device, not waited for)."""
        logits = self.model.score_logits(rows).float()
        lse = torch.logsumexp(logits, dim=-1)
        item = [i for i, lab in enumerate(labels) for _ in lab]
        item = torch.tensor(item, dtype=torch.long).to(rows.device, non_blocking=True)
        label_ids = torch.tensor([x for lab in labels for x in lab], dtype=torch.long)
        label_ids = label_ids.to(rows.device, non_blocking=True)
        return logits[item, label_ids] - lse[item]

    def _result(self, t: Tokenized, scheme: str, logprobs: Sequence[tuple[float, ...]]) -> ScoreResult:
        mode = t.request.options.score_mode or "softmax"
        results = []
        for i, lps in enumerate(logprobs):
            score = lps[0] if mode == "logprob" else math.exp(lps[0] - _logsumexp(lps))
            doc = t.request.docs[i]
            results.append(DocScore(i, doc.id, score, lps, t.doc_tokens[i], t.truncated[i]))
        computed = self.num_tokens(t, scheme)
        every_doc_alone = self.num_tokens(t, "naive")
        usage = Usage(len(t.prefix_ids), sum(t.doc_tokens), computed, every_doc_alone - computed)
        return ScoreResult(tuple(results), scheme, usage)


def model_kernels(name: str, backend: str, device_type: str) -> str:
    """Kernels of the model's elementwise work: ``torch`` (HF's op order and rounding) or
    ``flashinfer`` (fused norm, RoPE, SiLU-and-mul); ``auto`` takes FlashInfer's with FlashInfer
    attention on CUDA."""
    if name not in MODEL_KERNELS:
        raise ValueError(f"unknown model kernels {name!r}; expected one of {', '.join(MODEL_KERNELS)}")
    if name == "auto":
        return "flashinfer" if backend == "flashinfer" and device_type == "cuda" else "torch"
    return name


def auto_policy(name: str, backend: str, device_type: str) -> Callable[[Shape], tuple[str, int]]:
    """How ``auto`` picks. ``calibrated``: the cost model fitted to FlashInfer on the H200;
    ``article``: the article's section 5.3 guide; ``ragged``: always ragged, the measured choice
    of the torch backend on the CPU (``python -m bench.cpu_schemes``: fastest or within 3 ms of it
    at 1-20 docs, while naive is the slowest everywhere). ``default`` takes the calibrated model
    on FlashInfer, ragged on the CPU, and the article's guide for the torch backend on a GPU."""
    if name not in AUTO_POLICIES:
        raise ValueError(f"unknown auto policy {name!r}; expected one of {', '.join(AUTO_POLICIES)}")
    if name == "default":
        name = "calibrated" if backend == "flashinfer" else "ragged" if device_type == "cpu" else "article"
    if name == "calibrated":
        from .planning.cost_model import calibrated_choice

        return calibrated_choice
    if name == "ragged":
        return lambda shape: ("ragged", 0)
    return lambda shape: (article_choice(shape), 0)


def logical_tokens(batch: Sequence[Tokenized], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions of the batch's logical token space (see planning.base): each
    request's prefix at positions 0.., then each of its items at positions P.. (vectorised: a
    serving batch holds ~15k tokens)."""
    chunks = [c for t in batch for c in (t.prefix_ids, *t.items)]
    starts = [s for t in batch for s in (0, *(len(t.prefix_ids),) * len(t.items))]
    lens = np.fromiter(map(len, chunks), dtype=np.int64, count=len(chunks))
    ids = np.fromiter(chain.from_iterable(chunks), dtype=np.int64, count=int(lens.sum()))
    first = np.cumsum(lens) - lens  # index of each chunk's first token
    pos = np.arange(len(ids), dtype=np.int64) - np.repeat(first - np.asarray(starts, dtype=np.int64), lens)
    return (
        torch.from_numpy(ids).to(device, non_blocking=True),
        torch.from_numpy(pos).to(device, non_blocking=True),
    )


def per_item(flat: Sequence[float], labels: Sequence[tuple[int, ...]]) -> list[tuple[float, ...]]:
    """Cut the flat label log-probs of a batch into one tuple per item."""
    out, at = [], 0
    for lab in labels:
        out.append(tuple(flat[at : at + len(lab)]))
        at += len(lab)
    return out


def _logsumexp(xs: Sequence[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))
