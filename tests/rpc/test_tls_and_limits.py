"""Optional TLS, a configured maximum message size, and a call over the token budget."""

from __future__ import annotations

import random
import shutil
import subprocess
from collections.abc import Iterator

import grpc
import pytest
from rpc_harness import ServerProcess, start_server
from rpc_requests import solo, text

from scorer.v1 import scorer_pb2 as pb

MAX_MESSAGE_BYTES = 100_000
MAX_BATCH_TOKENS = 300
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate"),
]


@pytest.fixture(scope="module")
def tls_server(scorer_cache, server_logs, tmp_path_factory) -> Iterator[ServerProcess]:
    certs = tmp_path_factory.mktemp("certs")
    cert, key = certs / "cert.pem", certs / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=DNS:localhost"),
        ],
        check=True,
        capture_output=True,
    )
    args = [
        *("--tls-cert", str(cert), "--tls-key", str(key)),
        *("--max-message-bytes", str(MAX_MESSAGE_BYTES), "--max-batch-tokens", str(MAX_BATCH_TOKENS)),
    ]
    proc = start_server(scorer_cache, server_logs, args, root_cert=cert.read_bytes())
    yield proc
    assert proc.stop() == 0, proc.log()


def test_tls_server_scores_over_a_verified_channel(tls_server):
    reply = tls_server.stub().ScoreDocs(pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")]), timeout=30)
    assert len(reply.results) == 1


def test_tls_server_refuses_plaintext(tls_server):
    with grpc.insecure_channel(f"127.0.0.1:{tls_server.port}") as channel:
        stub_call = channel.unary_unary("/scorer.v1.Scorer/ScoreDocs")
        with pytest.raises(grpc.RpcError) as caught:
            stub_call(b"", timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_request_over_max_message_bytes_is_refused_and_the_server_keeps_serving(tls_server):
    """Refused by the handler (gRPC's own limit is twice as high), so the answer is counted."""
    stub = tls_server.stub()
    before = tls_server.metric("scorer_requests_total", code="RESOURCE_EXHAUSTED")
    big = pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(id="x" * MAX_MESSAGE_BYTES, text="d")])
    with pytest.raises(grpc.RpcError) as caught:
        stub.ScoreDocs(big, timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-message-bytes" in caught.value.details()
    assert (
        tls_server.wait_metric("scorer_requests_total", before + 1, code="RESOURCE_EXHAUSTED") == before + 1
    )
    assert stub.ScoreDocs(pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")]), timeout=30).results


def test_a_call_over_the_token_budget_runs_in_several_passes_and_scores_as_in_one(tls_server, engine):
    rng = random.Random(5)
    docs = [pb.Doc(id=str(i), text=text(rng, 24)) for i in range(16)]  # a token a word at least: > 300
    options = pb.ScoreOptions(scheme="ragged", template="plain")
    msg = pb.ScoreDocsRequest(prompt=text(rng, 6), docs=docs, options=options)
    passes = tls_server.metric("scorer_forward_passes_total")

    reply = tls_server.stub().ScoreDocs(msg, timeout=60)

    assert reply.usage.tokens_computed > MAX_BATCH_TOKENS
    assert tls_server.metric("scorer_forward_passes_total") - passes > 1
    expected = [d.score for d in solo(engine, msg).results]
    assert [r.score for r in reply.results] == pytest.approx(expected, abs=1e-4)
