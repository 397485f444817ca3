"""What the server counts is what the client saw: a deadline that passes while the call waits to
be tokenized is DEADLINE_EXCEEDED on both sides (it was counted CANCELLED)."""

from __future__ import annotations

import grpc
import pytest
from rpc_harness import start_server

from scorer.v1 import scorer_pb2 as pb


@pytest.fixture(scope="module")
def slow_tokenizer_server(scorer_cache, server_logs):
    proc = start_server(scorer_cache, server_logs, ("--debug-tokenize-delay-ms", "400"))
    yield proc
    assert proc.stop() == 0, proc.log()


def test_a_deadline_passing_before_tokenizing_ends_is_counted_deadline_exceeded(slow_tokenizer_server):
    server = slow_tokenizer_server
    stub = server.stub()
    futures = []
    # every deadline well before the tokenizer's 400 ms (some calls waiting for a thread): none can
    # finish a hair inside its deadline and reach the client after it, so the counts must agree
    for i in range(24):
        msg = pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")], request_id=f"late-{i}")
        futures.append(stub.ScoreDocs.future(msg, timeout=0.05 + 0.01 * i))
    codes = [f.exception().code() if f.exception() else grpc.StatusCode.OK for f in futures]
    late = codes.count(grpc.StatusCode.DEADLINE_EXCEEDED)
    assert late == len(codes) == 24
    assert server.wait_metric("scorer_requests_total", late, code="DEADLINE_EXCEEDED") == late
    assert server.metric("scorer_requests_total", code="CANCELLED") == 0
    assert "late-0" in server.log() and "DEADLINE_EXCEEDED" in server.log()
