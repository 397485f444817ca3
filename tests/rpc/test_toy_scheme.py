"""A toy eighth scheme, registered as one record in a module the server imports first, scores
through the gRPC server as the engine scores naive (tests/toy_scheme.py)."""

from __future__ import annotations

import pytest
from rpc_harness import start_server

from scorer.request import Doc, ScoreOptions, ScoreRequest
from scorer.v1 import scorer_pb2 as pb


@pytest.fixture(scope="module", params=["0", "2"], ids=["one-process", "front-ends"])
def toy_server(request, scorer_cache, server_logs):
    """The server imports the module first; its front-end processes, spawned, import it too."""
    args = ("--max-wait-ms", "5", "--frontends", request.param)
    proc = start_server(scorer_cache, server_logs, args, preload=["toy_scheme"])
    yield proc
    assert proc.stop() == 0, proc.log()


def test_a_toy_scheme_scores_through_the_grpc_server(toy_server, engine):
    docs = ["short", "a longer document about prefixes", "x"]
    with toy_server.channel() as channel:
        from scorer.v1 import scorer_pb2_grpc

        stub = scorer_pb2_grpc.ScorerStub(channel)
        reply = stub.ScoreDocs(
            pb.ScoreDocsRequest(
                prompt="what is a prefix",
                docs=[pb.Doc(id=str(i), text=t) for i, t in enumerate(docs)],
                options=pb.ScoreOptions(scheme="reversed_ragged"),
            ),
            timeout=30,
        )
    assert reply.scheme == "reversed_ragged"
    want = engine.score(
        ScoreRequest(
            "what is a prefix",
            [Doc(t, str(i)) for i, t in enumerate(docs)],
            options=ScoreOptions(scheme="naive"),
        )
    )
    assert [r.score for r in reply.results] == pytest.approx([d.score for d in want.results], abs=1e-4)
    assert "Traceback" not in toy_server.log()
