"""The scoring service behind any front end: tokenize off the loop, batch, forward, count.

It knows engine types only (no protobuf, no gRPC), so a Ray deployment can wrap it as is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from .. import metrics
from ..engine import Engine, EngineConfig, ScoreResult
from ..planning import PLANNERS
from ..request import Doc, ScoreOptions, ScoreRequest, Tokenized
from ..runtime import build_engine
from .batcher import Batcher, BatchPolicy, Scored, ScoreFn
from .debug import DebugKnobs, with_faults

log = logging.getLogger(__name__)


class ScoringService:
    def __init__(self, engine: Engine, policy: BatchPolicy, knobs: DebugKnobs | None = None) -> None:
        self.engine = engine
        score: ScoreFn = self._score_counting_passes
        if knobs is not None and knobs.active:
            log.warning("test knobs active: %s", knobs)
            score = with_faults(score, knobs, self.count_tokens)
        self.batcher = Batcher(score, self.count_tokens, policy)
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    def start(self) -> None:
        self.batcher.start()

    async def close(self) -> None:
        await self.batcher.close()
        self._tokenizer_thread.shutdown(wait=True)

    def count_tokens(self, t: Tokenized) -> int:
        """What a call counts against the batch token budget."""
        return self.engine.num_tokens(t)

    def scheme(self, t: Tokenized) -> str:
        return self.engine.resolve_scheme(t)

    async def tokenize(self, req: ScoreRequest) -> tuple[Tokenized, float]:
        """Validate and tokenize on the tokenizer thread; raises InvalidInput naming the field."""
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        tokenized = await loop.run_in_executor(self._tokenizer_thread, self.engine.tokenize, req)
        seconds = time.monotonic() - started
        metrics.STAGE_DURATION.labels(stage="tokenize").observe(seconds)
        return tokenized, seconds

    async def score(self, t: Tokenized, deadline: float | None, request_id: str) -> Scored:
        scored = await self.batcher.submit(t, deadline, request_id)
        usage = scored.result.usage
        metrics.observe_usage(scored.result.scheme, len(t.items), usage.tokens_computed, usage.tokens_saved)
        return scored

    def _score_counting_passes(self, batch: Sequence[Tokenized]) -> Callable[[], list[ScoreResult]]:
        before = self.engine.stats["forward_passes"]
        try:
            return self.engine.launch(batch)
        finally:
            metrics.FORWARD_PASSES.inc(self.engine.stats["forward_passes"] - before)


def warm_up(engine: Engine) -> None:
    """Score a small request with every scheme once, so no call pays for first-use setup."""
    docs = (Doc("warm-up document", "a"), Doc("another warm-up document", "b"))
    for scheme in PLANNERS:
        engine.score(ScoreRequest("warm-up query", docs, options=ScoreOptions(scheme=scheme)))


def engine_config(args) -> EngineConfig:
    """The engine settings among a server's arguments: ``scorer serve``'s flags or a Ray
    replica's ``ScorerArgs`` (the same names)."""
    return EngineConfig(
        max_docs=args.max_docs,
        max_doc_tokens=args.max_doc_tokens,
        max_tokens_per_pass=args.max_batch_tokens,
        auto_policy=args.auto_policy,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        model_kernels=args.model_kernels,
    )


def ready_engine(
    model_dir: str | None, attention_backend: str, device: str | None, dtype, config: EngineConfig
) -> Engine:
    """Build the engine, warm every scheme up, and label ``scorer_model_info``: what a server
    (standalone or a Ray replica) does before it reports SERVING."""
    engine = build_engine(model_dir, attention_backend, device, dtype, config=config)
    engine.capture_graphs()
    warm_up(engine)
    metrics.MODEL_INFO.labels(
        model=engine.model_name,
        attention_backend=engine.backend.name,
        device=str(engine.device),
        dtype=str(next(engine.model.parameters()).dtype).removeprefix("torch."),
    ).set(1)
    return engine
