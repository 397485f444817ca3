"""SIGTERM: NOT_SERVING at once, new calls served through the drain, then refused; calls in flight
finish; exit code 0."""

from __future__ import annotations

import random
import re
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from rpc_harness import start_server
from rpc_requests import random_request

DRAIN_S = 1.5
FORWARD_DELAY_S = 0.3


@pytest.mark.slow
def test_sigterm_during_load_completes_every_call_in_flight_and_exits_0(scorer_cache, server_logs):
    server = start_server(
        scorer_cache,
        server_logs,
        ["--drain-seconds", str(DRAIN_S), "--debug-forward-delay-ms", str(FORWARD_DELAY_S * 1e3)],
    )
    rng = random.Random(3)
    stub = server.stub()

    def send(name: str, calls: int) -> list[grpc.Future]:
        return [
            stub.ScoreDocs.future(random_request(rng, request_id=f"{name}-{i}"), timeout=60)
            for i in range(calls)
        ]

    before = send("pre", 12)
    server.wait_metric("scorer_batch_requests_count", 1)

    server.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    while server.health() != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() - signalled < DRAIN_S / 3, "health still SERVING after SIGTERM"
        time.sleep(0.02)
    during = send("drain", 3)
    time.sleep(max(0.0, signalled + DRAIN_S - FORWARD_DELAY_S / 2 - time.monotonic()))
    at_the_end = send("end", 3)
    time.sleep(max(0.0, signalled + DRAIN_S + 0.1 - time.monotonic()))
    with pytest.raises(grpc.RpcError) as refused:
        stub.ScoreDocs(random_request(rng, request_id="after-drain"), timeout=10)

    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    for future in [*before, *during, *at_the_end]:
        assert future.result().results, future
    assert server.stop(timeout=60) == 0
    log = server.log()
    assert "NOT_SERVING; still serving new calls" in log and "stopped" in log
    assert "request_id=after-drain" not in log
    # one line per process that answers calls (each front end of a split server)
    in_flight = [int(n) for n in re.findall(r"refusing new calls; (\d+) in flight", log)]
    assert in_flight and sum(in_flight) > 0, "no call was in flight when the drain ended"
