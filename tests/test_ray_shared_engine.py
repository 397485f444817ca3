"""``engine_process=shared`` on Ray Serve, on the CPU: an application of two Scorer replicas (front
ends: Ray's calls, tokenizing) and one Engine replica (the engine, in a child process), on the
session's Ray; every forward batch sleeps ``FORWARD_S`` (the forward-delay test knob), so calls
are on the engine when a process dies.

- Both front ends serve, every call is computed by the one engine (its batches count them all),
  and each call scores as the engine alone scores it.
- A front end's process SIGKILLed under load: nothing outlives its deadline, its calls fail with
  the documented code, the other front end serves on, and Serve's new front end joins the same
  engine process.
- The Engine replica's process SIGKILLed under load: its engine process goes with it, calls fail
  in time, Serve replaces the Engine and both front ends (their health check finds their link
  gone), and calls succeed again.
"""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from ray_app import (
    ANSWER_LAG_S,
    DIED,
    ENGINE_DIED,
    LoadedApp,
    RayApp,
    died_on_replica,
    engine_pids,
    kill,
    longest_call,
    replica_pids,
    shared_engine_app,
    unrouted,
    wait_until,
)

pytestmark = pytest.mark.slow
SHARED = "shared"
FORWARD_S = 0.1
BURST, PERIOD_S = 4, 0.4  # 10 calls/s; a batch holds what arrived during the one before
DEADLINE_S = 5.0
STEADY_S = 3.0
RECOVERED_S = 3.0
PROMPT = "which passage explains prefix caching"
DOCS = (
    ("a", "the prompt is computed once and its keys and values are shared"),
    ("b", "bread rises when yeast ferments"),
)
SCHEME = "ragged"


def _computed(app: LoadedApp, port: int) -> float:
    """Calls the engine behind this metrics port has run in its batches."""
    return app.metric(port, "scorer_batch_requests_sum")


@pytest.fixture(scope="module")
def shared(ray_app: RayApp) -> Iterator[LoadedApp]:
    delay_ms = FORWARD_S * 1e3
    yield from shared_engine_app(
        ray_app, SHARED, PROMPT, DOCS, SCHEME, max_wait_ms=20, debug_forward_delay_ms=delay_ms
    )


def _the_engine(shared: LoadedApp) -> tuple[int, int, int]:
    """(Engine replica pid, its engine process pid, its metrics port), once it has them."""
    (replica, port) = wait_until(lambda: list(shared.ports("Engine").items()), 60, "no Engine replica")[0]
    (child,) = engine_pids(replica)
    return replica, child, port


def _serving(shared: LoadedApp, old: set[int]) -> dict[int, int] | None:
    """The front ends, once two are up and every one not in ``old`` has answered a call OK."""
    fronts = shared.ports()
    new = [port for pid, port in fronts.items() if pid not in old]
    try:
        return fronts if len(fronts) == 2 and new and all(shared.served(p) > 0 for p in new) else None
    except urllib.error.URLError:  # its /metrics is not up yet
        return None


def test_two_front_ends_share_one_engine_and_score_as_the_engine_alone(shared):
    fronts = shared.ports()
    assert len(fronts) == 2, fronts
    assert all(not engine_pids(pid) for pid in fronts)  # no engine of their own
    _, _, engine_port = _the_engine(shared)
    before = {port: shared.served(port) for port in fronts.values()}
    computed = _computed(shared, engine_port)

    with shared.load(DEADLINE_S, BURST, PERIOD_S) as load:
        time.sleep(STEADY_S)

    calls = load.calls
    assert {c.code for c in calls} == {grpc.StatusCode.OK}, [c.future.details() for c in calls]
    shared.assert_scores(calls)
    served = {port: shared.served(port) - n for port, n in before.items()}
    assert sum(served.values()) == len(calls) and min(served.values()) > 0, served
    assert _computed(shared, engine_port) - computed == len(calls)  # one engine ran them all
    print(f"\n{len(calls)} calls in {STEADY_S:g} s, OK per front end's metrics port: {served}")


def test_a_front_end_killed_under_load_the_other_serves_and_the_new_one_joins_the_same_engine(
    shared, ray_app
):
    fronts = shared.ports()
    engine_replica, engine, _ = _the_engine(shared)
    victim = min(fronts)
    (survivor,) = set(fronts) - {victim}

    with shared.load(DEADLINE_S, BURST, PERIOD_S) as load:
        time.sleep(1.0)
        holds = lambda: shared.metric(fronts[victim], "scorer_inflight_requests") >= 1  # noqa: E731
        wait_until(holds, 10, "the victim held no call")
        routed = ray_app.routed(shared.name)
        assert len(routed) == 2, routed
        killed = kill(victim)
        at_kill = shared.served(fronts[survivor])
        dropped = unrouted(ray_app, shared.name, routed)
        after = wait_until(
            lambda: _serving(shared, set(fronts)), 120, "no new front end served in 2 minutes", 0.1
        )
        recovered = time.monotonic()
        in_outage = shared.served(fronts[survivor]) - at_kill
        time.sleep(RECOVERED_S)
    calls = load.calls

    assert longest_call(calls) < DEADLINE_S + ANSWER_LAG_S
    failed = [c for c in calls if c.code != grpc.StatusCode.OK]
    assert {c.code for c in failed} <= {
        *DIED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }, {(c.code, c.future.details()) for c in failed}
    died = [c for c in failed if c.code in DIED]
    assert all(map(died_on_replica, died)), {c.future.details() for c in died}
    # sent after the kill, routed to the victim until HAProxy marked it down (docs/ray.md, Faults)
    late = [c.sent - killed for c in died if c.sent >= killed]
    assert all(c.sent < dropped for c in died), (late, dropped - killed)
    shared.assert_scores(calls)
    assert in_outage > 0
    assert victim not in after and survivor in after
    assert _the_engine(shared)[:2] == (engine_replica, engine)  # the same engine process serves on
    last = [c for c in calls if c.sent > calls[-1].sent - 1.0]
    assert all(c.code == grpc.StatusCode.OK for c in last), [c.code for c in last]
    print(
        f"\n{len(calls)} calls, {len(died)} answered as died (on the victim; {len(late)} sent after the"
        f" kill, HAProxy routed to it for {dropped - killed:.2f} s), {len(failed) - len(died)} other"
        f" failures; a new front end answered {recovered - killed:.1f} s after the kill; the survivor"
        f" answered {in_outage:g} calls meanwhile"
    )


def test_the_engine_killed_under_load_serve_replaces_it_and_its_front_ends_and_calls_succeed_again(shared):
    fronts = shared.ports()
    engine_replica, engine, _ = _the_engine(shared)

    with shared.load(DEADLINE_S, BURST, PERIOD_S) as load:
        time.sleep(1.0)
        killed = kill(engine_replica)
        wait_until(
            lambda: load.first_answer(after=killed + 1.0), 180, "no call succeeded within 3 minutes", 0.1
        )
        recovered = time.monotonic()
        wait_until(
            lambda: not set(fronts) & replica_pids(SHARED), 60, "a front end of the dead engine stayed"
        )
        time.sleep(RECOVERED_S)
    calls = load.calls

    assert longest_call(calls) < DEADLINE_S + ANSWER_LAG_S
    failed = {c.code for c in calls if c.code != grpc.StatusCode.OK}
    assert grpc.StatusCode.UNAVAILABLE in failed, failed
    assert failed <= ENGINE_DIED, failed
    assert not Path(f"/proc/{engine}").exists()  # the engine process went with its replica
    new_replica, new_engine, _ = _the_engine(shared)
    assert new_replica != engine_replica and new_engine != engine
    shared.assert_scores(calls)
    last = [c for c in calls if c.sent > calls[-1].sent - 1.0]
    assert all(c.code == grpc.StatusCode.OK for c in last), [c.code for c in last]
    print(
        f"\n{len(calls)} calls, failed {sorted(c.name for c in failed)}; calls succeeded again "
        f"{recovered - killed:.1f} s after the kill"
    )
