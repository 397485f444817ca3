"""Deadlines and faults on Ray Serve: a second application on the session's Ray whose replica
sleeps SLOW_FORWARD_S before every forward batch (the forward-delay test knob), so calls wait in
the replica's queue behind a batch; once with the engine in the replica's process, once in a child
process of its own (``engine_process``, on by default with a GPU), once as the front end of a
shared engine (``engine_process=shared``).

- The client's deadline reaches the replica as ``x-timeout-ms`` metadata (Ray's proxy drops gRPC
  deadlines): a call whose deadline passes while queued is answered DEADLINE_EXCEEDED by the
  replica, at its deadline, and never computed.
- The replica's process killed under load: no call outlives its deadline, the calls that were
  on it fail with a documented code (docs/ray.md), Serve starts a new replica, later calls succeed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from ray import serve
from ray_app import (
    ANSWER_LAG_S,
    APP,
    DIED,
    ENGINE_DIED,
    Load,
    RayApp,
    died_on_replica,
    engine_pids,
    free_port,
    kill,
    longest_call,
    replica_pids,
    scrape,
    wait_for_applications,
)

from scorer.ray_serve import EngineDeployment, ScorerArgs, ScorerDeployment
from scorer.runtime import build_engine
from scorer.server.convert import request_from_proto
from scorer.v1 import scorer_pb2 as pb
from scorer.v1 import scorer_pb2_grpc

SLOW = "slow"
SLOW_FORWARD_S = 1.0
ROUTED = (("application", SLOW),)
pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class SlowApp:
    channel: grpc.Channel
    metrics_urls: tuple[str, ...]  # the replica's, and a shared engine's (its batches, its drops)
    engine_process: str  # off, on, shared

    def stub(self) -> scorer_pb2_grpc.ScorerStub:
        return scorer_pb2_grpc.ScorerStub(self.channel)

    def metric(self, name: str, **labels: str) -> float:
        """The application's count: the sum over its replicas' ports."""
        return sum(scrape(url, name, **labels) for url in self.metrics_urls)

    def wait_metric(self, name: str, value: float, timeout_s: float = 30.0) -> None:
        give_up = time.monotonic() + timeout_s
        while self.metric(name) < value:
            assert time.monotonic() < give_up, f"{name} never reached {value}"
            time.sleep(0.02)


ENGINES = {"off": "engine-in-replica", "on": "engine-process", "shared": "shared-engine"}


@pytest.fixture(scope="module", params=list(ENGINES), ids=list(ENGINES.values()))
def slow_app(ray_app: RayApp, request) -> Iterator[SlowApp]:
    args = ScorerArgs(
        model=str(ray_app.model_dir),
        device="cpu",
        engine_process=request.param,
        max_wait_ms=0,
        debug_forward_delay_ms=SLOW_FORWARD_S * 1e3,
        metrics_host="127.0.0.1",
        metrics_port=free_port(),
    )
    # no CPU reserved: the session's Ray has 2, and the shared application's replica holds one
    no_cpu = {"num_cpus": 0}
    deployment = ScorerDeployment.options(ray_actor_options=no_cpu)
    shared = request.param == "shared"
    engine = (EngineDeployment.options(ray_actor_options=no_cpu).bind(args.model_dump()),) if shared else ()
    handle = serve.run(deployment.bind(args.model_dump(), *engine), name=SLOW, route_prefix="/slow")
    ports = [handle.metrics_port.remote().result()]
    if shared:
        ports.append(serve.get_deployment_handle("Engine", SLOW).metrics_port.remote().result())
    with grpc.insecure_channel(ray_app.grpc_target) as channel:
        wait_for_applications(channel, {APP, SLOW})
        try:
            yield SlowApp(channel, tuple(f"http://127.0.0.1:{p}/metrics" for p in ports), request.param)
        finally:
            serve.delete(SLOW)
            wait_for_applications(channel, {APP})  # the other Ray tests call without application metadata


def _request(request_id: str) -> pb.ScoreDocsRequest:
    return pb.ScoreDocsRequest(
        prompt="q",
        docs=[pb.Doc(text="a document")],
        options=pb.ScoreOptions(scheme="ragged", template="plain"),
        request_id=request_id,
    )


def test_a_deadline_sent_as_metadata_drops_the_call_queued_in_the_replica(slow_app):
    """First on the fresh replica: its forward-time model has seen no batch yet, so the call is
    admitted (with one fitted, the replica would refuse it at once with RESOURCE_EXHAUSTED)."""
    stub = slow_app.stub()
    computed = slow_app.metric("scorer_batch_requests_sum")
    dropped = slow_app.metric("scorer_requests_dropped_total", reason="deadline")
    batches = slow_app.metric("scorer_batch_requests_count")
    blocker = stub.ScoreDocs.future(_request("blocker"), metadata=ROUTED, timeout=30)
    slow_app.wait_metric("scorer_batch_requests_count", batches + 1)  # its forward has begun

    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:  # the client's own deadline is 30 s: the replica answers
        stub.ScoreDocs(_request("late"), metadata=(*ROUTED, ("x-timeout-ms", "300")), timeout=30)
    waited = time.monotonic() - started

    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, caught.value.details()
    assert "deadline" in caught.value.details()
    assert 0.3 <= waited < SLOW_FORWARD_S - 0.2  # at its deadline, not once the blocker's batch ended
    assert len(blocker.result().results) == 1
    assert slow_app.metric("scorer_requests_dropped_total", reason="deadline") == dropped + 1
    assert slow_app.metric("scorer_requests_total", code="DEADLINE_EXCEEDED") >= 1
    # one call more, answered: batches start in queue order, so a forward of "late" would have
    # been counted before this one's
    assert len(stub.ScoreDocs(_request("after"), metadata=ROUTED, timeout=30).results) == 1
    assert slow_app.metric("scorer_batch_requests_sum") == computed + 2  # the blocker and "after" alone


def test_scores_equal_the_engine_alone(slow_app, ray_app):
    """Through the replica, with its engine in the replica's process or in its own, a call scores
    as the engine alone scores it (the engine process's metrics reach the replica's /metrics: the
    test above counted its batches and drops there)."""
    engine = build_engine(ray_app.model_dir, device="cpu")
    docs = [pb.Doc(text=f"document number {i}") for i in range(3)]
    request = pb.ScoreDocsRequest(prompt="which one", docs=docs, options=pb.ScoreOptions(scheme="ragged"))
    reply = slow_app.stub().ScoreDocs(request, metadata=ROUTED, timeout=30)
    want = engine.score(request_from_proto(request, "alone"))
    assert [r.score for r in reply.results] == pytest.approx([d.score for d in want.results], abs=1e-4)


DEADLINE_S = 5.0
RATE = 10.0  # calls/s: ~10 queued behind each 1 s batch, so calls are on the replica when it dies
RECOVERED_S = 5.0  # the load runs this long after the new replica's first answer


def test_a_replica_killed_under_load_fails_its_calls_in_time_and_serves_again(slow_app):
    """SIGKILL to the replica's process while ~10 calls are on it and more arrive: every call ends
    by its deadline; those on the replica fail with UNAVAILABLE from Ray's HAProxy (their streams
    reset), those sent meanwhile wait in HAProxy for a replica (DEADLINE_EXCEEDED at the client's
    deadline if none comes in time); Serve starts a new replica and the calls then succeed."""
    (pid,) = replica_pids(SLOW)
    engines = engine_pids(pid)
    assert len(engines) == (slow_app.engine_process == "on")  # a shared engine is another replica's child
    with Load(slow_app.stub(), lambda i: _request(f"load-{i}"), SLOW, DEADLINE_S, period_s=1 / RATE) as load:
        time.sleep(3.0)
        killed = kill(pid)
        while not (recovered := load.first_answer(after=killed)):
            assert time.monotonic() - killed < 120, "no call succeeded on a new replica within 2 minutes"
            time.sleep(0.05)
        time.sleep(max(0.0, recovered + RECOVERED_S - time.monotonic()))
    calls = load.calls

    assert longest_call(calls) < DEADLINE_S + ANSWER_LAG_S  # nothing hung past its deadline
    failed = {c.code for c in calls if c.code != grpc.StatusCode.OK}
    assert failed <= {
        *DIED,  # on the replica when it died
        grpc.StatusCode.DEADLINE_EXCEEDED,  # waiting for a replica
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # refused by the replica's admission (its queue ahead)
    }, failed
    died = [c for c in calls if c.code in DIED]
    assert died and all(map(died_on_replica, died)), {c.future.details() for c in died}
    # a call sent after the kill may still be routed to the dead replica until HAProxy's health check
    # sees it gone (seen on a loaded 2-core host); none sent once a new replica answered may die
    assert all(c.sent < recovered for c in died)
    (new_pid,) = replica_pids(SLOW)
    assert new_pid != pid
    last = [c for c in calls if c.sent > calls[-1].sent - 2.0]
    assert all(c.code == grpc.StatusCode.OK for c in last), [c.code for c in last]
    assert not any(Path(f"/proc/{e}").exists() for e in engines)  # the engine went with its replica


def test_a_replica_whose_engine_process_dies_is_replaced(slow_app):
    """SIGKILL to the engine process alone: the calls on it fail UNAVAILABLE at once (its
    connection closed), Serve's health check finds the replica unhealthy and replaces it, and
    calls succeed again."""
    if slow_app.engine_process != "on":  # shared: tests/test_ray_shared_engine.py kills the Engine
        pytest.skip("the replica has no engine process of its own")
    (pid,) = replica_pids(SLOW)
    (engine,) = engine_pids(pid)
    with Load(
        slow_app.stub(), lambda i: _request(f"engine-{i}"), SLOW, DEADLINE_S, period_s=1 / RATE
    ) as load:
        time.sleep(2.0)
        killed = kill(engine)
        while not (recovered := load.first_answer(after=killed + 1.0)):
            assert time.monotonic() - killed < 120, "no call succeeded on a new replica within 2 minutes"
            time.sleep(0.05)
        time.sleep(max(0.0, recovered + RECOVERED_S - time.monotonic()))
    calls = load.calls
    assert longest_call(calls) < DEADLINE_S + ANSWER_LAG_S
    failed = {c.code for c in calls if c.code != grpc.StatusCode.OK}
    assert grpc.StatusCode.UNAVAILABLE in failed, failed
    assert failed <= ENGINE_DIED, failed
    assert replica_pids(SLOW) != {pid}
    last = [c for c in calls if c.sent > calls[-1].sent - 2.0]
    assert all(c.code == grpc.StatusCode.OK for c in last), [c.code for c in last]
