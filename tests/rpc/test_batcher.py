"""The batcher's policy in process, with a fake forward: budget, wait, drops, retries, closing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from scorer.engine import ScoreResult, Usage
from scorer.planning import Shape, get
from scorer.request import Doc, Job, ScoreRequest
from scorer.server.batcher import (
    Batcher,
    BatchPolicy,
    Closed,
    Dropped,
    ForwardTimeModel,
    OutOfMemory,
    QueueFull,
)


def call(tokens: int, name: str = "") -> Job:
    req = ScoreRequest(prompt=name or "q", docs=[Doc("d")])
    prefix = (1,) * (tokens - 1)
    shape = Shape(tokens - 1, (1,))
    scheme = get("ragged")
    return Job(req, prefix, ((2,),), (1,), (0,), (3,), shape, scheme, 0, scheme.rows(shape))


def tokens_of(t: Job) -> int:
    return len(t.prefix_ids) + sum(len(i) for i in t.items)


class Clock:
    """The batcher's clock, driven by the test: the fake device advances it by the time its work
    would take, and the test by the gaps between arrivals, so what the batcher measures (batch
    times, arrival gaps) is exact however loaded the machine is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def until(condition, timeout_s: float = 10.0) -> None:
    """Until ``condition()`` holds: a state the test waits for, never a time it guesses (the bound
    is only there to fail a test that would hang)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.001)


class FakeForward:
    """Records every batch; raises torch.OutOfMemoryError for a batch over ``oom_above`` tokens.
    Each launch takes ``delay_s``: slept, or advanced on ``clock`` (``Clock``) when given; and
    waits first while the test holds ``gate`` closed, so a batch stays in flight (its launch
    unfinished) for exactly as long as the test wants. ``started``: every launch, on arrival."""

    def __init__(self, oom_above: int = 0, delay_s: float = 0.0, clock: Clock | None = None) -> None:
        self.batches: list[list[str]] = []
        self.started: list[str] = []
        self.oom_above = oom_above
        self.delay_s = delay_s
        self.clock = clock
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, batch: Sequence[Job]):
        self.started.append(batch[0].request.prompt)
        self.gate.wait()
        if self.clock is not None:
            self.clock.advance(self.delay_s)
        else:
            time.sleep(self.delay_s)
        if self.oom_above and sum(tokens_of(t) for t in batch) > self.oom_above:
            raise torch.OutOfMemoryError("fake")
        self.batches.append([t.request.prompt for t in batch])
        results = [ScoreResult((), "ragged", Usage(0, 0, tokens_of(t), 0)) for t in batch]
        return lambda: results


def run(scenario):
    return asyncio.run(asyncio.wait_for(scenario(), 30))


def test_queued_calls_merge_in_arrival_order_up_to_the_token_budget():
    forward = FakeForward()

    async def scenario():
        batcher = Batcher(forward, BatchPolicy(max_batch_tokens=250, max_wait_s=0.05))
        batcher.start()
        scored = await asyncio.gather(*(batcher.submit(call(100, f"c{i}"), None, f"c{i}") for i in range(5)))
        await batcher.close()
        assert [s.batch_requests for s in scored] == [2, 2, 2, 2, 1]

    run(scenario)
    assert forward.batches == [["c0", "c1"], ["c2", "c3"], ["c4"]]


@pytest.mark.parametrize(
    "ratio,heavy,batches",
    [
        (4.0, 900, [["r0", "r1"], ["long", "r2", "r3"]]),  # 900 >= 4 x 200: the reads go first
        (4.0, 700, [["r0", "r1", "long", "r2", "r3"]]),  # 700 < 4 x 200: one batch
        (0.0, 900, [["r0", "r1", "long", "r2", "r3"]]),  # off
    ],
)
def test_a_cut_stops_before_a_call_that_computes_many_times_the_batch_ahead_of_it(ratio, heavy, batches):
    """``cut_before_heavy``: the calls ahead of a long one launch without it; it leads the next
    batch with the calls behind it, so the queue keeps its order."""
    forward = FakeForward()
    calls = [call(100, "r0"), call(100, "r1"), call(heavy, "long"), call(100, "r2"), call(100, "r3")]

    async def scenario():
        policy = BatchPolicy(max_batch_tokens=2000, max_wait_s=0.05, cut_before_heavy=ratio)
        batcher = Batcher(forward, policy)
        batcher.start()
        await asyncio.gather(*(batcher.submit(c, None, c.request.prompt) for c in calls))
        await batcher.close()

    run(scenario)
    assert forward.batches == batches


def test_a_queued_call_is_counted_as_refresh_makes_it_when_a_batch_is_cut():
    """``refresh`` (the engine's prefix-cache peek) is asked for each call as it is considered for a
    batch: calls that arrived counting 100 tokens and count 10 by then (their prompt cached since)
    fill a 250-token batch five at a time; the forward gets the refreshed jobs."""
    forward = FakeForward()
    asked = []

    def refresh(job: Job) -> Job:
        asked.append(job.request.prompt)
        return call(10, job.request.prompt)

    async def scenario():
        batcher = Batcher(forward, BatchPolicy(max_batch_tokens=250, max_wait_s=0.05), refresh=refresh)
        batcher.start()
        scored = await asyncio.gather(*(batcher.submit(call(100, f"c{i}"), None, f"c{i}") for i in range(5)))
        await batcher.close()
        assert [s.batch_requests for s in scored] == [5] * 5

    run(scenario)
    assert forward.batches == [[f"c{i}" for i in range(5)]]
    assert sorted(set(asked)) == [f"c{i}" for i in range(5)]


def test_the_queued_calls_of_a_launched_call_s_prompt_are_refreshed_when_it_is_launched():
    """A launch plans its calls' prompts into the prefix cache: the queued calls with the same prompt
    (a1, a2, behind a0) are refreshed then, before any batch is cut (both slots held by batches on
    the device), so the queue counts what they compute; a call of another prompt (b0) is not."""
    forward = SlowDevice()
    asked: list[str] = []

    def refresh(job: Job) -> Job:  # the prompt cached: 10 rows left to compute
        asked.append(job.request.prompt)
        return replace(job, tokens=10)

    async def scenario():
        batcher = Batcher(forward, BatchPolicy(max_batch_tokens=1000, max_wait_s=0), refresh=refresh)
        batcher.start()
        x0 = asyncio.ensure_future(batcher.submit(call(50, "x0"), None, "x0"))
        await until(lambda: forward.batches == [["x0"]])  # on the device until on_device opens
        forward.gate.clear()
        a0 = asyncio.ensure_future(batcher.submit(call(100, "a0"), None, "a0"))
        await until(lambda: forward.started == ["x0", "a0"])  # launching, held at the gate
        asked.clear()  # each was asked as its batch was cut
        queued = [
            asyncio.ensure_future(batcher.submit(job, None, job.request.prompt))
            for job in (call(100, "a1"), call(100, "a2"), call(120, "b0"))
        ]
        await until(lambda: batcher.depth == 3)
        assert asked == [] and [q.tokens for q in batcher._pending] == [100, 100, 120]
        forward.gate.set()
        await until(lambda: forward.batches == [["x0"], ["a0"]] and asked)
        await asyncio.sleep(0)
        assert asked == ["a1", "a2"] and forward.started == ["x0", "a0"]  # no batch cut since
        assert [q.tokens for q in batcher._pending] == [10, 10, 120]
        forward.on_device.set()
        await asyncio.gather(x0, a0, *queued)
        await batcher.close()

    run(scenario)
    assert forward.batches[2:] == [["a1", "a2", "b0"]]


def test_a_call_over_the_budget_runs_alone_and_a_lone_call_on_an_idle_engine_runs_at_once():
    forward = FakeForward()

    async def scenario():
        batcher = Batcher(forward, BatchPolicy(max_batch_tokens=100, max_wait_s=0.2))
        batcher.start()
        big, small = await asyncio.gather(
            batcher.submit(call(500, "big"), None, "big"), batcher.submit(call(10, "small"), None, "small")
        )
        assert big.batch_requests == small.batch_requests == 1
        lone = await batcher.submit(call(10, "lone"), None, "lone")
        assert lone.queue_seconds < 0.1  # no max_wait: nothing was in flight
        await batcher.close()

    run(scenario)
    assert forward.batches == [["big"], ["small"], ["lone"]]


def test_while_a_batch_is_in_flight_a_lone_call_waits_at_most_max_wait_for_company():
    forward = FakeForward()

    async def scenario():
        batcher = Batcher(forward, BatchPolicy(max_batch_tokens=1000, max_wait_s=0.05))
        batcher.start()
        forward.gate.clear()
        first = asyncio.ensure_future(batcher.submit(call(10, "first"), None, "first"))
        await until(lambda: forward.started == ["first"])  # in flight
        a = asyncio.ensure_future(batcher.submit(call(10, "a"), None, "a"))
        await asyncio.sleep(0)
        b = asyncio.ensure_future(batcher.submit(call(10, "b"), None, "b"))
        await asyncio.sleep(0)
        forward.gate.set()
        b = await b
        await first
        assert (await a).batch_requests == b.batch_requests == 2  # they waited and went together
        await batcher.close()

    run(scenario)
    assert forward.batches == [["first"], ["a", "b"]]


class SlowDevice(FakeForward):
    """Launches at once; its results are collected once the test opens ``on_device`` (a batch in
    flight on the device until then)."""

    def __init__(self) -> None:
        super().__init__()
        self.on_device = threading.Event()

    def __call__(self, batch: Sequence[Job]):
        collect = super().__call__(batch)
        return lambda: self.on_device.wait() and collect()


def test_a_call_after_a_long_gap_does_not_wait_for_company_behind_a_batch_in_flight():
    """Calls arriving seldom (one 100 s after the last, max_wait 30 s: under COMPANY expected in
    the wait, on the batcher's clock) are launched at once even with a batch in flight (quick ones
    wait: the test above); a wait would hold the call 30 s of the machine's time."""
    forward, clock = SlowDevice(), Clock()

    async def scenario():
        batcher = Batcher(forward, BatchPolicy(max_batch_tokens=1000, max_wait_s=30), clock)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(call(10, "first"), None, "first"))
        await until(lambda: forward.batches == [["first"]])  # on the device until on_device opens
        clock.advance(100)
        lone = asyncio.ensure_future(batcher.submit(call(10, "lone"), None, "lone"))
        await until(lambda: forward.batches == [["first"], ["lone"]])  # launched at once
        forward.on_device.set()
        assert (await lone).queue_seconds == 0
        assert (await first).batch_requests == 1
        await batcher.close()

    run(scenario)
    assert forward.batches == [["first"], ["lone"]]


async def behind_a_blocker(forward: FakeForward, clock: Clock, late_s: float):
    """A started batcher on ``clock`` with a batch in flight ("blocker", held at ``forward``'s
    closed gate) and two calls queued behind it: "late", whose deadline is ``late_s`` away, and
    "gone", without one."""
    batcher = Batcher(forward, BatchPolicy(max_wait_s=0), clock)
    batcher.start()
    forward.gate.clear()
    blocker = asyncio.ensure_future(batcher.submit(call(10, "blocker"), None, "blocker"))
    await until(lambda: forward.started == ["blocker"])
    late = asyncio.ensure_future(batcher.submit(call(10, "late"), clock() + late_s, "late"))
    gone = asyncio.ensure_future(batcher.submit(call(10, "gone"), None, "gone"))
    await asyncio.sleep(0)
    return batcher, blocker, late, gone


def test_calls_whose_deadline_passed_or_that_were_cancelled_in_the_queue_are_never_scored():
    forward, clock = FakeForward(), Clock()

    async def scenario():
        batcher, blocker, late, gone = await behind_a_blocker(forward, clock, late_s=0.05)
        assert batcher.depth == 2
        gone.cancel()
        await asyncio.sleep(0)
        assert batcher.depth == 1
        clock.advance(0.06)  # late's deadline passes
        forward.gate.set()
        await blocker
        with pytest.raises(Dropped) as dropped:
            await late
        assert dropped.value.reason == "deadline"
        with pytest.raises(Dropped):
            await batcher.submit(call(10, "expired"), clock() - 1, "expired")
        await batcher.close()

    run(scenario)
    assert forward.batches == [["blocker"]]


def test_a_call_cancelled_just_before_the_batch_is_cut_is_dropped_once_and_the_loop_lives_on():
    """The client's deadline cancels a queued call (its handler's await) at about the moment the
    server's deadline passes; the future is cancelled at once but its done callback runs a loop
    step later, so a batch cut in between meets a done future in the queue. A CI run's batcher
    loop died on it (InvalidStateError setting Dropped on the cancelled future) and every later
    call waited for nothing. Each such call is counted once, and the next call is scored."""
    from scorer import metrics

    def dropped(reason: str) -> float:
        return metrics.DROPPED.labels(reason=reason)._value.get()

    forward, clock = FakeForward(), Clock()

    async def scenario():
        batcher, blocker, late, gone = await behind_a_blocker(forward, clock, late_s=0.02)
        clock.advance(0.03)  # late's deadline has passed; both still queued
        before = dropped("deadline") + dropped("cancelled")
        late.cancel()
        gone.cancel()
        assert batcher._take() == []  # in the same loop step: the done callbacks have not run
        await asyncio.sleep(0)
        assert batcher.depth == 0
        assert dropped("deadline") + dropped("cancelled") == before + 2
        forward.gate.set()
        await blocker
        after = await batcher.submit(call(10, "after"), None, "after")
        assert after.batch_requests == 1
        await batcher.close()

    run(scenario)
    assert forward.batches == [["blocker"], ["after"]]


def test_a_fault_while_checking_a_queued_call_fails_that_call_alone():
    forward = FakeForward()

    async def scenario():
        batcher = Batcher(forward, BatchPolicy(max_wait_s=0))
        late = batcher._late

        def faulty(job, *args):
            if job.job.request.prompt == "poison":
                raise RuntimeError("policy fault")
            return late(job, *args)

        batcher._late = faulty
        batcher.start()
        forward.gate.clear()
        blocker = asyncio.ensure_future(batcher.submit(call(10, "blocker"), None, "blocker"))
        await until(lambda: forward.started == ["blocker"])
        first, poison, after = (
            asyncio.ensure_future(batcher.submit(call(10, name), None, name))
            for name in ("first", "poison", "after")
        )
        await asyncio.sleep(0)
        forward.gate.set()
        with pytest.raises(RuntimeError, match="policy fault"):
            await poison
        assert (await first).batch_requests == (await after).batch_requests == 2
        await blocker
        await batcher.close()

    run(scenario)
    assert forward.batches == [["blocker"], ["first", "after"]]


def test_a_fault_while_a_batch_is_cut_fails_the_call_at_the_head_and_the_loop_lives_on():
    forward = SlowDevice()  # "blocker" stays in flight until on_device opens

    async def scenario():
        batcher = Batcher(forward, BatchPolicy(max_wait_s=0.01))
        faults = [RuntimeError("policy fault")]

        def company_expected():  # asked while the batch is cut behind one in flight: fails once
            if faults:
                raise faults.pop()
            return False

        batcher._company_expected = company_expected
        batcher.start()
        blocker = asyncio.ensure_future(batcher.submit(call(10, "blocker"), None, "blocker"))
        await until(lambda: forward.batches == [["blocker"]])
        victim = asyncio.ensure_future(batcher.submit(call(10, "victim"), None, "victim"))
        with pytest.raises(RuntimeError, match="policy fault"):
            await victim
        after = asyncio.ensure_future(batcher.submit(call(10, "after"), None, "after"))
        await until(lambda: forward.batches == [["blocker"], ["after"]])
        forward.on_device.set()
        assert (await after).batch_requests == 1
        await blocker
        assert batcher.depth == 0
        await batcher.close()

    run(scenario)
    assert forward.batches == [["blocker"], ["after"]]


def test_out_of_memory_in_a_merged_batch_retries_each_call_alone():
    forward = FakeForward(oom_above=150, delay_s=0.05)

    async def scenario():
        batcher = Batcher(forward, BatchPolicy(max_wait_s=0.05))
        batcher.start()
        results = await asyncio.gather(
            *(batcher.submit(call(n, f"c{n}"), None, f"c{n}") for n in (50, 200, 60)), return_exceptions=True
        )
        await batcher.close()
        assert isinstance(results[1], OutOfMemory)
        assert [r.batch_requests for r in (results[0], results[2])] == [1, 1]

    run(scenario)
    assert forward.batches == [["c50"], ["c60"]]


def test_a_full_queue_refuses_at_once_and_close_finishes_what_is_queued():
    forward = FakeForward()

    async def scenario():
        batcher = Batcher(forward, BatchPolicy(max_wait_s=0, max_queue=2))
        batcher.start()
        forward.gate.clear()
        blocker = asyncio.ensure_future(batcher.submit(call(10, "blocker"), None, "blocker"))
        await until(lambda: forward.started == ["blocker"])
        queued = [asyncio.ensure_future(batcher.submit(call(10, f"q{i}"), None, f"q{i}")) for i in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):
            await batcher.submit(call(10, "refused"), None, "refused")
        forward.gate.set()
        await batcher.close()
        assert all(f.done() and not f.exception() for f in [blocker, *queued])
        with pytest.raises(Closed):
            await batcher.submit(call(10, "after"), None, "after")

    run(scenario)
    assert sorted(sum(forward.batches, [])) == ["blocker", "q0", "q1"]


def test_the_next_batch_is_launched_while_the_last_one_is_collected():
    """Two batches in flight at most: batch 1 launches before batch 0's results are in, batch 2
    only once they are."""
    events: list[tuple[str, str]] = []
    launched_c1 = threading.Event()

    def launch(batch: Sequence[Job]):
        name = batch[0].request.prompt
        events.append(("launch", name))
        if name == "c1":
            launched_c1.set()

        def collect():
            if name == "c0":  # on the device until the next batch is launched
                launched_c1.wait()
            events.append(("collected", name))
            return [ScoreResult((), "ragged", Usage(0, 0, tokens_of(t), 0)) for t in batch]

        return collect

    async def scenario():
        batcher = Batcher(launch, BatchPolicy(max_batch_tokens=100, max_wait_s=0))
        batcher.start()
        await asyncio.gather(*(batcher.submit(call(100, f"c{i}"), None, f"c{i}") for i in range(3)))
        await batcher.close()

    run(scenario)
    assert events.index(("launch", "c1")) < events.index(("collected", "c0"))
    assert events.index(("collected", "c0")) < events.index(("launch", "c2"))
    assert len(events) == 6


async def warmed(forward, policy: BatchPolicy, calls: int = 2, clock=time.monotonic) -> Batcher:
    """A started batcher whose forward-time model has seen ``calls`` batches of one 10-token call."""
    batcher = Batcher(forward, policy, clock)
    batcher.start()
    for i in range(calls):
        await batcher.submit(call(10, f"warm{i}"), None, f"warm{i}")
    return batcher


def test_under_light_load_a_short_batch_runs_on_the_event_loop_and_others_on_the_worker_threads():
    """Once the forward-time model has a fit, a short batch that finds nothing in flight while
    calls arrive far apart is launched on the loop's own thread (no hand-off: each costs an idle
    server a wake-up), and waited for there when nothing is queued behind it. A batch launched
    while another is in flight, in a burst of calls, or estimated long goes to the worker threads,
    so the next launch overlaps its device work and the loop answers meanwhile. The batcher's clock
    is the test's: a launch takes 0.5 ms of it (50 ms for "slow" calls), "first"'s results 20 ms."""
    import threading

    clock = Clock()
    seen: dict[str, tuple[str, str]] = {}  # call: (thread of its launch, thread of its collect)

    def launch(batch: Sequence[Job]):
        name, launched = batch[0].request.prompt, threading.current_thread().name
        clock.advance(0.05 if name.startswith("slow") else 0.0005)

        def collect():
            clock.advance(0.02 if name == "first" else 0.0)
            seen[name] = (launched, threading.current_thread().name)
            return [ScoreResult((), "ragged", Usage(0, 0, tokens_of(t), 0)) for t in batch]

        return collect

    async def scenario():
        batcher = await warmed(launch, BatchPolicy(max_batch_tokens=100, max_wait_s=0), clock=clock)
        clock.advance(0.03)
        await batcher.submit(call(10, "idle"), None, "idle")
        clock.advance(0.03)
        # both queued before the batcher runs: "first" goes alone (the budget), "second" behind it
        await asyncio.gather(*(batcher.submit(call(100, n), None, n) for n in ("first", "second")))
        clock.advance(0.03)
        await asyncio.gather(*(batcher.submit(call(100, f"burst{i}"), None, f"burst{i}") for i in range(8)))
        for i in range(4):  # the model comes to fit ~50 ms a batch: past INLINE_S
            clock.advance(0.2)
            await batcher.submit(call(100, f"slow{i}"), None, f"slow{i}")
        await batcher.close()
        return threading.current_thread().name

    loop = run(scenario)
    assert seen["warm0"][0].startswith("forward")  # no fit yet
    assert seen["idle"] == (loop, loop)
    assert seen["first"][0] == loop and seen["first"][1].startswith("collect")  # "second" queued behind it
    assert seen["second"][0].startswith("forward")  # "first" in flight
    assert all(seen[f"burst{i}"][0].startswith("forward") for i in range(8))
    assert seen["slow3"][0].startswith("forward")


def test_a_burst_is_admitted_only_as_far_as_the_batches_ahead_can_serve_it_in_time():
    """A burst past capacity, in miniature: a batch takes 0.2 s whatever its size and holds two calls, so
    the batcher serves 10 calls/s; 40 calls come at 50/s with 1.5 s each. All recent batches took
    the same time, so the per-token cost fits to 0: the queue ahead must count in batches, or every
    call is admitted and most expire. At least 90% of the admitted calls end in time, the others
    are refused at once, and the batcher is not idle for it."""
    forward = FakeForward(delay_s=0.2)
    deadline_s = 1.5

    async def one(batcher: Batcher, i: int) -> tuple[str, float]:
        submitted = time.monotonic()
        try:
            await batcher.submit(call(10, f"c{i}"), submitted + deadline_s, f"c{i}")
        except QueueFull:
            return "refused", time.monotonic() - submitted
        except Dropped:
            return "dropped", time.monotonic() - submitted
        took = time.monotonic() - submitted
        return ("in time" if took <= deadline_s else "late"), took

    async def scenario():
        batcher = await warmed(forward, BatchPolicy(max_batch_tokens=20, max_wait_s=0.002))
        calls = []
        for i in range(40):
            calls.append(asyncio.ensure_future(one(batcher, i)))
            await asyncio.sleep(0.02)
        outcomes = await asyncio.gather(*calls)
        await batcher.close()
        return outcomes

    outcomes = asyncio.run(asyncio.wait_for(scenario(), 30))
    admitted = [kind for kind, _ in outcomes if kind != "refused"]
    refused = [took for kind, took in outcomes if kind == "refused"]
    in_time = admitted.count("in time")
    assert in_time >= 0.9 * len(admitted), outcomes
    assert in_time >= 8, outcomes  # about 20 can be served in time; refusing too many is no fix
    assert refused and max(refused) < 0.05, outcomes


def test_a_call_behind_a_batch_in_flight_that_would_end_past_its_deadline_is_refused_at_once():
    """Alone the call's forward (0.3 s) would end before its deadline, but a batch launched 0.05 s
    before it still holds the device for about 0.25 s: refused at once, not dropped later. (Times
    on the batcher's clock: every batch takes 0.3 s of it.)"""
    clock = Clock()
    forward = FakeForward(delay_s=0.3, clock=clock)

    async def scenario():
        batcher = await warmed(forward, BatchPolicy(max_wait_s=0), clock=clock)
        forward.gate.clear()
        blocker = asyncio.ensure_future(batcher.submit(call(10, "blocker"), None, "blocker"))
        await until(lambda: forward.started[-1] == "blocker")
        clock.advance(0.05)
        with pytest.raises(QueueFull):
            await batcher.submit(call(10, "behind"), clock() + 0.45, "behind")
        in_time = asyncio.ensure_future(batcher.submit(call(10, "in-time"), clock() + 1.5, "in-time"))
        await asyncio.sleep(0)
        assert batcher.depth == 1  # admitted
        forward.gate.set()
        await in_time
        await blocker
        await batcher.close()

    run(scenario)
    assert sum(forward.batches, []) == ["warm0", "warm1", "blocker", "in-time"]


def test_a_call_admitted_behind_a_batch_that_runs_long_is_dropped_without_compute():
    """The estimate is wrong when a batch runs longer than the recent ones: the call behind it,
    admitted, can no longer end in time when its turn comes, and is dropped unscored."""
    times = {"slow": 1.0}
    scored: list[str] = []
    clock, launching, started = Clock(), threading.Event(), []
    launching.set()

    def forward(batch: Sequence[Job]):
        started.append(batch[0].request.prompt)
        launching.wait()
        clock.advance(max(times.get(t.request.prompt, 0.1) for t in batch))
        scored.extend(t.request.prompt for t in batch)
        results = [ScoreResult((), "ragged", Usage(0, 0, tokens_of(t), 0)) for t in batch]
        return lambda: results

    async def scenario():
        batcher = await warmed(forward, BatchPolicy(max_wait_s=0), clock=clock)
        launching.clear()
        slow = asyncio.ensure_future(batcher.submit(call(10, "slow"), None, "slow"))
        await until(lambda: started[-1] == "slow")  # launched: held at the gate
        clock.advance(0.05)
        behind = asyncio.ensure_future(batcher.submit(call(10, "behind"), clock() + 1.0, "behind"))
        await asyncio.sleep(0)
        assert batcher.depth == 1  # admitted: 0.05 s left of the slow batch's estimate, 0.1 s its own
        launching.set()  # the slow batch takes 1.0 s
        await slow
        with pytest.raises(Dropped) as dropped:
            await behind
        assert dropped.value.reason in ("deadline", "unreachable")
        await batcher.close()

    run(scenario)
    assert scored == ["warm0", "warm1", "slow"]


def test_the_forward_time_model_counts_a_queue_in_batches_of_the_largest_size_seen():
    """The queue's estimate: n = min(calls, ceil(tokens / C)) batches of the queue's mean size, each
    at its predicted time plus the spread."""
    model = ForwardTimeModel()
    assert model.queue(3, 300, 1000) is None
    for tokens in (100, 100, 101, 99):
        model.observe(tokens, 0.5)
    assert model.predict(1000) == pytest.approx(0.5)  # one forward: the sizes barely differ, b is 0
    assert model.queue(0, 0, 1000) == 0
    assert model.queue(10, 1000, 16384) == pytest.approx(10 * 0.5)  # 1000 tokens in batches of 101
    assert model.queue(2, 1000, 16384) == pytest.approx(2 * 0.5)  # no more batches than calls
    assert model.queue(30, 1000, 50) == pytest.approx(20 * 0.25)  # nor larger than the budget; each
    assert model.predict(25) == pytest.approx(0.125)  # smaller batch its share of a (b is 0)
    model = ForwardTimeModel()
    model.observe(100, 0.15)
    model.observe(400, 0.45)
    assert model.predict(1600) == pytest.approx(1.65)  # a = 50 ms, b = 1 ms a token
    assert model.queue(4, 1600, 16384) == pytest.approx(4 * 0.05 + 1.6)  # 4 batches of 400
    model = ForwardTimeModel()
    model.observe(100, 0.4)
    model.observe(100, 0.6)
    assert model.predict(100) == pytest.approx(0.5)
    assert model.queue(3, 300, 16384) == pytest.approx(3 * (0.5 + 0.1))  # and the spread around the fit


def test_after_a_burst_of_large_batches_a_small_call_is_still_admitted():
    """Large batches all of one size fit ``a`` = their whole time: a small call must not be
    estimated at that (it would be refused, no batch would run, and the model never learn)."""
    model = ForwardTimeModel()
    for _ in range(8):
        model.observe(16384, 1.5)
    assert model.predict(16384) == pytest.approx(1.5)
    assert model.predict(400) == pytest.approx(1.5 * 400 / 16384)
    assert model.queue(1, 400, 16384) < 0.1
