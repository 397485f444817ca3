"""Concurrent calls are merged into shared forward batches, and each still scores as if alone."""

from __future__ import annotations

import random

import grpc
import pytest
from grpc_health.v1 import health_pb2
from rpc_requests import FAULT_PROMPT, random_request, solo

from scorer.v1 import scorer_pb2 as pb

TOLERANCE = 1e-4


def batches_of_more_than_one(server) -> float:
    batches = server.metric("scorer_batch_requests_count")
    return batches - server.metric("scorer_batch_requests_bucket", le="1.0")


def test_100_concurrent_calls_of_mixed_sizes_and_schemes_each_equal_their_solo_result(server, engine):
    rng = random.Random(100)
    requests = [random_request(rng, request_id=f"mix-{i}") for i in range(100)]
    merged_before = batches_of_more_than_one(server)
    stub = server.stub()

    futures = [stub.ScoreDocs.future(r, timeout=120) for r in requests]
    replies = [f.result() for f in futures]

    for msg, reply in zip(requests, replies, strict=True):
        ref = solo(engine, msg)
        assert reply.request_id == msg.request_id
        assert reply.scheme == ref.scheme
        assert [r.index for r in reply.results] == [d.index for d in ref.results]
        scores = [d.score for d in ref.results]
        assert [r.score for r in reply.results] == pytest.approx(scores, abs=TOLERANCE)
        for r, d in zip(reply.results, ref.results, strict=True):
            assert list(r.label_logprobs) == pytest.approx(d.label_logprobs, abs=TOLERANCE)
    assert batches_of_more_than_one(server) > merged_before
    assert any(reply.timing.queue_seconds > 0 for reply in replies)


def test_a_faulty_call_fails_alone_with_internal_and_its_batch_mates_succeed(server, engine):
    rng = random.Random(7)
    good = [random_request(rng, scheme="ragged", request_id=f"mate-{i}") for i in range(6)]
    bad = pb.ScoreDocsRequest(prompt=FAULT_PROMPT, docs=[pb.Doc(text="d")], request_id="faulty")
    stub = server.stub()
    internal_before = server.metric("scorer_errors_total", code="INTERNAL")

    futures = [stub.ScoreDocs.future(r, timeout=60) for r in [*good[:3], bad, *good[3:]]]
    outcomes = [f.exception() or f.result() for f in futures]

    failed = outcomes.pop(3)
    assert failed.code() == grpc.StatusCode.INTERNAL
    assert "faulty" in dict(failed.trailing_metadata())["x-request-id"]
    for msg, reply in zip(good, outcomes, strict=True):
        assert [r.score for r in reply.results] == pytest.approx(
            [d.score for d in solo(engine, msg).results], abs=TOLERANCE
        )
    # counted once its answer is sent: wait for the count rather than race it
    internal = server.wait_metric("scorer_errors_total", internal_before + 1, code="INTERNAL")
    assert internal == internal_before + 1
    assert "Traceback" in server.log() and "injected fault" in server.log()
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
