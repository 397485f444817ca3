"""Two replicas of the scorer behind Serve's gRPC proxy, on the CPU (what of issue 16 a machine
without two GPUs can show: Serve's routing and its fault path, not capacity).

An application ``pair`` of two replicas on the session's Ray, whose capacity is fixed by
construction: every forward batch sleeps ``FORWARD_S`` (the forward-delay test knob) and holds one
call (``max_batch_tokens`` is one call's tokens), so a replica serves ``1 / FORWARD_S`` calls/s
and the pair twice that, whatever the CPU. The load is half of it: ``BURST`` calls every
``PERIOD_S``, each with a ``DEADLINE_S`` deadline.

- Under that load both replicas serve calls (each one's own ``scorer_requests_total`` grows), and
  every call's scores equal the engine's in this process within 1e-4.
- One replica's process SIGKILLed while it holds calls: no call outlives its deadline, the calls
  that fail have the codes of docs/ray.md (Faults), the other replica keeps serving through the
  outage, and Serve starts a new replica that serves beside it.
"""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from ray import serve
from ray_app import (
    APP,
    DIED,
    DIED_CODE,
    Load,
    RayApp,
    Sent,
    free_port,
    kill,
    listening_ports,
    replica_pids,
    scrape,
    wait_for_applications,
)

from scorer.ray_serve import ScorerArgs, deployment_for
from scorer.request import Doc, ScoreOptions, ScoreRequest
from scorer.runtime import build_engine
from scorer.v1 import scorer_pb2 as pb
from scorer.v1 import scorer_pb2_grpc

pytestmark = pytest.mark.slow
PAIR = "pair"
TOLERANCE = 1e-4
FORWARD_S = 0.2  # each batch of one call: 5 calls/s a replica, 10 the pair
BURST, PERIOD_S = 4, 0.8  # 5 calls/s, half the pair's capacity; a burst puts 2 calls on each replica
DEADLINE_S = 5.0
STEADY_S = 4.0
RECOVERED_S = 4.0  # the load runs this long after the new replica's first answer
PROMPT = "which passage explains prefix caching"
DOCS = (
    ("a", "the prompt is computed once and its keys and values are shared"),
    ("b", "bread rises when yeast ferments"),
    ("c", "cascade attention merges a shared level and a unique level"),
)
SCHEME = "ragged"


@dataclass(frozen=True)
class Pair:
    channel: grpc.Channel
    metrics_ports: range  # where the replicas' /metrics listen: the first free port of the range each
    expected: list[float]  # the engine's scores in this process

    def load(self) -> Load:
        stub = scorer_pb2_grpc.ScorerStub(self.channel)
        return Load(stub, _request, PAIR, DEADLINE_S, burst=BURST, period_s=PERIOD_S)

    def replicas(self) -> dict[int, int]:
        """pid -> metrics port of each replica process that has opened its /metrics."""
        found = {pid: listening_ports(pid) & set(self.metrics_ports) for pid in replica_pids(PAIR)}
        return {pid: min(ports) for pid, ports in found.items() if ports}

    def metric(self, port: int, name: str, **labels: str) -> float:
        return scrape(f"http://127.0.0.1:{port}/metrics", name, **labels)

    def served(self, port: int) -> float:
        """Calls that replica answered OK since its process started."""
        return self.metric(port, "scorer_requests_total", code="OK")


def _request(i: int) -> pb.ScoreDocsRequest:
    return pb.ScoreDocsRequest(
        prompt=PROMPT,
        docs=[pb.Doc(id=doc_id, text=text) for doc_id, text in DOCS],
        options=pb.ScoreOptions(scheme=SCHEME),
        request_id=f"pair-{i}",
    )


@pytest.fixture(scope="module")
def pair(ray_app: RayApp) -> Iterator[Pair]:
    engine = build_engine(ray_app.model_dir, device="cpu")
    request = ScoreRequest(
        PROMPT, tuple(Doc(text, doc_id) for doc_id, text in DOCS), options=ScoreOptions(scheme=SCHEME)
    )
    expected = [d.score for d in engine.score(request).results]
    first_port = free_port()
    args = ScorerArgs(
        model=str(ray_app.model_dir),
        device="cpu",
        max_wait_ms=0,
        max_batch_tokens=engine.tokenize(request).tokens,  # one call a batch
        debug_forward_delay_ms=FORWARD_S * 1e3,
        metrics_host="127.0.0.1",
        metrics_port=first_port,
    )
    # no CPU reserved: the session's Ray has 2, and the shared application's replica holds one
    deployment = deployment_for(args).options(num_replicas=2, ray_actor_options={"num_cpus": 0})
    serve.run(deployment.bind(args.model_dump()), name=PAIR, route_prefix=f"/{PAIR}")
    with grpc.insecure_channel(ray_app.grpc_target) as channel:
        wait_for_applications(channel, {APP, PAIR})
        try:
            yield Pair(channel, range(first_port, first_port + args.metrics_port_tries), expected)
        finally:
            serve.delete(PAIR)
            wait_for_applications(channel, {APP})  # the other Ray tests call without application metadata


def _assert_scores(pair: Pair, calls: list[Sent]) -> None:
    for c in calls:
        if c.code == grpc.StatusCode.OK:
            scores = [r.score for r in c.future.result().results]
            assert scores == pytest.approx(pair.expected, abs=TOLERANCE), c.future.result().request_id


def test_two_replicas_split_the_load_and_score_as_the_engine(pair):
    replicas = pair.replicas()
    assert len(replicas) == 2, replicas
    before = {port: pair.served(port) for port in replicas.values()}

    with pair.load() as load:
        time.sleep(STEADY_S)

    served = {port: pair.served(port) - n for port, n in before.items()}
    calls = load.calls
    assert {c.code for c in calls} == {grpc.StatusCode.OK}, [c.future.details() for c in calls]
    _assert_scores(pair, calls)
    assert sum(served.values()) == len(calls)
    # Serve's router sends each call to the less loaded of two replicas (with two: of both)
    assert min(served.values()) >= len(calls) / 4, served
    print(f"\n{len(calls)} calls in {STEADY_S:g} s, OK calls per replica port: {served}")


def _wait(condition, timeout_s: float, what: str, every_s: float = 0.01):
    give_up = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < give_up, what
        time.sleep(every_s)
    return value


def _serving(pair: Pair, old: set[int]) -> dict[int, int] | None:
    """The replicas, once one that is not in ``old`` has answered a call OK."""
    replicas = pair.replicas()
    new = [port for pid, port in replicas.items() if pid not in old]
    try:
        return replicas if new and pair.served(new[0]) > 0 else None
    except urllib.error.URLError:  # its /metrics is not up yet
        return None


def test_one_replica_killed_under_load_the_other_serves_and_serve_brings_it_back(pair):
    replicas = pair.replicas()
    assert len(replicas) == 2, replicas
    victim = min(replicas)
    (survivor,) = set(replicas) - {victim}
    victim_port, survivor_port = replicas[victim], replicas[survivor]

    with pair.load() as load:
        time.sleep(2 * PERIOD_S)
        # just after a burst, while the victim holds a call in its forward and one queued
        _wait(
            lambda: pair.metric(victim_port, "scorer_inflight_requests") >= 2, 10, "the victim held no calls"
        )
        killed = kill(victim)
        survivor_at_kill = pair.served(survivor_port)
        after = _wait(lambda: _serving(pair, set(replicas)), 120, "no new replica served in 2 minutes", 0.1)
        recovered = time.monotonic()
        survivor_in_outage = pair.served(survivor_port) - survivor_at_kill
        (new_port,) = set(after.values()) - {survivor_port}
        back = {port: pair.served(port) for port in after.values()}
        time.sleep(RECOVERED_S)
        back = {port: pair.served(port) - n for port, n in back.items()}
    calls = load.calls

    assert max(c.ended - c.sent for c in calls) < DEADLINE_S + 0.5  # nothing hung past its deadline
    failed = [c for c in calls if c.code != grpc.StatusCode.OK]
    assert {c.code for c in failed} <= {
        DIED_CODE,  # on the victim when it died
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }, {(c.code, c.future.details()) for c in failed}
    died = [c for c in failed if c.code == DIED_CODE]
    assert died and all(DIED.match(c.future.details()) for c in died), {c.future.details() for c in died}
    assert all(c.sent < killed for c in died)
    _assert_scores(pair, calls)

    outage = [c for c in calls if killed < c.sent < recovered]
    ok = [c for c in outage if c.code == grpc.StatusCode.OK]
    # The survivor alone is at its full capacity (half the pair's) and shares the two cores with the
    # new replica's start: on the 2-core VM, idle or with one busy loop beside the test, every call
    # of the outage succeeded; with both cores kept busy, 3 in 4 (the others ended at their
    # deadlines or were refused at once by the survivor's admission).
    assert survivor_in_outage > 0 and len(ok) > len(outage) / 2, [
        (c.code, c.future.details()) for c in outage if c not in ok
    ]

    assert victim not in after and survivor in after and len(after) == 2, after
    assert all(n > 0 for n in back.values()), back  # both serve again
    slowest = max(c.ended - c.sent for c in outage)
    print(
        f"\n{len(calls)} calls; {len(died)} {DIED_CODE.name}, sent before the kill, ended by "
        f"{max(c.ended for c in died) - killed:+.3f} s from it ({died[0].future.details()!r}); "
        f"{len(failed) - len(died)} other failures; the new replica answered {recovered - killed:.1f} s "
        f"after the kill (metrics port {new_port}; the victim's {victim_port}); in between the survivor "
        f"answered {survivor_in_outage:g} calls and all {len(outage)} sent then succeeded (slowest "
        f"{slowest:.2f} s); then OK calls per replica port in {RECOVERED_S:g} s: {back}"
    )
