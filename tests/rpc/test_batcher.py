"""The batcher's policy in process, with a fake forward: budget, wait, drops, retries, closing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest
import torch

from scorer.engine import ScoreResult, Usage
from scorer.planning import Shape, get
from scorer.request import Doc, Job, ScoreRequest
from scorer.server.batcher import Batcher, BatchPolicy, Closed, Dropped, OutOfMemory, QueueFull


def call(tokens: int, name: str = "") -> Job:
    req = ScoreRequest(prompt=name or "q", docs=[Doc("d")])
    prefix = (1,) * (tokens - 1)
    shape = Shape(tokens - 1, (1,))
    scheme = get("ragged")
    return Job(req, prefix, ((2,),), (1,), (0,), (3,), shape, scheme, 0, scheme.rows(shape))


def tokens_of(t: Job) -> int:
    return len(t.prefix_ids) + sum(len(i) for i in t.items)


class FakeForward:
    """Records every batch; raises torch.OutOfMemoryError for a batch over ``oom_above`` tokens."""

    def __init__(self, oom_above: int = 0, delay_s: float = 0.0) -> None:
        self.batches: list[list[str]] = []
        self.oom_above = oom_above
        self.delay_s = delay_s

    def __call__(self, batch: Sequence[Job]):
        time.sleep(self.delay_s)
        if self.oom_above and sum(tokens_of(t) for t in batch) > self.oom_above:
            raise torch.OutOfMemoryError("fake")
        self.batches.append([t.request.prompt for t in batch])
        results = [ScoreResult((), "ragged", Usage(0, 0, tokens_of(t), 0)) for t in batch]
        return lambda: results


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


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


def test_a_call_over_the_budget_runs_alone_and_a_lone_call_waits_at_most_max_wait():
    forward = FakeForward()

    async def scenario():
        batcher = Batcher(forward, BatchPolicy(max_batch_tokens=100, max_wait_s=0.05))
        batcher.start()
        big, small = await asyncio.gather(
            batcher.submit(call(500, "big"), None, "big"), batcher.submit(call(10, "small"), None, "small")
        )
        assert big.batch_requests == small.batch_requests == 1
        lone = await batcher.submit(call(10, "lone"), None, "lone")
        assert 0.04 <= lone.queue_seconds < 1.0
        await batcher.close()

    run(scenario)
    assert forward.batches == [["big"], ["small"], ["lone"]]


def test_calls_whose_deadline_passed_or_that_were_cancelled_in_the_queue_are_never_scored():
    forward = FakeForward(delay_s=0.2)

    async def scenario():
        batcher = Batcher(forward, BatchPolicy(max_wait_s=0))
        batcher.start()
        blocker = asyncio.ensure_future(batcher.submit(call(10, "blocker"), None, "blocker"))
        await asyncio.sleep(0.05)
        late = asyncio.ensure_future(batcher.submit(call(10, "late"), time.monotonic() + 0.05, "late"))
        gone = asyncio.ensure_future(batcher.submit(call(10, "gone"), None, "gone"))
        await asyncio.sleep(0.01)
        assert batcher.depth == 2
        gone.cancel()
        await asyncio.sleep(0)
        assert batcher.depth == 1
        await blocker
        with pytest.raises(Dropped) as dropped:
            await late
        assert dropped.value.reason == "deadline"
        with pytest.raises(Dropped):
            await batcher.submit(call(10, "expired"), time.monotonic() - 1, "expired")
        await batcher.close()

    run(scenario)
    assert forward.batches == [["blocker"]]


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
    forward = FakeForward(delay_s=0.1)

    async def scenario():
        batcher = Batcher(forward, BatchPolicy(max_wait_s=0, max_queue=2))
        batcher.start()
        blocker = asyncio.ensure_future(batcher.submit(call(10, "blocker"), None, "blocker"))
        await asyncio.sleep(0.02)
        queued = [asyncio.ensure_future(batcher.submit(call(10, f"q{i}"), None, f"q{i}")) for i in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):
            await batcher.submit(call(10, "refused"), None, "refused")
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

    def launch(batch: Sequence[Job]):
        name = batch[0].request.prompt
        events.append(("launch", name))

        def collect():
            time.sleep(0.2)
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
