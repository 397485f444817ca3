"""Cross-request batching: concurrent calls merged into one forward batch under a token budget.

A call waits in a bounded FIFO queue. A batch is cut when the queued calls fill the token budget
or when the oldest queued call has waited ``max_wait_s``; at once while no batch is in flight, or
while calls arrive too seldom for the wait to gather company (``COMPANY``);
it is launched on one worker thread (the host planning and the queuing of its device work) and
waited for on another, so the event loop keeps answering health checks and accepting calls while
the model computes, and the next batch is planned while the device still runs this one
(``IN_FLIGHT`` batches at most). Under light load (calls arriving further apart than a batch
takes) a short batch that finds the device idle is launched on the event loop itself
(``INLINE_S``: the launch holds the GIL either way), and waited for there too when no call is
queued behind it and it should end soon after its launch (``INLINE_WAIT_S``): on an idle server
each hand-off to a sleeping thread and back costs a wake-up (4 a call). Not under more load: the
next batch's launch would no longer overlap this one's device work. A call whose deadline
passed or that was cancelled while queued is dropped without compute. A batch that fails (out
of memory above all) is retried one call at a time, so only the failing call fails.

Under overload, work spent on a call that will miss its deadline anyway is what makes goodput
collapse. The batcher keeps a model of the time a batch holds the device, ``a + b * tokens`` fitted
on recent batches (see ForwardTimeModel), and

- refuses at once a call whose batch it estimates to end with less than ``SPARE`` of the call's
  time left before its deadline: the end of the batches in flight (each one's estimate, less the
  time the oldest has held the device), then the queue up to and including the call counted in
  batches, ``n * (a + s) + b * tokens`` where ``n = min(calls, ceil(tokens / C))``, ``C`` is the
  largest batch seen recently (at most ``max_batch_tokens``) and ``s`` the spread of recent
  batches around the fit. Batches, not one forward of all the queue's tokens: when recent
  batches were all about the same size, ``b`` fits to 0 and ``a`` is the whole time of a batch;
- when it cuts a batch, drops a call that could not end in time even alone behind the batches in
  flight ("unreachable"), and stops adding calls once one more would push a call already in the
  batch past its deadline (one forward at ``a + b * tokens``, no margins: only a call that cannot
  make it is dropped).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from functools import partial

from .. import metrics
from ..engine import ScoreResult
from ..lazy_torch import torch
from ..prefix_cache import as_ids
from ..request import Job
from ..settings import Settings

log = logging.getLogger(__name__)
DEADLINE_SLACK_S = 0.02
"""A call cancelled this close to its deadline is counted as its deadline passing: the client's
deadline starts when it sends and the server's when the call arrives, later by the call's transit
and queueing (a burst on a loaded 2-core machine: up to ~5 ms), so the client's own deadline
cancels the call a little before the server's clock says it is due; an event loop's timer may also
fire a hair early."""

ScoreFn = Callable[[Sequence[Job]], Callable[[], list[ScoreResult]]]
"""Starts a batch and returns the function that waits for its results (``Engine.launch``)."""
IN_FLIGHT = 2
SPARE = 0.1
"""The share of a call's time to its deadline that its estimated end must leave for it to be
admitted: forward times vary, and a call admitted at the very edge would miss every other time."""
COMPANY = 0.5
"""A call waits ``max_wait_s`` for company only while the calls expected to arrive in that time
(``max_wait_s`` over the recent mean gap between arrivals) are at least this many: under light
load a wait behind a batch in flight would gather nobody and only add to the call's latency."""
ARRIVALS = 8
"""Arrivals the gap estimate spans."""
INLINE_S = 0.01
"""A batch that finds no batch in flight, while calls arrive further apart than
``BatchPolicy.loop_path_gaps`` times its estimated time on the device, is launched on the event
loop when that estimate is at most this long (the loop answers nothing else meanwhile; a longer
launch runs on the forward thread, which gives the loop the GIL every few ms)."""
INLINE_WAIT_S = 0.002
"""A batch launched on the event loop is waited for there too (the loop blocked until its scores
are in) when no call is queued behind it and its estimated time on the device, less its launch,
is at most this long: a call that arrives meanwhile waits about this long more to be queued, where
a waiting thread would have cost this batch two wake-ups (an A call's device work ends ~0.5 ms
after its launch)."""


class QueueFull(Exception):
    """The queue holds ``max_queue`` calls already."""


class Dropped(Exception):
    """The call left the queue before its forward pass: ``reason`` is "deadline" (passed),
    "unreachable" (its forward could not end before it) or "cancelled"."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"dropped before its forward pass ({reason})")

    def __reduce__(self):  # pickled as its reason (the engine process sends it to a front end)
        return Dropped, (self.reason,)


class OutOfMemory(Exception):
    """The call alone does not fit in the accelerator's memory."""


class Closed(Exception):
    """The batcher no longer takes calls."""


_DEFAULTS = {f.name: f.default for f in fields(Settings)}


@dataclass(frozen=True)
class BatchPolicy:
    """The batcher's settings; each default is the server's (``Settings``)."""

    max_batch_tokens: int = _DEFAULTS["max_batch_tokens"]
    max_wait_s: float = _DEFAULTS["max_wait_ms"] / 1e3
    max_queue: int = _DEFAULTS["max_queue"]
    loop_path_gaps: float = _DEFAULTS["loop_path_gaps"]
    """The event-loop path under light load: calls at least this many batch times apart (0: at
    any idle moment; ``math.inf``: never). Measured at 0 and 2 on the H200, at 0, 1, 2 and never on
    a simulated device; at 0 A-text's p99 at 80% of capacity was 234 ms against 82 on the H200
    (bench/RESULTS.md, What did not pay)."""
    cut_before_heavy: float = _DEFAULTS["cut_before_heavy"]
    """A cut stops before a call that computes at least this many times the tokens of the calls
    ahead of it in the batch (0: never). On a prompt reused by consecutive calls, its first call
    computes thousands of rows and the others, read from the prefix cache, a few hundred: a cut
    holding the previous prompt's last reads and the next prompt's first call launches the reads
    alone, and the long call leads the next cut (the queue stays in order: nothing overtakes a
    call). On an H100, ten-call reuses of an 8,000-token prompt: p99 below FIFO cuts' at all 11
    rates compared, by up to 37 ms (bench/RESULTS.md)."""


@dataclass(frozen=True)
class Scored:
    result: ScoreResult
    queue_seconds: float
    forward_seconds: float
    batch_requests: int


@dataclass(eq=False)
class _Queued:
    job: Job
    deadline: float | None
    request_id: str
    future: asyncio.Future[Scored]
    enqueued: float
    queued: bool = True

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    @property
    def tokens(self) -> int:
        return self.job.tokens


class ForwardTimeModel:
    """Seconds a batch holds the device as ``a + b * tokens``, least squares over the last batches.

    A batch holds the device from its launch, or from the end of the batch before it if that is
    later (batches in flight queue behind each other), to its end. While recent batches barely
    differ in size, ``b`` is 0 and the whole time counts as the fixed cost ``a`` of a batch of
    their size (a smaller one takes its share); a queue is counted in batches of the largest size
    seen (``queue``), so a deep one is not under-counted. The fit is made once per observation,
    not on every question: admission asks on every call.
    """

    def __init__(self, window: int = 64) -> None:
        self._seen: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float, float, float, int] | None = None  # a, b, mean tokens, spread, largest

    def observe(self, tokens: int, seconds: float) -> None:
        self._seen.append((tokens, seconds))
        self._fit = self._fitted()

    def _fitted(self) -> tuple[float, float, float, float, int] | None:
        if len(self._seen) < 2:
            return None
        n = len(self._seen)
        mean_t = sum(t for t, _ in self._seen) / n
        mean_s = sum(s for _, s in self._seen) / n
        var_t = sum((t - mean_t) ** 2 for t, _ in self._seen) / n
        b = 0.0
        if var_t > (0.1 * mean_t) ** 2:
            b = max(0.0, sum((t - mean_t) * (s - mean_s) for t, s in self._seen) / n / var_t)
        a = max(0.0, mean_s - b * mean_t)
        spread = math.sqrt(sum((s - a - b * t) ** 2 for t, s in self._seen) / n)
        return a, b, mean_t, spread, max(t for t, _ in self._seen)

    def predict(self, tokens: int) -> float | None:
        """One batch of ``tokens`` tokens: ``a + b * tokens``; while recent batches were all of
        about one size (``b`` is 0), a smaller batch takes its share of ``a``. Otherwise a model
        fitted on a burst of large batches would refuse every later call, the small ones too,
        and, running none, never learn again."""
        if self._fit is None:
            return None
        a, b, mean_t, _, _ = self._fit
        if b == 0.0:
            a *= min(1.0, tokens / mean_t)
        return a + b * tokens

    def queue(self, calls: int, tokens: int, max_batch_tokens: int) -> float | None:
        """``calls`` queued calls of ``tokens`` tokens in all, counted with care: ``n`` batches of
        at most the largest size seen recently (and ``max_batch_tokens``), one call each at the
        most, each of the queue's mean size at its predicted time plus the spread of recent
        batches around the fit."""
        if self._fit is None:
            return None
        if not calls:
            return 0.0
        _, _, _, spread, largest = self._fit
        size = max(1, min(max_batch_tokens, largest))
        n = min(calls, math.ceil(tokens / size))
        return n * (self.predict(math.ceil(tokens / n)) + spread)


@dataclass(eq=False)
class _Flight:
    tokens: int
    started: float


class Batcher:
    """``clock``: seconds on the clock of the calls' deadlines (``time.monotonic``); a test drives
    its own, so that what the batcher measures and decides does not hang on the machine's load.
    ``refresh``: a queued call's Job as it would be made now (``Engine.repeeked``: a prompt whose
    first call was planned after this one arrived is read from the prefix cache, and the call counts
    only the rows it computes), asked as the call is considered for a batch, and for the queued
    calls with the prompt of a call just launched (whose plan indexed it), so that the queue's token
    count, which admission's estimate and the wait for company read, is what the calls compute."""

    def __init__(
        self,
        score: ScoreFn,
        policy: BatchPolicy,
        clock: Callable[[], float] = time.monotonic,
        refresh: Callable[[Job], Job] | None = None,
    ) -> None:
        self._score = score
        self._refresh = refresh
        self.policy = policy
        self._clock = clock
        self._pending: deque[_Queued] = deque()
        self._arrived = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="collect")
        self._slots = asyncio.Semaphore(IN_FLIGHT)  # batches launched and not yet settled
        self._collecting: set[asyncio.Task] = set()
        self._forward_time = ForwardTimeModel()
        self._in_flight: deque[_Flight] = deque()  # launched and not yet settled, oldest first
        self._device_free = 0.0  # when the last batch ended
        self._arrivals: deque[float] = deque(maxlen=ARRIVALS)  # the last calls' arrival times

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    async def close(self) -> None:
        """Run what is queued, then stop; later submits raise Closed."""
        self._closing = True
        self._arrived.set()
        if self._task is not None:
            await self._task
        await asyncio.gather(*self._collecting, return_exceptions=True)
        self._executor.shutdown(wait=True)
        self._waiter.shutdown(wait=True)

    @property
    def depth(self) -> int:
        return len(self._pending)

    async def submit(self, job: Job, deadline: float | None, request_id: str) -> Scored:
        """Queue a call and wait for its scores (``job.tokens`` count against the token budget).
        ``deadline`` is on the batcher's clock (``time.monotonic``'s)."""
        if self._closing:
            raise Closed("the server is shutting down")
        if len(self._pending) >= self.policy.max_queue:
            metrics.REJECTED.inc()
            raise QueueFull(f"{len(self._pending)} calls queued already; retry later")
        queued = _Queued(job, deadline, request_id, asyncio.get_running_loop().create_future(), self._clock())
        if queued.expired(queued.enqueued):
            self._count_drop(queued, "deadline")
            raise Dropped("deadline")
        if self._refused(queued):
            metrics.REJECTED.inc()
            raise QueueFull("at the current load the call would not finish before its deadline; retry later")
        queued.future.add_done_callback(partial(self._on_done, queued))
        self._arrivals.append(queued.enqueued)
        self._pending.append(queued)
        metrics.QUEUE_DEPTH.set(len(self._pending))
        self._arrived.set()
        return await queued.future

    def _on_done(self, job: _Queued, future: asyncio.Future) -> None:
        """A queued call's future ends only by cancellation (the batcher settles a call after
        taking it from the queue): take it out and count it."""
        if job.queued:
            self._pending.remove(job)
            job.queued = False
            metrics.QUEUE_DEPTH.set(len(self._pending))
            expired = job.expired(self._clock() + DEADLINE_SLACK_S)
            self._count_drop(job, "deadline" if expired else "cancelled")

    def _count_drop(self, job: _Queued, reason: str) -> None:
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
            await self._slots.acquire()
            try:
                await self._fill()
                batch = self._take()
            except Exception as exc:  # a fault in the policy must not stop the loop: fail the head call
                self._slots.release()
                log.exception("cutting a batch failed")
                if self._pending:
                    job = self._pending.popleft()
                    job.queued = False
                    metrics.QUEUE_DEPTH.set(len(self._pending))
                    _settle(job, exc)
                continue
            try:
                await self._launch(batch)  # gives the slot back once the batch is settled
            except Exception as exc:  # the loop must outlive any batch
                log.exception("batch of %d requests failed outside the forward", len(batch))
                for job in batch:
                    _settle(job, exc)

    async def _fill(self) -> None:
        """Wait until the queue fills the token budget or its oldest call has waited max_wait_s;
        not at all while no batch is in flight (a call that finds the engine idle runs at once:
        waiting could only gather calls that would then wait for nothing), nor while calls arrive
        too seldom for the wait to gather company."""
        if not self._in_flight or not self._company_expected():
            return
        while self._pending and not self._closing:
            if sum(j.tokens for j in self._pending) >= self.policy.max_batch_tokens:
                return
            left = self._pending[0].enqueued + self.policy.max_wait_s - self._clock()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    def _company_expected(self) -> bool:
        """Would ``max_wait_s`` gather at least COMPANY more calls, at the recent arrival rate?
        The mean gap counts the time since the last arrival, so a burst long past does not hold
        later lone calls."""
        return self.policy.max_wait_s >= COMPANY * self._mean_gap()

    def _mean_gap(self) -> float:
        """The recent mean gap between arrivals, counting the time since the last one (infinite
        before two)."""
        if len(self._arrivals) < 2:
            return math.inf
        return (self._clock() - self._arrivals[0]) / (len(self._arrivals) - 1)

    def _take(self) -> list[_Queued]:
        """The oldest calls that fit the token budget (at least one) and can still meet their
        deadlines by the forward-time estimate; calls that cannot are dropped, and a call whose
        check raises fails alone."""
        batch: list[_Queued] = []
        tokens, now = 0, self._clock()
        first_deadline = float("inf")
        while self._pending:
            job = self._pending[0]
            if job.future.done():  # cancelled, its done callback not run yet (the loop runs it later)
                self._on_done(job, job.future)
                continue
            failure: Exception | None = None
            try:
                if self._refresh is not None:
                    job.job = self._refresh(job.job)
                reason = (
                    "deadline"
                    if job.expired(now)
                    else "unreachable"
                    if self._late(job, now, job.tokens)
                    else None
                )
                if reason is None and batch:
                    late = self._late(
                        job, now, tokens + job.tokens, min(first_deadline, job.deadline or first_deadline)
                    )
                    heavy = 0 < self.policy.cut_before_heavy * tokens <= job.tokens
                    if tokens + job.tokens > self.policy.max_batch_tokens or late or heavy:
                        break
            except Exception as exc:  # a fault in the policy: this call fails, the others go on
                log.exception("checking a queued call failed", extra={"request_id": job.request_id})
                failure = exc
            else:
                if reason is not None:
                    self._count_drop(job, reason)
                    failure = Dropped(reason)
            self._pending.popleft()
            job.queued = False
            if failure is not None:
                _settle(job, failure)
                continue
            batch.append(job)
            tokens += job.tokens
            first_deadline = min(first_deadline, job.deadline or first_deadline)
        metrics.QUEUE_DEPTH.set(len(self._pending))
        for job in batch:
            metrics.STAGE_DURATION.labels(stage="queue").observe(now - job.enqueued)
        return batch

    def _refused(self, job: _Queued) -> bool:
        """Would the call's batch end with less than SPARE of its time left? (The module's docstring.)"""
        if job.deadline is None:
            return False
        calls, tokens = len(self._pending) + 1, sum(j.tokens for j in self._pending) + job.tokens
        queue = self._forward_time.queue(calls, tokens, self.policy.max_batch_tokens)
        now = job.enqueued
        return queue is not None and self._in_flight_left(now) + queue > (1 - SPARE) * (job.deadline - now)

    def _late(self, job: _Queued, now: float, tokens: int, deadline: float | None = None) -> bool:
        """Would a forward of ``tokens`` tokens, behind the batches in flight, end after
        ``deadline`` (the job's)?"""
        deadline = job.deadline if deadline is None else deadline
        predicted = self._forward_time.predict(tokens)
        return (
            predicted is not None
            and deadline is not None
            and now + self._in_flight_left(now) + predicted > deadline
        )

    def _in_flight_left(self, now: float) -> float:
        """Estimated seconds until the batches in flight end: each one's estimate, less the time
        the oldest has held the device (not below 0 for it)."""
        left = 0.0
        for i, flight in enumerate(self._in_flight):
            predicted = self._forward_time.predict(flight.tokens) or 0.0
            if i == 0:
                predicted = max(0.0, predicted - (now - max(flight.started, self._device_free)))
            left += predicted
        return left

    async def _launch(self, batch: list[_Queued]) -> None:
        batch = [job for job in batch if not job.future.done()]
        if not batch:
            self._slots.release()
            return
        metrics.BATCH_REQUESTS.observe(len(batch))
        metrics.BATCH_TOKENS.observe(sum(j.tokens for j in batch))
        started = self._clock()
        flight = _Flight(sum(j.tokens for j in batch), started)
        predicted = self._forward_time.predict(flight.tokens)
        inline = not self._in_flight and self._alone(predicted)  # nothing to overlap it with
        self._in_flight.append(flight)
        loop = asyncio.get_running_loop()
        try:
            jobs = [j.job for j in batch]
            if inline:
                collect = self._score(jobs)
            else:
                collect = await loop.run_in_executor(self._executor, self._score, jobs)
        except Exception as exc:
            try:
                await self._failed(batch, exc)
            finally:
                self._landed(flight)
                self._slots.release()
            return
        self._refresh_queued(jobs)
        if inline and not self._pending and predicted - (self._clock() - started) <= INLINE_WAIT_S:
            metrics.INLINE_BATCHES.inc()
            await self._collect(batch, collect, flight, inline=True)
            return
        task = loop.create_task(self._collect(batch, collect, flight))
        self._collecting.add(task)
        task.add_done_callback(self._collecting.discard)

    def _refresh_queued(self, launched: list[Job]) -> None:
        """``refresh`` the queued calls whose prompt (and cache salt) is a just-launched call's,
        found by the prompt's digest, which a call keeps once its arrival's peek made it."""
        if self._refresh is None or not self._pending:
            return
        try:
            prompts = {_prompt(j) for j in launched}
            for queued in self._pending:
                if _prompt(queued.job) in prompts:
                    queued.job = self._refresh(queued.job)
        except Exception:  # the counts stay as they were; the cut asks again
            log.exception("refreshing the queued calls failed")

    async def _collect(
        self,
        batch: list[_Queued],
        collect: Callable[[], list[ScoreResult]],
        flight: _Flight,
        inline: bool = False,
    ):
        try:
            if inline:
                results = collect()
            else:
                results = await asyncio.get_running_loop().run_in_executor(self._waiter, collect)
        except Exception as exc:
            log.exception("batch of %d requests failed on the device", len(batch))
            for job in batch:
                _settle(job, exc)
            return
        finally:
            held = self._landed(flight)
            self._slots.release()
        self._finish(batch, results, flight.started, held)

    def _alone(self, predicted: float | None) -> bool:
        """Is a batch estimated to take ``predicted`` seconds (None: no fit yet) short (INLINE_S)
        and the load light: calls arriving ``loop_path_gaps`` times further apart than it takes,
        so the next probably finds the device idle again?"""
        return (
            predicted is not None
            and predicted <= INLINE_S
            and self._mean_gap() >= self.policy.loop_path_gaps * predicted
        )

    def _landed(self, flight: _Flight) -> float:
        """The batch ended: it leaves the flights. Returns the seconds it held the device."""
        now = self._clock()
        held = now - max(flight.started, self._device_free)
        self._in_flight.remove(flight)
        self._device_free = now
        return held

    async def _failed(self, batch: list[_Queued], exc: Exception) -> None:
        """A batch whose launch raised: out of memory or a fault of one call; retry each alone."""
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
        loop = asyncio.get_running_loop()
        for job in batch:
            if job.future.done():
                continue
            started = self._clock()
            try:
                results = await loop.run_in_executor(self._executor, lambda j=job: self._score([j.job])())
            except Exception as alone:
                if isinstance(alone, torch.OutOfMemoryError):
                    _release_cached_memory()
                    alone = OutOfMemory(str(alone))
                _settle(job, alone)
                continue
            self._finish([job], results, started)

    def _finish(
        self, batch: list[_Queued], results: list[ScoreResult], started: float, held: float | None = None
    ) -> None:
        """Settle the batch's calls; ``held``: the seconds it held the device (default: since ``started``)."""
        forward_s = self._clock() - started
        self._forward_time.observe(sum(j.tokens for j in batch), forward_s if held is None else held)
        for job, result in zip(batch, results, strict=True):
            metrics.STAGE_DURATION.labels(stage="forward").observe(forward_s)
            _settle(job, Scored(result, started - job.enqueued, forward_s, len(batch)))


def _prompt(job: Job) -> tuple[str, int, bytes]:
    ids = as_ids(job.prefix_ids)
    return job.options.cache_salt, len(ids), ids.digest()


def _settle(job: _Queued, outcome: Scored | BaseException) -> None:
    if job.future.done():
        return
    if isinstance(outcome, BaseException):
        job.future.set_exception(outcome)
    else:
        job.future.set_result(outcome)


def _release_cached_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
