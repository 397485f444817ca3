"""Cross-request batching: concurrent calls merged into one forward batch under a token budget.

A call waits in a bounded FIFO queue. A batch is cut when the queued calls fill the token budget
or when the oldest queued call has waited ``max_wait_s``; it runs on one worker thread, so the
event loop keeps answering health checks and accepting calls while the model computes. A call
whose deadline passed or that was cancelled while queued is dropped without compute. A batch that
fails (out of memory above all) is retried one call at a time, so only the failing call fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import torch

from .. import metrics
from ..engine import ScoreResult
from ..request import Tokenized

log = logging.getLogger(__name__)

ScoreFn = Callable[[Sequence[Tokenized]], list[ScoreResult]]


class QueueFull(Exception):
    """The queue holds ``max_queue`` calls already."""


class Dropped(Exception):
    """The call left the queue before its forward pass: ``reason`` is "deadline" or "cancelled"."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"dropped before its forward pass ({reason})")


class OutOfMemory(Exception):
    """The call alone does not fit in the accelerator's memory."""


class Closed(Exception):
    """The batcher no longer takes calls."""


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_tokens: int = 16384
    max_wait_s: float = 0.002
    max_queue: int = 256


@dataclass(frozen=True)
class Scored:
    result: ScoreResult
    queue_seconds: float
    forward_seconds: float
    batch_requests: int


@dataclass(eq=False)
class _Job:
    tokenized: Tokenized
    tokens: int
    deadline: float | None
    request_id: str
    future: asyncio.Future[Scored]
    enqueued: float = field(default_factory=time.monotonic)
    queued: bool = True

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


class Batcher:
    def __init__(self, score: ScoreFn, count_tokens: Callable[[Tokenized], int], policy: BatchPolicy) -> None:
        self._score = score
        self._count_tokens = count_tokens
        self.policy = policy
        self._pending: deque[_Job] = deque()
        self._arrived = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    async def close(self) -> None:
        """Run what is queued, then stop; later submits raise Closed."""
        self._closing = True
        self._arrived.set()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)

    @property
    def depth(self) -> int:
        return len(self._pending)

    async def submit(self, tokenized: Tokenized, deadline: float | None, request_id: str) -> Scored:
        """Queue a call and wait for its scores. ``deadline`` is on ``time.monotonic``'s clock."""
        if self._closing:
            raise Closed("the server is shutting down")
        if len(self._pending) >= self.policy.max_queue:
            metrics.REJECTED.inc()
            raise QueueFull(f"{len(self._pending)} calls queued already; retry later")
        job = _Job(
            tokenized,
            self._count_tokens(tokenized),
            deadline,
            request_id,
            asyncio.get_running_loop().create_future(),
        )
        if job.expired(job.enqueued):
            self._count_drop(job, "deadline")
            raise Dropped("deadline")
        job.future.add_done_callback(partial(self._on_done, job))
        self._pending.append(job)
        metrics.QUEUE_DEPTH.set(len(self._pending))
        self._arrived.set()
        return await job.future

    def _on_done(self, job: _Job, future: asyncio.Future) -> None:
        if future.cancelled() and job.queued:
            self._pending.remove(job)
            job.queued = False
            metrics.QUEUE_DEPTH.set(len(self._pending))
            self._count_drop(job, "deadline" if job.expired(time.monotonic()) else "cancelled")

    def _count_drop(self, job: _Job, reason: str) -> None:
        metrics.DROPPED.labels(reason=reason).inc()
        log.info(
            "dropped from the queue before its forward pass (%s)",
            reason,
            extra={"request_id": job.request_id},
        )

    async def _run(self) -> None:
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._arrived.clear()
                await self._arrived.wait()
                continue
            await self._fill()
            batch = self._take()
            if batch:
                try:
                    await self._forward(batch)
                except Exception as exc:  # the loop must outlive any batch
                    log.exception("batch of %d requests failed outside the forward", len(batch))
                    for job in batch:
                        _settle(job, exc)

    async def _fill(self) -> None:
        """Wait until the queue fills the token budget or its oldest call has waited max_wait_s."""
        while self._pending and not self._closing:
            if sum(j.tokens for j in self._pending) >= self.policy.max_batch_tokens:
                return
            left = self._pending[0].enqueued + self.policy.max_wait_s - time.monotonic()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    def _take(self) -> list[_Job]:
        """The oldest calls that fit the token budget (at least one), less those already expired."""
        batch, tokens, now = [], 0, time.monotonic()
        while self._pending:
            job = self._pending[0]
            if batch and tokens + job.tokens > self.policy.max_batch_tokens:
                break
            self._pending.popleft()
            job.queued = False
            if job.expired(now):
                self._count_drop(job, "deadline")
                job.future.set_exception(Dropped("deadline"))
                continue
            batch.append(job)
            tokens += job.tokens
        metrics.QUEUE_DEPTH.set(len(self._pending))
        for job in batch:
            metrics.STAGE_DURATION.labels(stage="queue").observe(now - job.enqueued)
        return batch

    async def _forward(self, batch: list[_Job]) -> None:
        batch = [job for job in batch if not job.future.done()]
        if not batch:
            return
        metrics.BATCH_REQUESTS.observe(len(batch))
        metrics.BATCH_TOKENS.observe(sum(j.tokens for j in batch))
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self._score, [j.tokenized for j in batch])
        except Exception as exc:
            out_of_memory = isinstance(exc, torch.OutOfMemoryError)
            if out_of_memory:
                _release_cached_memory()
            if len(batch) == 1:
                _settle(batch[0], OutOfMemory(str(exc)) if out_of_memory else exc)
                return
            if out_of_memory:
                metrics.OOM_RETRIES.inc()
            ids = ", ".join(j.request_id for j in batch)
            log.warning("batch [%s] failed (%s: %s); retrying each alone", ids, type(exc).__name__, exc)
            for job in batch:
                await self._forward([job])
            return
        forward_s = time.monotonic() - started
        for job, result in zip(batch, results, strict=True):
            metrics.STAGE_DURATION.labels(stage="forward").observe(forward_s)
            _settle(job, Scored(result, started - job.enqueued, forward_s, len(batch)))


def _settle(job: _Job, outcome: Scored | BaseException) -> None:
    if job.future.done():
        return
    if isinstance(outcome, BaseException):
        job.future.set_exception(outcome)
    else:
        job.future.set_result(outcome)


def _release_cached_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
