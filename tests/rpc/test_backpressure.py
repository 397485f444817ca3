"""Queue limits, deadlines, cancellation and out-of-memory, made deterministic by test knobs.

The server here sleeps FORWARD_DELAY_S before every forward batch (``--debug-forward-delay-ms``),
so a call sent while a batch computes waits in the queue for at least that long.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2
from rpc_harness import ServerProcess, start_server

from scorer.v1 import scorer_pb2 as pb

FORWARD_DELAY_S = 1.0
MAX_QUEUE = 2
OOM_ABOVE_TOKENS = 150  # small(docs=80) is over it (two tokens a doc at least), small() far below
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slow_server(scorer_cache, server_logs) -> Iterator[ServerProcess]:
    args = [
        *("--debug-forward-delay-ms", str(FORWARD_DELAY_S * 1e3), "--max-wait-ms", "0"),
        *("--max-queue", str(MAX_QUEUE), "--debug-oom-above-tokens", str(OOM_ABOVE_TOKENS)),
        # FIFO cuts: the tests merge a one-doc call with an 80-doc one, which the default cut
        # (before a call of at least 4x the batch's tokens) would launch apart
        *("--cut-before-heavy", "0"),
    ]
    proc = start_server(scorer_cache, server_logs, args)
    yield proc
    assert proc.stop() == 0, proc.log()


def small(request_id: str, docs: int = 1) -> pb.ScoreDocsRequest:
    return pb.ScoreDocsRequest(
        prompt="q",
        docs=[pb.Doc(text=f"doc {i}") for i in range(docs)],
        options=pb.ScoreOptions(scheme="ragged", template="plain"),
        request_id=request_id,
    )


def start_blocking_batch(server: ServerProcess, stub, request_id: str) -> grpc.Future:
    """A call that holds the forward thread for FORWARD_DELAY_S; returns once its batch started."""
    batches = server.metric("scorer_batch_requests_count")
    future = stub.ScoreDocs.future(small(request_id), timeout=30)
    server.wait_metric("scorer_batch_requests_count", batches + 1)
    return future


def passes_with_all_before(server: ServerProcess, stub) -> float:
    """scorer_forward_passes_total once every forward batch launched before now is counted: one
    thread launches the batches, one at a time in queue order, and a pass is counted as its
    batch's launch returns, so the answer to a call sent now comes after every earlier batch's
    count. The count includes that call's own pass (one: a ``small`` call alone)."""
    stub.ScoreDocs(small("after-the-rest"), timeout=30)
    return server.metric("scorer_forward_passes_total")


def dropped_before_forward(server: ServerProcess) -> float:
    return sum(server.metric("scorer_requests_dropped_total", reason=r) for r in ("deadline", "unreachable"))


def test_a_call_whose_deadline_expires_in_the_queue_costs_no_forward_pass(slow_server):
    """Admitted on the estimate, but the batch ahead runs much longer than estimated: two calls
    merged run out of memory and are retried one at a time, three forwards where one was
    estimated. When the call's turn comes it can no longer finish, so it is dropped without
    compute. (With the batch in flight counted, a call with too little time for what is ahead
    is refused at once instead: see the next test.)"""
    stub = slow_server.stub()
    passes = slow_server.metric("scorer_forward_passes_total")
    for _ in range(2):  # the forward-time model needs two batches; the blocker's is observed only
        stub.ScoreDocs(small("warm"), timeout=30)  # when it is collected, after the next is cut
    passes_per_call = (slow_server.metric("scorer_forward_passes_total") - passes) / 2
    passes = slow_server.metric("scorer_forward_passes_total")
    dropped = dropped_before_forward(slow_server)
    batches = slow_server.metric("scorer_batch_requests_count")

    blocker = start_blocking_batch(slow_server, stub, "blocker")
    fits = stub.ScoreDocs.future(small("fits"), timeout=30)
    too_big = stub.ScoreDocs.future(small("too-big", docs=80), timeout=30)
    slow_server.wait_metric("scorer_queue_depth", 2)
    slow_server.wait_metric("scorer_batch_requests_count", batches + 2)  # the two merged, launched
    with pytest.raises(grpc.RpcError) as caught:  # estimated to end in ~2 s: admitted; ready at ~3 s
        stub.ScoreDocs(small("too-late"), timeout=FORWARD_DELAY_S * 3)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    blocker.result()
    assert len(fits.result().results) == 1
    assert too_big.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    deadline = time.monotonic() + 10
    while dropped_before_forward(slow_server) < dropped + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert dropped_before_forward(slow_server) == dropped + 1
    passes_now = passes_with_all_before(slow_server, stub)
    # the blocker's, that of "fits" retried alone, and the last call's: none for "too-late"
    assert passes_now - passes == 3 * passes_per_call
    assert "request_id=too-late dropped from the queue before its forward pass" in slow_server.log()


def test_a_call_that_cannot_meet_its_deadline_is_refused_at_once(slow_server):
    """The forward-time estimate says the call cannot finish before its deadline: RESOURCE_EXHAUSTED
    at once, so the client can go elsewhere, and no compute. Its own forward alone would take too
    long for "hopeless"; for "behind" it would not, but the batch in flight comes first."""
    stub = slow_server.stub()
    for _ in range(2):  # the forward-time model needs two batches
        stub.ScoreDocs(small("warm"), timeout=30)
    rejected = slow_server.metric("scorer_requests_rejected_total")
    passes = slow_server.metric("scorer_forward_passes_total")
    blocker = start_blocking_batch(slow_server, stub, "blocker")
    for name, timeout in (("hopeless", FORWARD_DELAY_S / 4), ("behind", FORWARD_DELAY_S * 1.5)):
        with pytest.raises(grpc.RpcError) as caught:
            stub.ScoreDocs(small(name), timeout=timeout)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, name
        assert "deadline" in caught.value.details()
        assert not blocker.done(), name  # answered while the batch ahead computes: it never queued
    blocker.result()
    assert slow_server.metric("scorer_requests_rejected_total") == rejected + 2
    assert slow_server.metric("scorer_forward_passes_total") - passes == 1


def test_a_deadline_sent_as_x_timeout_ms_counts_when_earlier_than_the_grpc_one(slow_server):
    """The metadata Ray's proxy passes on where it drops gRPC deadlines: behind a 1 s batch, a call
    with a 30 s gRPC deadline but ``x-timeout-ms: 300`` is refused at once (RESOURCE_EXHAUSTED: the
    forward-time estimate says it cannot make it) or, before the estimate has two batches, answered
    DEADLINE_EXCEEDED at 300 ms; it never waits for the blocker. A bad value names the key."""
    stub = slow_server.stub()
    passes = slow_server.metric("scorer_forward_passes_total")
    blocker = start_blocking_batch(slow_server, stub, "blocker-x")
    with pytest.raises(grpc.RpcError) as caught:
        stub.ScoreDocs(small("x-timeout"), metadata=(("x-timeout-ms", "300"),), timeout=30)
    assert caught.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert not blocker.done()  # answered while the blocker computes: it did not wait for it
    with pytest.raises(grpc.RpcError) as bad:
        stub.ScoreDocs(small("bad-timeout"), metadata=(("x-timeout-ms", "soon"),), timeout=30)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(bad.value.trailing_metadata())["x-invalid-field"] == "x-timeout-ms"
    blocker.result()
    assert passes_with_all_before(slow_server, stub) - passes == 2  # the blocker's and the last call's


def test_a_call_cancelled_in_the_queue_is_dropped(slow_server):
    stub = slow_server.stub()
    dropped = slow_server.metric("scorer_requests_dropped_total", reason="cancelled")
    batches = slow_server.metric("scorer_batch_requests_count")

    blocker = start_blocking_batch(slow_server, stub, "blocker-2")
    queued = stub.ScoreDocs.future(small("cancelled"))
    slow_server.wait_metric("scorer_queue_depth", 1)
    assert queued.cancel()
    blocker.result()

    now_dropped = slow_server.wait_metric("scorer_requests_dropped_total", dropped + 1, reason="cancelled")
    assert now_dropped == dropped + 1
    assert slow_server.metric("scorer_batch_requests_count") == batches + 1


def test_a_full_queue_refuses_at_once_with_resource_exhausted(slow_server):
    stub = slow_server.stub()
    blocker = start_blocking_batch(slow_server, stub, "blocker-3")
    queued = [stub.ScoreDocs.future(small(f"queued-{i}"), timeout=30) for i in range(MAX_QUEUE)]
    slow_server.wait_metric("scorer_queue_depth", MAX_QUEUE)

    with pytest.raises(grpc.RpcError) as caught:
        stub.ScoreDocs(small("one-too-many"), timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not blocker.done()  # answered while the blocker computes: refused, not queued
    for future in [blocker, *queued]:
        assert len(future.result().results) == 1


def test_health_is_answered_while_a_forward_pass_computes(slow_server):
    stub = slow_server.stub()
    blocker = start_blocking_batch(slow_server, stub, "blocker-4")
    started = time.monotonic()
    assert slow_server.health(timeout=FORWARD_DELAY_S / 2) == health_pb2.HealthCheckResponse.SERVING
    assert time.monotonic() - started < FORWARD_DELAY_S / 2
    assert not blocker.done()
    blocker.result()


def test_out_of_memory_in_a_merged_batch_fails_only_the_call_that_does_not_fit(slow_server):
    stub = slow_server.stub()
    retries = slow_server.metric("scorer_oom_retries_total")
    blocker = start_blocking_batch(slow_server, stub, "blocker-5")
    fits = stub.ScoreDocs.future(small("fits", docs=3), timeout=30)
    too_big = stub.ScoreDocs.future(small("too-big", docs=80), timeout=30)
    slow_server.wait_metric("scorer_queue_depth", 2)
    blocker.result()

    assert too_big.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(fits.result().results) == 3
    assert slow_server.metric("scorer_oom_retries_total") == retries + 1
    assert slow_server.health() == health_pb2.HealthCheckResponse.SERVING
