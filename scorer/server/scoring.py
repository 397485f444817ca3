"""The scoring service behind any front end: tokenize off the loop, batch, forward, count.

It knows engine types only (no protobuf, no gRPC), so every front end shares it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from .. import metrics
from ..engine import Engine, EngineInfo, ScoreResult, Tokenizing
from ..lazy_torch import torch
from ..planning import REGISTRY
from ..request import Doc, Job, ScoreOptions, ScoreRequest
from ..token_ids import TokenIds
from .batcher import Batcher, BatchPolicy, Scored, ScoreFn
from .debug import DebugKnobs, with_faults, with_tokenize_delay

log = logging.getLogger(__name__)
TOKENIZER_THREADS = min(4, os.cpu_count() or 1)
INLINE_IDS = 4096
"""A call of token ids and no text that costs at most this many ids to check (``_id_cost``) is
validated on the event loop: about 0.1 ms for 800 ids, where handing it to a tokenizer thread and
back costs an idle server 0.4-0.7 ms (measured on the H200 machine, ``bench.light_load``)."""
DOC_IDS = 32
"""What a doc costs to check besides its ids, in ids checked one by one (on a 2-core VM: 8 us a
doc of 4 ids, ~0.25 us an id)."""
ARRAY_SHARE = 8
"""A message's long id list (TokenIds) costs 1/ARRAY_SHARE of a tuple's per id, or less: numpy
checks it (10 us for 8,000 ids on a 2-core VM, against 300 one by one)."""


def _id_cost(ids) -> int:
    return len(ids) // ARRAY_SHARE if isinstance(ids, TokenIds) else len(ids)


def _inline(req: ScoreRequest) -> bool:
    if req.prompt or req.instruction or any(d.text for d in req.docs):
        return False
    cost = _id_cost(req.prompt_token_ids) + sum(_id_cost(d.token_ids) + DOC_IDS for d in req.docs)
    return cost <= INLINE_IDS


class TokenizingService:
    """Tokenizing off the event loop, on a few threads; ``score`` is the subclass's."""

    def __init__(self, engine: Tokenizing, knobs: DebugKnobs | None = None) -> None:
        self.engine = engine
        self._tokenize = engine.tokenize
        self._inline = _inline
        if knobs is not None and knobs.tokenize_delay_s:
            self._tokenize = with_tokenize_delay(engine.tokenize, knobs.tokenize_delay_s)
            self._inline = lambda req: False
        # several threads (the tokenizer releases the GIL): one call's large docs do not hold the others
        self._tokenizers = ThreadPoolExecutor(max_workers=TOKENIZER_THREADS, thread_name_prefix="tokenize")

    async def close(self) -> None:
        self._tokenizers.shutdown(wait=True)

    @property
    def info(self) -> EngineInfo:
        """The engine being served (what /info reports), the same in a front-end process."""
        return self.engine.info

    async def tokenize(self, req: ScoreRequest) -> tuple[Job, float]:
        """Validate, tokenize and resolve on a tokenizer thread; raises InvalidInput naming the
        field. A call cancelled meanwhile (its client gone, its deadline passed) stops tokenizing
        at its next doc. A small call of token ids (by the work of checking them, ``INLINE_IDS``:
        an 8,000-id prompt with 32 short docs is one) is checked here, on the loop."""
        started = time.monotonic()
        job = self._tokenize(req) if self._inline(req) else await self._off_loop(req)
        seconds = time.monotonic() - started
        metrics.STAGE_DURATION.labels(stage="tokenize").observe(seconds)
        return job, seconds

    async def _off_loop(self, req: ScoreRequest) -> Job:
        loop = asyncio.get_running_loop()
        gone = threading.Event()
        work = loop.run_in_executor(self._tokenizers, self._tokenize, req, gone.is_set)
        work.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved if nobody waits
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            gone.set()
            raise

    async def score(self, job: Job, deadline: float | None, request_id: str) -> Scored:
        raise NotImplementedError


class ScoringService(TokenizingService):
    """Tokenize, batch and score in this process: the engine's own."""

    engine: Engine

    def __init__(self, engine: Engine, policy: BatchPolicy, knobs: DebugKnobs | None = None) -> None:
        super().__init__(engine, knobs)
        score: ScoreFn = self._score_counting_passes
        if knobs is not None and knobs.active:
            log.warning("test knobs active: %s", knobs)
            score = with_faults(score, knobs)
        self.batcher = Batcher(score, policy, refresh=engine.repeeked if engine.cache is not None else None)

    @property
    def info(self) -> EngineInfo:
        return replace(self.engine.info, max_batch_tokens=self.batcher.policy.max_batch_tokens)

    def start(self) -> None:
        self.batcher.start()

    async def close(self) -> None:
        await self.batcher.close()
        await super().close()

    async def score(self, job: Job, deadline: float | None, request_id: str) -> Scored:
        scored = await self.batcher.submit(job, deadline, request_id)
        usage = scored.result.usage
        metrics.observe_usage(scored.result.scheme, len(job.items), usage.tokens_computed, usage.tokens_saved)
        return scored

    def _score_counting_passes(self, batch: Sequence[Job]) -> Callable[[], list[ScoreResult]]:
        stats = self.engine.runner.stats
        before = stats["forward_passes"]
        try:
            return self.engine.launch(batch)
        finally:
            metrics.FORWARD_PASSES.inc(stats["forward_passes"] - before)


def warm_up(engine: Engine) -> None:
    """Score a small request with every scheme once, so no call pays for first-use setup."""
    docs = (Doc("warm-up document", "a"), Doc("another warm-up document", "b"))
    for scheme in REGISTRY:
        # template "": the server's default (--template, --template-file), with its labels
        engine.score(ScoreRequest("warm-up query", docs, options=ScoreOptions(scheme=scheme, template="")))


def process_age_s() -> float:
    """Seconds since this process started (Linux's /proc; 0 elsewhere): how long a server took to
    serve, imports and the interpreter's start included."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    except (OSError, IndexError, ValueError):
        return 0.0
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")


def freeze_heap(role: str) -> None:
    """Collect once, then put every object alive now (modules, model, tokenizer, warm-up plans)
    out of the cyclic collector's reach (``gc.freeze``, as vLLM and SGLang do after warm-up): a
    full collection of a server's heap scans ~350k objects (170 ms on a 2-core VM; bench/RESULTS.md,
    What did not pay) and stalls every call in flight; frozen, a collection scans only
    what was allocated since. Call it when a process has loaded what it serves with; from then on
    the collector's pauses are timed into ``scorer_gc_pause_seconds`` under ``role``."""
    gc.collect()
    gc.freeze()
    _time_gc(role)


GC_DRAIN_S = 1.0
"""How often the collector's timed pauses reach ``scorer_gc_pause_seconds``."""


def _time_gc(role: str) -> None:
    """Time each collection of this process into GC_PAUSE (once per process and role). The
    collector calls back at any allocation, also inside a metric's update holding its
    (non-reentrant) lock: the callback only appends to a deque (atomic, no lock), and a thread of
    its own moves the pauses into the histogram."""
    if any(getattr(cb, "role", None) == role for cb in gc.callbacks):
        return
    started: dict[int, float] = {}
    pauses: deque[tuple[int, float]] = deque(maxlen=100_000)

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[info["generation"]] = time.perf_counter()
        elif (began := started.pop(info["generation"], None)) is not None:
            pauses.append((info["generation"], time.perf_counter() - began))

    def drain() -> None:
        while True:
            time.sleep(GC_DRAIN_S)
            while pauses:
                generation, seconds = pauses.popleft()
                metrics.GC_PAUSE.labels(process=role, generation=str(generation)).observe(seconds)

    on_gc.role = role
    gc.callbacks.append(on_gc)
    threading.Thread(target=drain, name=f"gc-pauses-{role}", daemon=True).start()


def ready_engine(settings, role: str = "server") -> Engine:
    """Build the engine from ``settings``, warm every scheme up, freeze the heap (``role``: the
    process's, for ``scorer_gc_pause_seconds``) and label ``scorer_model_info``: what a server
    (standalone or a Ray replica) does before it reports SERVING."""
    engine = settings.build_engine()
    if engine.device.type == "cuda" and settings.host_threads:
        torch.set_num_threads(settings.host_threads)
    engine.runner.capture_graphs(engine.cache)
    warm_up(engine)
    freeze_heap(role)
    runner = engine.runner
    metrics.MODEL_INFO.labels(
        model=engine.model_name,
        attention_backend=runner.backend.name,
        attention_requested=settings.attention_backend,
        device=str(runner.device),
        dtype=str(runner.dtype).removeprefix("torch."),
    ).set(1)
    return engine
