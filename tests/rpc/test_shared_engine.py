"""The engine process of ``engine_process=shared`` without Ray: its owner (the Engine replica)
starts it, other processes' front ends join it at its socket and leave it at any time, and it stops
with its owner. Here the front ends are links in this process, as a Ray front-end replica's is."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from scorer.models.tiny import ensure_tiny_model
from scorer.request import Doc, ScoreRequest
from scorer.server.batcher import Closed
from scorer.server.engine_process import EngineProcess
from scorer.server.frontend_process import attach
from scorer.server.link import FrontLink
from scorer.settings import Settings

FORWARD_S = 0.3  # every batch sleeps this long first: a call is still on the engine when its front end goes
REQUEST = ScoreRequest("which passage explains caching", (Doc("keys are computed once"), Doc("yeast")))


def _settings(model_dir: Path) -> Settings:
    delay_ms = FORWARD_S * 1e3
    return Settings(model=str(model_dir), device="cpu", max_wait_ms=20, debug_forward_delay_ms=delay_ms)


async def _join(engine: EngineProcess, settings: Settings, name: str):
    link = FrontLink(name)
    await link.connect(engine.path)
    return link, await attach(link, settings, lambda: None)


async def _score(service, request_id: str):
    job, _ = await service.tokenize(REQUEST)
    return await service.score(job, time.monotonic() + 30, request_id)


def test_front_ends_join_share_batches_leave_and_the_engine_stops_with_its_owner(
    scorer_cache, engine, tmp_path, monkeypatch
):
    settings = _settings(ensure_tiny_model(scorer_cache))
    monkeypatch.setenv("SCORER_STACK_SAMPLES", str(tmp_path / "stacks.txt"))  # the child's sampler
    want = [d.score for d in engine.score(REQUEST).results]

    async def run() -> None:
        shared = EngineProcess(settings)
        owner = await shared.start()
        try:
            (a, front_a), (b, front_b) = [await _join(shared, settings, f"replica-{n}") for n in "ab"]
            # both front ends' calls, sent together, meet in the engine's batches
            calls = [_score(s, f"{n}-{i}") for i in range(3) for n, s in (("a", front_a), ("b", front_b))]
            scored = await asyncio.gather(*calls)
            for s in scored:
                assert [d.score for d in s.result.results] == pytest.approx(want, abs=1e-4)
            assert max(s.batch_requests for s in scored) >= 2

            # a front end that leaves with a call on the engine: the engine drops it and goes on
            job, _ = await front_a.tokenize(REQUEST)
            leaving = asyncio.create_task(front_a.score(job, time.monotonic() + 30, "leaving"))
            await asyncio.sleep(0)  # the task's first step sends the call, then awaits its answer
            assert not leaving.done()  # sent: the engine reads it before the end of the link
            await a.close()
            with pytest.raises(Closed):
                await leaving
            assert shared.alive()
            again = await _score(front_b, "after")
            assert [d.score for d in again.result.results] == pytest.approx(want, abs=1e-4)

            # a front end that joins late is served at once
            c, front_c = await _join(shared, settings, "replica-c")
            late = await _score(front_c, "late")
            assert [d.score for d in late.result.results] == pytest.approx(want, abs=1e-4)
        finally:
            await owner.close()
            await shared.close()  # the owner's link closes: the engine process exits
        assert not shared.proc.is_alive() and shared.proc.exitcode == 0
        stacks = (tmp_path / f"stacks.txt.engine-{shared.proc.pid}").read_text().splitlines()
        assert any(line.startswith("forward_0;") for line in stacks)  # its batches' thread, sampled
        for link, front in ((b, front_b), (c, front_c)):  # those still joined learn nothing will answer
            for _ in range(100):
                if link.gone:
                    break
                await asyncio.sleep(0.02)
            assert link.gone
            with pytest.raises(Closed):
                await _score(front, "gone")

    asyncio.run(run())
