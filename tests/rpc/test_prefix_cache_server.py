"""The prefix cache behind a real server: a pool of 1 MiB, calls over six shared contexts arriving
together, every forward slowed (two batches in flight, the next planned while the last runs):
every call scores as the engine scores it alone without the cache, blocks are evicted and hit.
And what callers share of it: everything unsalted; a salt is the isolation boundary, which
``--require-cache-salt`` makes every call draw (``--cache-salt-from-key``: test_auth.py)."""

from __future__ import annotations

import random

import grpc
import pytest
from rpc_harness import start_server

from scorer.server.convert import request_from_proto
from scorer.v1 import scorer_pb2 as pb

CONTEXTS, CALLS, VOCAB = 6, 36, 500


@pytest.fixture(scope="module")
def cached_server(scorer_cache, server_logs):
    proc = start_server(
        scorer_cache,
        server_logs,
        # every prompt kept on first sight (the default stops that where blocks are evicted unread): the
        # tiny pool churns
        [
            "--prefix-cache-mib",
            "1",
            "--prefix-cache-admit",
            "1",
            "--debug-forward-delay-ms",
            "40",
            "--max-wait-ms",
            "5",
        ],
    )
    yield proc
    assert proc.stop() == 0, proc.log()


def test_calls_on_a_tiny_evicting_cache_score_as_alone_without_it(cached_server, engine):
    assert engine.cache is None  # the reference: the same checkpoint, no cache
    rng = random.Random(14)
    contexts = [[rng.randrange(VOCAB) for _ in range(rng.randint(150, 330))] for _ in range(CONTEXTS)]
    requests = []
    for i in range(CALLS):
        prompt = contexts[rng.randrange(CONTEXTS)] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 20))]
        docs = [pb.Doc(token_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))]) for _ in range(4)]
        scheme = rng.choice(("ragged", "multi_item", "naive", "cascade", "auto"))
        requests.append(
            pb.ScoreDocsRequest(
                prompt_token_ids=prompt, docs=docs, request_id=f"pc{i}",
                options=pb.ScoreOptions(scheme=scheme, template="plain", return_label_logprobs=True),
            )
        )  # fmt: skip
    evictions = cached_server.metric("scorer_prefix_cache_evictions_total")
    stub = cached_server.stub()
    for start in range(0, CALLS, 12):  # twelve at a time: batches of several calls, two in flight
        futures = [stub.ScoreDocs.future(r, timeout=120) for r in requests[start : start + 12]]
        for request, future in zip(requests[start : start + 12], futures, strict=True):
            reply = future.result()
            alone = engine.score(request_from_proto(request, request.request_id))
            for got, want in zip(reply.results, alone.results, strict=True):
                assert abs(got.score - want.score) < 1e-4, (request.request_id, got.score, want.score)
    assert cached_server.metric("scorer_prefix_cache_hit_tokens_total") > 0
    assert cached_server.metric("scorer_prefix_cache_evictions_total") > evictions
    capacity = cached_server.metric("scorer_prefix_cache_bytes", kind="capacity")
    assert 0 < cached_server.metric("scorer_prefix_cache_bytes", kind="used") <= capacity <= 2**20


def salted_call(prompt: list[int], salt: str = "") -> pb.ScoreDocsRequest:
    options = pb.ScoreOptions(template="plain", cache_salt=salt)
    return pb.ScoreDocsRequest(prompt_token_ids=prompt, docs=[pb.Doc(token_ids=[5, 6, 7])], options=options)


def cached_tokens(server, prompt: list[int], salt: str = "") -> int:
    return server.stub().ScoreDocs(salted_call(prompt, salt), timeout=60).usage.cached_prompt_tokens


def test_unsalted_callers_share_the_prefix_cache_and_a_salt_is_the_isolation_boundary(server):
    """What docs/security.md warns of: by default a caller reads a prompt another caller sent
    (``cached_prompt_tokens``, and a shorter latency, tell it was sent); a different salt reads
    nothing of it."""
    prompt = list(range(400, 720))
    assert cached_tokens(server, prompt) == 0
    cached_tokens(server, prompt)  # kept on its first sighting or this, its second (admit auto)
    assert cached_tokens(server, prompt) > 0  # any other unsalted caller
    assert cached_tokens(server, prompt, salt="tenant-b") == 0


@pytest.fixture(scope="module")
def salt_required(scorer_cache, server_logs):
    proc = start_server(scorer_cache, server_logs, ["--require-cache-salt"])
    yield proc
    assert proc.stop() == 0, proc.log()


def test_with_require_cache_salt_an_unsalted_call_is_refused_and_salts_isolate(salt_required):
    before = salt_required.metric("scorer_requests_total", code="INVALID_ARGUMENT")
    with pytest.raises(grpc.RpcError) as caught:
        salt_required.stub().ScoreDocs(salted_call([1, 2, 3]), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(caught.value.trailing_metadata())["x-invalid-field"] == "options.cache_salt"
    assert (
        salt_required.wait_metric("scorer_requests_total", before + 1, code="INVALID_ARGUMENT") == before + 1
    )
    prompt = list(range(10, 330))
    assert [cached_tokens(salt_required, prompt, "a") for _ in range(3)][-1] > 0
    assert cached_tokens(salt_required, prompt, "b") == 0
