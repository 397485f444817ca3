"""The engine: tokenize -> plan the batch -> run the model -> read out.

``tokenize`` turns a request into a ``Job`` (validated, its scheme resolved once); ``launch``
plans a batch of jobs, queues all of its device work on the model runner and returns the
function that waits for the scores.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from . import readout
from .devices import to_device
from .lazy_torch import torch
from .options import GPU_MIN_CACHE_READ_ROWS_PER_TOKEN, GPU_MIN_CACHE_READ_TOKENS, MAX_DOC_TOKENS, MAX_DOCS
from .planning import AUTO, Plan, PlanError, Scheme, Shape, get, plan_batch
from .planning.cached import on_pool, with_pool_copies
from .planning.choose import auto_policy
from .planning.schemes import DEFAULT_GROUP_SIZE
from .prefix_cache import Lease, PoolFull, PrefixCache
from .readout import DocScore, ScoreResult, Usage
from .request import (
    MAX_DOC_BYTES,
    MAX_REQUEST_BYTES,
    TEMPLATES,
    Job,
    Limits,
    Prompting,
    ScoreHead,
    ScoreOptions,
    ScoreRequest,
    fast_backends,
    load_template,
    tokenize,
)
from .token_ids import TokenIds
from .tokenizer import TokenizerSpec

if TYPE_CHECKING:  # the runner brings the models and transformers, which a front end never needs
    from .runner import ModelRunner

log = logging.getLogger(__name__)

__all__ = [
    "DocScore",
    "Engine",
    "EngineConfig",
    "EngineInfo",
    "Tokenizing",
    "ScoreResult",
    "Usage",
    "logical_tokens",
]


@dataclass(frozen=True)
class EngineConfig:
    max_docs: int = MAX_DOCS
    max_doc_tokens: int = MAX_DOC_TOKENS
    group_size: int = DEFAULT_GROUP_SIZE
    max_custom_mask_tokens: int = 32768
    max_tokens_per_pass: int = 0  # 0: no limit; a larger request is split, reusing its prompt's K/V
    prompt_recompute_share: float | None = None
    """A split request computes its prompt again in each pass (no K/V pool, no copies) where that
    adds at most this share of its rows; None: what the copies cost on the model (``copy_share``),
    0: never."""
    auto_policy: str = "default"  # see planning.choose.auto_policy
    max_doc_bytes: int = MAX_DOC_BYTES
    max_request_bytes: int = MAX_REQUEST_BYTES
    min_cache_read_tokens: int | None = None
    """A batch reads prompt K/V from the prefix cache only where that saves at least this many
    rows of its forward; a batch whose hits save fewer computes its prompts (and writes the blocks
    it was to write). None: on a GPU ``GPU_MIN_CACHE_READ_TOKENS`` plus one per
    ``GPU_MIN_CACHE_READ_ROWS_PER_TOKEN`` rows of the batch, 0 (every hit read) elsewhere."""
    template: str = ""  # the template of a call that names none ("": ScoreOptions.template's)
    template_file: str = ""  # a team's own template (request.load_template), the default unless ``template``
    score_label: str = ""
    """A score head's relevant label: an index, or a name of the config's id2label; "": the last."""


@dataclass(frozen=True)
class EngineInfo:
    """What tokenizing needs of an engine, so that a process without the model (a front end of
    ``scorer serve --frontends N``) turns a request into the same Job as the engine would."""

    model_name: str
    model_dir: str  # its tokenizer
    config: EngineConfig
    max_positions: int
    vocab_size: int
    backend: str  # the attention backend and device type: ``auto``'s policy
    device_type: str
    device: str = ""  # the model's device, e.g. ``cuda:0``
    max_batch_tokens: int = 0  # the serving batcher's (0: no batcher, an engine alone)
    head: ScoreHead | None = None  # the model's score head; None: the LM head
    sliding_window: int = 0  # the model's sliding window, where it bounds max_positions
    tokenizer: TokenizerSpec | None = field(default=None, repr=False)  # for a front end: a fast one's

    @property
    def head_kind(self) -> str:
        """What /info reports: ``lm`` (label tokens of the LM head) or the score head."""
        return "lm" if self.head is None else self.head.describe()


class Tokenizing:
    """Requests into Jobs: validation, the tokenizer, the limits and ``auto``'s choice."""

    cache: PrefixCache | None = None

    def __init__(self, tokenizer, info: EngineInfo) -> None:
        self.tokenizer = tokenizer
        fast_backends(tokenizer)  # copied now, not on the first text call
        self.info = info
        self.model_name = info.model_name
        self.config = c = info.config
        self.limits = Limits(
            max_docs=c.max_docs,
            max_doc_tokens=c.max_doc_tokens,
            max_positions=info.max_positions,
            vocab_size=info.vocab_size,
            max_doc_bytes=c.max_doc_bytes,
            max_request_bytes=c.max_request_bytes,
            sliding_window=info.sliding_window if info.sliding_window == info.max_positions else 0,
        )
        self.auto = lru_cache(maxsize=4096)(auto_policy(c.auto_policy, info.backend, info.device_type))
        self.prompting = prompting(c, info.head)

    def tokenize(self, req: ScoreRequest, cancelled: Callable[[], bool] | None = None) -> Job:
        """``req`` as a Job (see request.tokenize); ``cancelled`` stops it between docs."""
        c = self.config
        return tokenize(
            req,
            self.tokenizer,
            self.limits,
            self.resolve,
            c.max_tokens_per_pass,
            c.max_custom_mask_tokens,
            cancelled,
            self.peek if self.cache is not None else None,
            self.prompting,
        )

    def peek(self, prefix: tuple[int, ...], options: ScoreOptions) -> tuple[int, tuple]:
        """Prompt tokens of ``prefix`` the prefix cache holds now, for this call's options, and
        their blocks (see ``PrefixCache.peek``)."""
        if self.cache is None or options.prefix_cache == "off":
            return 0, ()
        return self.cache.peek(prefix, options.cache_salt)

    def resolve(self, shape: Shape, options: ScoreOptions) -> tuple[Scheme, int]:
        """The concrete scheme of a request (``auto`` resolved on its shape) and its group size
        (0 unless the scheme takes one)."""
        name = options.scheme or AUTO
        if name == AUTO:
            name, group = self.auto(shape)
            if group:
                return get(name), group
        scheme = get(name)
        return scheme, (options.group_size or self.config.group_size) if scheme.grouped else 0


class Engine(Tokenizing):
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer,
        config: EngineConfig | None = None,
        model_name: str = "",
        cache: PrefixCache | None = None,
        model_dir: str = "",
    ):
        mc = runner.model.config
        config = config or EngineConfig()
        info = EngineInfo(
            model_name,
            model_dir,
            config,
            mc.max_positions,
            mc.vocab_size,
            runner.backend.name,
            runner.device.type,
            str(runner.device),
            head=score_head(mc, config.score_label),
            sliding_window=mc.sliding_window,
            tokenizer=TokenizerSpec.of(tokenizer),
        )
        super().__init__(tokenizer, info)
        self.runner = runner
        self.cache = cache
        least = self.config.min_cache_read_tokens
        on_gpu = runner.device.type == "cuda"
        self.min_cache_read = (GPU_MIN_CACHE_READ_TOKENS if on_gpu else 0) if least is None else least
        self.min_cache_read_rows = GPU_MIN_CACHE_READ_ROWS_PER_TOKEN if on_gpu and least is None else 0
        """Rows of a batch (computed whole) that raise ``min_cache_read`` by one; 0: never."""
        share = self.config.prompt_recompute_share
        self.recompute_share = copy_share(mc) if share is None else share

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def peeked(self, job: Job, seen: tuple[int, tuple] | None = None) -> Job:
        """``job``, tokenized where the prefix cache is not (a front-end process), with what the
        cache holds of its prompt now (``seen``: that peek, made already): ``auto`` decides on the
        cached shape, as it would here."""
        cached, hint = seen or self.peek(job.prefix_ids, job.options)
        if not cached:
            return job
        shape = replace(job.shape, cached=cached)
        scheme, group = self.resolve(shape, job.options)
        try:
            scheme.check(shape, self.config.max_tokens_per_pass, self.config.max_custom_mask_tokens)
        except PlanError:
            return job
        return replace(
            job, shape=shape, scheme=scheme, group_size=group, tokens=scheme.rows(shape), cache_hint=hint
        )

    def repeeked(self, job: Job) -> Job:
        """``peeked`` again for a queued job of which the cache held less than its whole prompt
        (``PrefixCache.peek`` leaves the last block to compute) when it arrived: calls queued
        behind their prompt's first call, which indexes the prompt's blocks when its batch is
        planned, count their uncached rows against the batch budget and run the cached shape's
        scheme. The same job when nothing more is cached."""
        s = job.shape
        if job.options.prefix_cache == "off" or s.prefix_len - s.cached <= self.cache.block:
            return job
        seen = self.peek(job.prefix_ids, job.options)
        return job if seen[0] <= s.cached else self.peeked(job, seen)

    def plan(self, jobs: Sequence[Job], cached: Sequence[int] | None = None) -> Plan:
        """One checked plan for the batch (see ``planning.plan_batch``); ``cached`` (a plan for
        the prefix cache's pool): the prompt tokens of each job read from the cache, left out of
        the plan (see ``on_pool``). On the pool every pass's K/V is written to it, so a split
        request never computes its prompt again there."""
        c = self.config
        share = self.recompute_share if cached is None else 0.0
        cached = cached or [0] * len(jobs)
        shapes = [
            j.shape if not (n or j.shape.cached) else Shape(j.shape.prefix_len - n, j.shape.item_lens)
            for j, n in zip(jobs, cached, strict=True)
        ]
        return plan_batch(
            [(s, j.scheme, j.group_size) for s, j in zip(shapes, jobs, strict=True)],
            c.max_tokens_per_pass,
            c.max_custom_mask_tokens,
            share,
        )

    def score(self, req: ScoreRequest) -> ScoreResult:
        return self.score_batch([self.tokenize(req)])[0]

    def score_batch(self, jobs: Sequence[Job]) -> list[ScoreResult]:
        return self.launch(jobs)()

    def launch(self, jobs: Sequence[Job]) -> Callable[[], list[ScoreResult]]:
        """Start scoring a batch: plan it and queue all of its device work without waiting for
        the device. Returns the function that waits for the scores and returns the results, in
        batch order; a server starts the next batch before calling it, so that its planning
        overlaps this batch's forward."""
        with torch.inference_mode():
            return self._launch(jobs)

    def _launch(self, jobs: Sequence[Job]) -> Callable[[], list[ScoreResult]]:
        plan, lease, cached = self._plan_on_cache(jobs)
        ordered = [jobs[i] for i in plan.requests]
        try:
            ids, positions = logical_tokens(ordered, self.device, cached)
            rows = self.runner.forward(plan, ids, positions, self.cache)
            picked = readout.label_logprobs(self.runner.model, rows, ordered)
            done = None
            if picked.is_cuda:
                host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
                picked = host.copy_(picked, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
        except BaseException:
            if lease is not None:
                lease.abort()
            raise

        def collect() -> list[ScoreResult]:
            try:
                if done is not None:
                    done.synchronize()
            finally:
                if lease is not None:
                    lease.release()
            # a lone request's plan may compute more than its scheme's rows (a split recomputing
            # its prompt): its usage counts the rows the passes ran
            computed = [plan.num_slots] if len(plan.requests) == 1 else ()
            return readout.results(ordered, plan.requests, picked.tolist(), cached, computed)

        return collect

    def _plan_on_cache(self, jobs: Sequence[Job]) -> tuple[Plan, Lease | None, list[int]]:
        """The batch's plan, the lease it holds of the prefix cache and each planned request's
        cached prompt tokens (plan order). Off the cache (no lease, nothing cached) when no call
        of the batch uses it, reads it or is admitted to write it (see ``prefix_cache``), or the
        batch does not fit the pool beside the batches in flight; a batch that writes the cache
        and reads nothing of it, or whose hits save too few rows to be worth the pool's paged
        reads (``_declines``), plans off the pool and copies the rows it writes
        (``with_pool_copies``)."""
        use = [self.cache is not None and j.options.prefix_cache != "off" for j in jobs]
        if not any(use):
            return self.plan(jobs), None, []
        prompts = [
            (j.prefix_ids, j.options.cache_salt, j.cache_hint) if u else None
            for j, u in zip(jobs, use, strict=True)
        ]
        hits, lease = self.cache.reserve(prompts)
        if not any(h.num_cached or len(h.insert) for h in hits):  # prompts seen once: nothing to share
            lease.release()
            return self.plan(jobs), None, []
        try:
            if not any(h.num_cached for h in hits) or self._declines(jobs, hits):
                plan = self.plan(jobs)  # it only writes: attention off the pool
                return with_pool_copies(plan, [hits[i] for i in plan.requests]), lease, []
            plan = self.plan(jobs, [h.num_cached for h in hits])
            hits = [hits[i] for i in plan.requests]
            return on_pool(plan, hits, lease.alloc_scratch), lease, [h.num_cached for h in hits]
        except PoolFull:
            lease.abort()
            self.cache.stats["off_pool_batches"] += 1
            return self.plan(jobs), None, []
        except BaseException:
            lease.abort()
            raise

    def _declines(self, jobs: Sequence[Job], hits) -> bool:
        """Do the batch's hits save too few rows to be read (``min_cache_read``, plus one per
        ``min_cache_read_rows`` rows of the batch computed whole)? Then it computes
        its prompts, unless that takes it over the token budget of a pass (the batcher filled it by
        the rows left to compute: a declined read would cost a pass more), or a scheme cannot take
        a whole prompt (``auto`` chose it on the cached shape, its custom mask within the cap)."""
        full = [Shape(j.shape.prefix_len, j.shape.item_lens) for j in jobs]
        rows = [j.scheme.rows(f) for j, f in zip(jobs, full, strict=True)]
        saved = sum(
            n - j.scheme.rows(replace(f, cached=h.num_cached))
            for j, f, h, n in zip(jobs, full, hits, rows, strict=True)
            if h.num_cached
        )
        c, whole = self.config, sum(rows)
        least = self.min_cache_read + (whole // self.min_cache_read_rows if self.min_cache_read_rows else 0)
        if saved >= least or 0 < c.max_tokens_per_pass < whole:
            return False
        try:
            for j, f in zip(jobs, full, strict=True):
                j.scheme.check(f, c.max_tokens_per_pass, c.max_custom_mask_tokens)
        except PlanError:
            return False
        self.cache.declined(sum(h.num_cached for h in hits))
        return True


def prompting(c: EngineConfig, head: ScoreHead | None) -> Prompting:
    """The templates (the built-ins, ``c.template_file``'s), the default one and the head; a bad
    template file or name raises ValueError naming it."""
    templates = dict(TEMPLATES)
    default = ScoreOptions.template
    if c.template_file:
        own = load_template(c.template_file)
        templates[own.name] = own
        default = own.name
    if c.template:
        if c.template not in templates:
            raise ValueError(f"unknown template {c.template!r}; expected one of {', '.join(templates)}")
        default = c.template
    return Prompting(templates, default, head)


def score_head(mc, label: str = "") -> ScoreHead | None:
    """The model's score head (None: an LM head) with its relevant label: ``label`` an index
    (negative from the end) or a name of the config's id2label, "" the last; ValueError otherwise."""
    if not mc.num_labels:
        if label:
            raise ValueError(f"score label {label!r}: {mc.architecture} has an LM head, no score head")
        return None
    n = mc.num_labels
    names = {str(v): int(k) for k, v in (getattr(mc.hf_config, "id2label", None) or {}).items()}
    if not label:
        index = n - 1
    elif label in names:
        index = names[label]
    else:
        try:
            index = int(label)
        except ValueError:
            index = n  # neither: refused below
        if not -n <= index < n:
            raise ValueError(
                f"score label {label!r} is not a label of the score head ({n} outputs: 0-{n - 1}"
                f" or one of {', '.join(sorted(names, key=names.get))})"
            )
    return ScoreHead(mc.architecture, n, index % n)


FLOPS_PER_BYTE = 165.0
"""An H200's bf16 GEMM rate over its memory bandwidth as measured here (~711 TFLOP/s, 4.3 TB/s):
what a byte moved costs in FLOPs of compute (an A100's is ~150; the share below is a bound to
within a factor, not a fit)."""


def copy_share(mc) -> float:
    """What copying a split request's K/V into its pool costs, in rows of forward per row: two
    copies a layer of ``kv`` values, each read and written, against the layer's GEMMs
    (``2 * params`` FLOPs a row). Qwen3-0.6B: 0.043 (measured: 1.7 ms of C's 43 ms); 8B: 0.003."""
    q, kv, h = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.hidden_size
    params = h * (q + 2 * kv) + q * h + 3 * h * mc.intermediate_size
    return 2 * 2 * kv * 2 * FLOPS_PER_BYTE / (2 * params)


def _concat_ids(chunks: Sequence[Sequence[int]]) -> np.ndarray:
    """The chunks' ids end to end as int64: a ``TokenIds`` (a long prompt) copied as its array,
    each run of short tuples (docs) read in one pass (an 8,000-id prompt read id by id cost ~0.4
    ms on a 2-core VM)."""
    parts, run = [], []
    for c in chunks:
        if isinstance(c, TokenIds):
            if run:
                parts.append(np.fromiter(chain.from_iterable(run), dtype=np.int64))
                run = []
            parts.append(c.array)
        else:
            run.append(c)
    if run:
        parts.append(np.fromiter(chain.from_iterable(run), dtype=np.int64))
    return np.concatenate(parts, dtype=np.int64, casting="unsafe") if parts else np.zeros(0, np.int64)


def logical_tokens(
    batch: Sequence[Job], device, cached: Sequence[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions of the batch's logical token space (see planning.base): each
    request's prefix at positions 0.. (``cached[r]``.. when its first tokens come from the prefix
    cache), then each of its items at positions P.. (vectorised: a serving batch holds ~15k
    tokens)."""
    cached = cached or [0] * len(batch)
    chunks = [c for t, n in zip(batch, cached, strict=True) for c in (t.prefix_ids[n:], *t.items)]
    starts = [
        s for t, n in zip(batch, cached, strict=True) for s in (n, *(len(t.prefix_ids),) * len(t.items))
    ]
    lens = np.fromiter(map(len, chunks), dtype=np.int64, count=len(chunks))
    ids = _concat_ids(chunks)
    first = np.cumsum(lens) - lens  # index of each chunk's first token
    pos = np.arange(len(ids), dtype=np.int64) - np.repeat(first - np.asarray(starts, dtype=np.int64), lens)
    return to_device(torch.from_numpy(ids), device), to_device(torch.from_numpy(pos), device)
