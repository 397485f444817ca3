"""The HTTP rerank routes (scorer/server/http.py): the Cohere SDK, the Jina and TEI shapes, every
error by status and field, request ids, the API key, health, metrics by ``api``, an HTTP and a
gRPC call in one batch, and a stop that lets HTTP calls in flight finish.

Most tests run in process: a CallHandler on the tiny CPU engine behind an in-process gRPC server
and ``start_http``, on an event loop of its own thread (what ``scorer serve --http-port`` runs).
The last two start ``scorer serve --http-port`` itself, once app.py has the flag."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import cohere
import grpc
import httpx
import pytest
from grpc_health.v1.health import aio as health_aio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict
from rpc_harness import free_port, start_server

from scorer import metrics
from scorer.engine import Engine, EngineConfig
from scorer.models.tiny import ensure_tiny_model
from scorer.request import Doc, ScoreOptions, ScoreRequest
from scorer.runtime import build_engine
from scorer.server.batcher import BatchPolicy
from scorer.server.debug import DebugKnobs
from scorer.server.handler import CallHandler
from scorer.server.http import SHAPES, UINT32_MAX, log_odds, start_http
from scorer.server.http_edge import HttpLimits
from scorer.server.lifecycle import grpc_server
from scorer.server.scoring import ScoringService
from scorer.server.servicer import ScorerServicer
from scorer.settings import SERVE, Settings, names_for
from scorer.v1 import scorer_pb2 as pb
from scorer.v1 import scorer_pb2_grpc

TOLERANCE = 1e-4
QUERY = "which passage explains prefix caching"
DOCS = [
    "the prompt is computed once and its keys and values are shared",
    "bread rises when yeast ferments",
    "cascade attention merges a shared level and a unique level",
    "prefix caching keeps the keys and values of a shared prompt",
]
LONG_DOC = "caching " * 120  # over the 64 tokens a doc may have here
FAULT_QUERY = "a query whose batch fails"
LIMITS = EngineConfig(max_docs=16, max_doc_tokens=64, max_doc_bytes=4096, max_request_bytes=16384)
MAX_BODY = 64 * 1024
OOM_ABOVE_TOKENS = 1000  # 16 docs cut at 64 tokens (1,024, and the template's) run out of memory
KEY = "sekret"
WIRED = "http_port" in names_for(SERVE)


class Live:
    """A handler and its service on an event loop of its own thread, behind an in-process gRPC
    server and the HTTP routes."""

    def __init__(
        self,
        engine: Engine | None,
        policy: BatchPolicy,
        knobs: DebugKnobs | None = None,
        api_key=None,
        limits: HttpLimits | None = None,
    ) -> None:
        self.serving = engine is not None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(self._start(engine, policy, knobs, api_key, limits))

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, engine, policy, knobs, api_key, limits) -> None:
        self.handler = CallHandler(max_message_bytes=MAX_BODY)
        if engine is not None:
            self.handler.service = ScoringService(engine, policy, knobs)
            self.handler.service.start()
        self.grpc, self.grpc_port = grpc_server(
            Settings(port=0), ScorerServicer(self.handler), health_aio.HealthServicer()
        )
        await self.grpc.start()
        self.http = await start_http(
            self.handler, lambda: self.serving, "127.0.0.1", 0, api_key, limits=limits
        )
        self.port = self.http.port
        self.url = f"http://127.0.0.1:{self.port}"

    async def _stop(self) -> None:
        await self.http.stop(5)
        await self.grpc.stop(0)
        if self.handler.service is not None:
            await self.handler.service.close()

    def close(self) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def post(self, path: str, body, headers=None, **kw) -> httpx.Response:
        content = body if isinstance(body, str | bytes) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers=headers, timeout=60, **kw)

    def grpc_scores(self, docs, **options) -> list[float]:
        """Each doc's score through gRPC, as the HTTP call asks for it (``prompt = query``)."""
        request = pb.ScoreDocsRequest(
            prompt=QUERY, docs=[pb.Doc(text=d) for d in docs], options=pb.ScoreOptions(**options)
        )
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
            reply = scorer_pb2_grpc.ScorerStub(channel).ScoreDocs(request, timeout=60)
        return [r.score for r in reply.results]


@pytest.fixture(scope="module")
def engine(scorer_cache) -> Engine:
    return build_engine(ensure_tiny_model(scorer_cache), "torch", "cpu", config=LIMITS)


@pytest.fixture(scope="module")
def live(engine):
    knobs = DebugKnobs(oom_above_tokens=OOM_ABOVE_TOKENS, fault_prompt=FAULT_QUERY)
    server = Live(engine, BatchPolicy(max_wait_s=0.1), knobs)
    yield server
    server.close()


@pytest.fixture
def slow(engine):
    """Every forward batch takes half a second (fresh each test: no forward times seen yet, so the
    batcher refuses no call on its estimate)."""
    server = Live(engine, BatchPolicy(max_wait_s=0.0), DebugKnobs(forward_delay_s=0.5))
    yield server
    server.close()


def _sample(name: str, **labels: str) -> float:
    """Sum of this process's samples ``name`` whose labels include ``labels``."""
    return sum(
        s.value
        for family in metrics.REGISTRY.collect()
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def _count(api: str, code: str) -> float:
    return _sample("scorer_requests_total", api=api, code=code)


def _best_first(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: -scores[i])


# Scores and shapes


def test_the_cohere_sdk_gets_the_grpc_scores_best_first_with_top_n(live):
    want = live.grpc_scores(DOCS, truncate="doc_end", max_doc_tokens=4096)
    client = cohere.ClientV2(api_key="x", base_url=live.url)

    reply = client.rerank(model="rerank-v3.5", query=QUERY, documents=DOCS)
    top = client.rerank(model="rerank-v3.5", query=QUERY, documents=DOCS, top_n=2)

    assert [r.index for r in reply.results] == _best_first(want)
    for r in reply.results:
        assert r.relevance_score == pytest.approx(want[r.index], abs=TOLERANCE)
    assert [r.index for r in top.results] == _best_first(want)[:2]
    assert [r.relevance_score for r in top.results] == pytest.approx(
        [r.relevance_score for r in reply.results[:2]], abs=TOLERANCE
    )
    assert reply.id and reply.meta.tokens.input_tokens > 0


def test_cohere_cuts_at_max_tokens_per_doc_and_returns_documents_when_asked(live):
    docs = [LONG_DOC, DOCS[0]]
    body = {
        "model": "m",
        "query": QUERY,
        "documents": docs,
        "max_tokens_per_doc": 5,
        "return_documents": True,
    }

    reply = live.post("/v2/rerank", body)

    assert reply.status_code == 200, reply.text
    want = live.grpc_scores(docs, truncate="doc_end", max_doc_tokens=5)
    results = reply.json()["results"]
    assert [r["index"] for r in results] == _best_first(want)
    assert [r["relevance_score"] for r in results] == pytest.approx(
        [want[r["index"]] for r in results], abs=TOLERANCE
    )
    assert [r["document"]["text"] for r in results] == [docs[r["index"]] for r in results]
    default = live.post("/v2/rerank", {"query": QUERY, "documents": docs}).json()["results"]
    assert "document" not in default[0]  # Cohere: no documents unless asked
    # the default max_tokens_per_doc (4096) is over this engine's 64: the doc is cut there, silently
    cut = live.grpc_scores(docs, truncate="doc_end")
    assert [r["relevance_score"] for r in default] == pytest.approx(
        [cut[r["index"]] for r in default], abs=TOLERANCE
    )


class JinaDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


class JinaResult(BaseModel):
    """What a strict Jina reader (Elasticsearch's jinaai service) allows in a result."""

    model_config = ConfigDict(extra="forbid")
    index: int
    relevance_score: float
    document: JinaDocument | None = None


def test_jina_gets_the_grpc_scores_best_first_with_only_index_score_and_document(live):
    docs = [DOCS[0], {"text": DOCS[1]}, DOCS[2], LONG_DOC]
    texts = [d if isinstance(d, str) else d["text"] for d in docs]
    want = live.grpc_scores(texts, truncate="doc_end")  # Jina cuts a long doc silently

    reply = live.post(
        "/v1/rerank", {"model": "jina-reranker-v2-base-multilingual", "query": QUERY, "documents": docs}
    )
    top = live.post("/v1/rerank", {"query": QUERY, "documents": docs, "top_n": 2, "return_documents": False})

    assert reply.status_code == 200, reply.text
    body = reply.json()
    results = [JinaResult.model_validate(r) for r in body["results"]]
    assert [r.index for r in results] == _best_first(want)
    assert [r.relevance_score for r in results] == pytest.approx(
        [want[r.index] for r in results], abs=TOLERANCE
    )
    assert [r.document.text for r in results] == [texts[r.index] for r in results]  # default: returned
    assert body["model"] == live.handler.service.engine.model_name and body["usage"]["total_tokens"] > 0
    best = top.json()["results"]
    assert [set(r) for r in best] == [{"index", "relevance_score"}] * 2
    assert [r["index"] for r in best] == [r.index for r in results[:2]]


def test_tei_gets_the_grpc_scores_and_raw_scores_are_their_log_odds(live):
    want = live.grpc_scores(DOCS)

    scores = live.post("/rerank", {"query": QUERY, "texts": DOCS, "return_text": True}).json()
    raw = live.post("/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True}).json()

    assert [r["index"] for r in scores] == _best_first(want)
    assert [r["score"] for r in scores] == pytest.approx([want[r["index"]] for r in scores], abs=TOLERANCE)
    assert [r["text"] for r in scores] == [DOCS[r["index"]] for r in scores]
    assert [r["index"] for r in raw] == _best_first(want) and "text" not in raw[0]
    for r in raw:
        assert 1 / (1 + math.exp(-r["score"])) == pytest.approx(want[r["index"]], abs=1e-5)


def test_log_odds_of_more_than_two_labels_is_against_the_sum_of_the_others():
    lps = (math.log(0.2), math.log(0.3), math.log(0.1))
    assert 1 / (1 + math.exp(-log_odds(lps))) == pytest.approx(0.2 / 0.6)
    assert log_odds(lps[:2]) == pytest.approx(lps[0] - lps[1])


def test_tei_truncate_refuses_or_cuts_and_left_is_refused_by_name(live):
    texts = [DOCS[0], LONG_DOC]
    refused = live.post("/rerank", {"query": QUERY, "texts": texts})
    cut = live.post(
        "/rerank", {"query": QUERY, "texts": texts, "truncate": True, "truncation_direction": "Right"}
    )
    left = live.post(
        "/rerank", {"query": QUERY, "texts": texts, "truncate": True, "truncation_direction": "left"}
    )
    left_uncut = live.post("/rerank", {"query": QUERY, "texts": [DOCS[0]], "truncation_direction": "Left"})

    assert refused.status_code == 413 and refused.json()["field"] == "texts[1]"
    assert '"truncate": true' in refused.json()["message"]
    want = live.grpc_scores(texts, truncate="doc_end")
    assert {r["index"]: r["score"] for r in cut.json()} == pytest.approx(dict(enumerate(want)), abs=TOLERANCE)
    assert left.status_code == 400 and left.json()["field"] == "truncation_direction"
    assert "left" in left.json()["message"] and "not supported" in left.json()["message"]
    assert left_uncut.status_code == 200  # nothing to cut: accepted


def test_model_and_unknown_fields_are_accepted_and_ignored(live):
    body = {"model": "some-other-model", "query": QUERY, "documents": DOCS, "max_chunks_per_doc": 10, "x": {}}
    for path, extra in (("/v2/rerank", {}), ("/v1/rerank", {}), ("/rerank", {"texts": DOCS})):
        reply = live.post(path, {**body, **extra})
        assert reply.status_code == 200, (path, reply.text)


# Errors

Q, D = {"query": QUERY}, {"documents": DOCS}
BAD = {  # case: (path, body, field)
    "no query": ("/v2/rerank", D, "query"),
    "empty query": ("/v2/rerank", {"query": "", **D}, "query"),
    "blank query": ("/v1/rerank", {"query": " \n", **D}, "query"),
    "query not a string": ("/v1/rerank", {"query": 3, **D}, "query"),
    "no documents": ("/v2/rerank", Q, "documents"),
    "empty documents": ("/v1/rerank", {**Q, "documents": []}, "documents"),
    "no texts": ("/rerank", Q, "texts"),
    "empty texts": ("/rerank", {**Q, "texts": []}, "texts"),
    "an empty document": ("/v2/rerank", {**Q, "documents": ["a", ""]}, "documents[1]"),
    "a blank text": ("/rerank", {**Q, "texts": ["a", "  "]}, "texts[1]"),
    "an empty Jina document object": ("/v1/rerank", {**Q, "documents": ["a", {"text": ""}]}, "documents[1]"),
    "a number as a document": ("/v2/rerank", {**Q, "documents": ["a", 3]}, "documents[1]"),
    "an object as a Cohere document": ("/v2/rerank", {**Q, "documents": [{"text": "a"}]}, "documents[0]"),
    "a Jina object without text": ("/v1/rerank", {**Q, "documents": ["a", {"title": "t"}]}, "documents[1]"),
    "null as a text": ("/rerank", {**Q, "texts": [None]}, "texts[0]"),
    "top_n 0": ("/v2/rerank", {**Q, **D, "top_n": 0}, "top_n"),
    "top_n negative": ("/v1/rerank", {**Q, **D, "top_n": -1}, "top_n"),
    "top_n a string": ("/v1/rerank", {**Q, **D, "top_n": "2"}, "top_n"),
    "top_n a fraction": ("/v2/rerank", {**Q, **D, "top_n": 1.5}, "top_n"),
    "max_tokens_per_doc 0": ("/v2/rerank", {**Q, **D, "max_tokens_per_doc": 0}, "max_tokens_per_doc"),
    "max_tokens_per_doc text": ("/v2/rerank", {**Q, **D, "max_tokens_per_doc": "x"}, "max_tokens_per_doc"),
    "truncate a string": ("/rerank", {**Q, "texts": DOCS, "truncate": "yes"}, "truncate"),
    "unknown truncation_direction": (
        "/rerank", {**Q, "texts": DOCS, "truncation_direction": "middle"}, "truncation_direction"
    ),
    "return_documents a string": ("/v1/rerank", {**Q, **D, "return_documents": "no"}, "return_documents"),
    "a body that is not JSON": ("/v2/rerank", "query=q", "body"),
    "an empty body": ("/v1/rerank", "", "body"),
    "a JSON array": ("/rerank", "[1, 2]", "body"),
    "a NUL query": ("/v2/rerank", {"query": "\u0000", **D}, "query"),
    "a query of control characters": ("/rerank", {"query": "\u0001\t\u007f\u009f", "texts": DOCS}, "query"),
    "a control-only document": ("/v1/rerank", {**Q, "documents": ["a", "\u0000\u0000"]}, "documents[1]"),
    "top_n 2^32": ("/v2/rerank", {**Q, **D, "top_n": 2**32}, "top_n"),
    "top_n 2^63": ("/v1/rerank", {**Q, **D, "top_n": 2**63}, "top_n"),
    "max_tokens_per_doc 2^32": ("/v2/rerank", {**Q, **D, "max_tokens_per_doc": 2**32}, "max_tokens_per_doc"),
}  # fmt: skip
BAD_HEADERS = {  # case: (headers, field)
    "X-Request-Id with a space": ({"X-Request-Id": "a b"}, "X-Request-Id"),
    "X-Request-Id over 128 characters": ({"X-Request-Id": "x" * 129}, "X-Request-Id"),
    "X-Timeout-Ms not a number": ({"X-Timeout-Ms": "soon"}, "X-Timeout-Ms"),
    "X-Timeout-Ms negative": ({"X-Timeout-Ms": "-5"}, "X-Timeout-Ms"),
    "X-Prefix-Cache neither on nor off": ({"X-Prefix-Cache": "maybe"}, "X-Prefix-Cache"),
    "X-Timeout-Ms with an underscore": ({"X-Timeout-Ms": "1_000"}, "X-Timeout-Ms"),
    "X-Timeout-Ms with a sign": ({"X-Timeout-Ms": "+100"}, "X-Timeout-Ms"),
    "X-Timeout-Ms in hex": ({"X-Timeout-Ms": "0x10"}, "X-Timeout-Ms"),
    "X-Timeout-Ms in exponent form": ({"X-Timeout-Ms": "1e3"}, "X-Timeout-Ms"),
}
TOO_LARGE = {  # case: (path, body, field)
    "more docs than --max-docs": ("/v2/rerank", {**Q, "documents": ["d"] * 17}, "documents"),
    "a doc over max_doc_bytes": ("/v1/rerank", {**Q, "documents": ["a", "x" * 5000]}, "documents[1]"),
    "a call over max_request_bytes": ("/rerank", {**Q, "texts": ["x" * 4000] * 5}, "request"),
    "a query that leaves no room": ("/v2/rerank", {"query": "hello world " * 1300, **D}, "query"),
    "a body over --max-message-bytes": ("/v1/rerank", {**Q, "documents": ["x" * 4000] * 17}, "body"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_400_naming_the_field(live, case):
    path, body, field = BAD[case]
    before = _count(path_api(path), "INVALID_ARGUMENT")

    reply = live.post(path, body, headers={"X-Request-Id": "bad-1"})

    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["field"] == field and error["message"].startswith(f"{field}: ")
    assert (error["code"], error["request_id"], reply.headers["x-request-id"]) == (
        "INVALID_ARGUMENT",
        "bad-1",
        "bad-1",
    )
    assert _count(path_api(path), "INVALID_ARGUMENT") == before + 1


def path_api(path: str) -> str:
    return {"/v2/rerank": "cohere", "/v1/rerank": "jina", "/rerank": "tei"}[path]


@pytest.mark.parametrize("case", BAD_HEADERS)
def test_bad_headers_are_400_naming_the_header(live, case):
    headers, field = BAD_HEADERS[case]
    reply = live.post(
        "/v2/rerank", {**Q, "documents": ["a", ""]}, headers=headers
    )  # a bad doc too: headers first
    assert reply.status_code == 400 and reply.json()["field"] == field, reply.text
    assert len(reply.headers["x-request-id"]) == 32  # a generated id when the caller's is bad


@pytest.mark.parametrize("case", TOO_LARGE)
def test_over_the_size_limits_is_413_naming_the_field(live, case):
    path, body, field = TOO_LARGE[case]
    reply = live.post(path, body)
    assert reply.status_code == 413, reply.text
    assert reply.json()["field"] == field and reply.json()["message"].startswith(f"{field}: ")


def test_a_call_out_of_memory_is_429_and_a_fault_500(live):
    before = _count("jina", "RESOURCE_EXHAUSTED")
    oom = live.post("/v1/rerank", {**Q, "documents": [LONG_DOC] * 16})
    fault = live.post("/v2/rerank", {"query": FAULT_QUERY, **D})
    assert oom.status_code == 429 and oom.json()["code"] == "RESOURCE_EXHAUSTED", oom.text
    assert _count("jina", "RESOURCE_EXHAUSTED") == before + 1
    assert fault.status_code == 500 and fault.json()["code"] == "INTERNAL"
    assert "see the server log" in fault.json()["message"]
    assert live.post("/v2/rerank", {**Q, **D}).status_code == 200  # and it keeps serving


def test_a_deadline_that_passes_is_504_queued_or_in_its_forward(live, slow):
    before = _count("tei", "DEADLINE_EXCEEDED")
    queued = live.post("/rerank", {**Q, "texts": DOCS}, headers={"X-Timeout-Ms": "0.01"})
    in_forward = slow.post("/rerank", {**Q, "texts": DOCS}, headers={"X-Timeout-Ms": "200"})
    for reply in (queued, in_forward):
        assert reply.status_code == 504 and reply.json()["code"] == "DEADLINE_EXCEEDED", reply.text
    assert _count("tei", "DEADLINE_EXCEEDED") == before + 2
    assert slow.post("/rerank", {**Q, "texts": DOCS}, headers={"X-Timeout-Ms": "30000"}).status_code == 200


def test_while_loading_and_once_closed_calls_are_503_and_health_says_so(live, engine):
    loading = Live(None, BatchPolicy())
    try:
        assert loading.post("/v2/rerank", {**Q, **D}).status_code == 503
        assert httpx.get(loading.url + "/health").status_code == 503
        assert httpx.get(loading.url + "/info").status_code == 503
    finally:
        loading.close()
    closed = Live(engine, BatchPolicy())
    try:
        assert httpx.get(closed.url + "/health").json() == {"status": "SERVING"}
        closed.run(closed.handler.service.batcher.close())  # as a shutdown does: no more calls
        closed.serving = False
        reply = closed.post("/rerank", {**Q, "texts": DOCS})
        assert reply.status_code == 503 and reply.json()["code"] == "UNAVAILABLE"
        assert httpx.get(closed.url + "/health").status_code == 503
    finally:
        closed.close()


# Request ids, the key, /info, metrics


def test_request_ids_come_back_and_one_is_generated_otherwise(live):
    given = live.post("/v2/rerank", {**Q, **D}, headers={"X-Request-Id": "Ab.9_:-" + "z" * 121})
    generated = live.post("/v1/rerank", {**Q, **D})
    assert given.headers["x-request-id"] == "Ab.9_:-" + "z" * 121 == given.json()["id"]
    assert len(generated.headers["x-request-id"]) == 32


def test_an_api_key_is_required_once_set_and_ignored_otherwise(engine, live):
    assert (
        live.post("/v2/rerank", {**Q, **D}, headers={"Authorization": "Bearer whatever"}).status_code == 200
    )
    keyed = Live(engine, BatchPolicy(), api_key=KEY)
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            reply = keyed.post("/v1/rerank", {**Q, **D}, headers=headers)
            assert reply.status_code == 401 and reply.json()["field"] == "Authorization", headers
        assert httpx.get(keyed.url + "/info").status_code == 401
        assert httpx.get(keyed.url + "/health").status_code == 200  # probes need no key
        assert (
            keyed.post(
                "/rerank", {**Q, "texts": DOCS}, headers={"Authorization": f"Bearer {KEY}"}
            ).status_code
            == 200
        )
        reply = cohere.ClientV2(api_key=KEY, base_url=keyed.url).rerank(
            model="m", query=QUERY, documents=DOCS
        )
        assert len(reply.results) == len(DOCS)
        with pytest.raises(cohere.UnauthorizedError):
            cohere.ClientV2(api_key="x", base_url=keyed.url).rerank(model="m", query=QUERY, documents=DOCS)
    finally:
        keyed.close()


def test_info_names_the_model_template_limits_and_schemes(live):
    info = httpx.get(live.url + "/info").json()
    assert info["model_id"] == live.handler.service.engine.model_name
    assert info["template"] == ScoreOptions.template and info["default_instruction"]
    assert info["limits"]["max_docs"] == 16 and info["max_input_length"] == 64
    assert "auto" in info["schemes"] and info["versions"]["scorer"]
    assert info["apis"] == {"cohere": "/v2/rerank", "jina": "/v1/rerank", "tei": "/rerank"}


def test_metrics_count_each_call_under_its_api_and_grpc_code(live):
    before = {api: _count(api, "OK") for api in metrics.APIS}
    live.post("/v2/rerank", {**Q, **D})
    live.post("/v1/rerank", {**Q, **D})
    live.post("/rerank", {**Q, "texts": DOCS})
    live.grpc_scores(DOCS)
    assert all(_count(api, "OK") == before[api] + 1 for api in metrics.APIS)
    errors = _sample("scorer_errors_total", api="cohere", code="INVALID_ARGUMENT")
    latency = _sample("scorer_request_duration_seconds_count", api="cohere", scheme="none")
    live.post("/v2/rerank", Q)
    assert _sample("scorer_errors_total", api="cohere", code="INVALID_ARGUMENT") == errors + 1
    assert _sample("scorer_request_duration_seconds_count", api="cohere", scheme="none") == latency + 1


# One batcher


@pytest.fixture
def busy(engine):
    """Every forward batch takes 1 s, and a batch waits up to 0.5 s for company while another is
    in flight (an idle engine runs a call at once): room for a busy machine's delays."""
    server = Live(engine, BatchPolicy(max_wait_s=0.5), DebugKnobs(forward_delay_s=1.0))
    yield server
    server.close()


def test_an_http_and_a_grpc_call_arriving_together_run_in_one_batch(busy, engine):
    live = busy

    def batches() -> tuple[float, float]:
        return _sample("scorer_batch_requests_sum"), _sample("scorer_batch_requests_count")

    async def together():
        request = pb.ScoreDocsRequest(prompt=QUERY, docs=[pb.Doc(text=d) for d in DOCS])
        blocker = pb.ScoreDocsRequest(prompt=QUERY, docs=[pb.Doc(text=DOCS[0])])
        async with (
            httpx.AsyncClient(base_url=live.url) as client,
            grpc.aio.insecure_channel(f"127.0.0.1:{live.grpc_port}") as channel,
        ):
            stub = scorer_pb2_grpc.ScorerStub(channel)
            launched = _sample("scorer_batch_requests_count")
            busy = asyncio.ensure_future(stub.ScoreDocs(blocker, timeout=60))
            # an idle engine runs a call at once: the two below are sent once the blocker's batch
            # is launched, so they arrive while it is in flight
            deadline = time.monotonic() + 30
            while _sample("scorer_batch_requests_count") == launched:
                assert time.monotonic() < deadline, "the blocker's batch never started"
                await asyncio.sleep(0.01)
            replies = await asyncio.gather(
                client.post("/v1/rerank", json={**Q, **D}, timeout=60), stub.ScoreDocs(request, timeout=60)
            )
            await busy
            return replies

    before = batches()
    http_reply, grpc_reply = live.run(together())  # on the server's loop: one loop for grpc.aio
    calls, batched = (after - start for after, start in zip(batches(), before, strict=True))

    assert (calls, batched) == (3, 2)  # the blocker alone; both calls in one batch (it waits 500 ms)
    solo = engine.score(ScoreRequest(QUERY, [Doc(d) for d in DOCS], options=ScoreOptions(truncate="doc_end")))
    by_index = {r["index"]: r["relevance_score"] for r in http_reply.json()["results"]}
    assert by_index == pytest.approx({d.index: d.score for d in solo.results}, abs=TOLERANCE)
    assert [r.score for r in grpc_reply.results] == pytest.approx(
        [d.score for d in solo.results], abs=TOLERANCE
    )


# Stopping


def test_stop_lets_http_calls_in_flight_finish_and_refuses_new_connections(engine):
    server = Live(engine, BatchPolicy(max_wait_s=0.0), DebugKnobs(forward_delay_s=0.5))
    try:
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(server.post, "/v1/rerank", {**Q, **D})
            deadline = time.monotonic() + 10
            while server.handler.inflight.count == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            server.run(server.http.stop(10))
            reply = in_flight.result(30)
        assert reply.status_code == 200 and len(reply.json()["results"]) == len(DOCS)
        with pytest.raises(httpx.ConnectError):
            server.post("/v1/rerank", {**Q, **D})
    finally:
        server.close()


# Through scorer serve itself (app.py's --http-port)


def test_the_server_imports_nothing_of_the_http_stack_until_asked():
    code = (
        "import sys, scorer.server.app; print(sorted({'fastapi', 'uvicorn', 'starlette'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


needs_wiring = pytest.mark.skipif(not WIRED, reason="scorer serve has no --http-port yet (app.py wiring)")


@needs_wiring
def test_scorer_serve_http_port_answers_the_cohere_sdk_with_the_grpc_scores(scorer_cache, server_logs):
    port = free_port()
    proc = start_server(scorer_cache, server_logs, ["--http-port", str(port), "--api-key", KEY])
    try:
        docs = [pb.Doc(text=d) for d in DOCS]
        options = pb.ScoreOptions(truncate="doc_end", max_doc_tokens=4096)
        want = [
            r.score
            for r in proc.stub()
            .ScoreDocs(
                pb.ScoreDocsRequest(prompt=QUERY, docs=docs, options=options),
                metadata=(("authorization", f"Bearer {KEY}"),),  # the key covers gRPC too
            )
            .results
        ]
        client = cohere.ClientV2(api_key=KEY, base_url=f"http://127.0.0.1:{port}")
        reply = client.rerank(model="rerank-v3.5", query=QUERY, documents=DOCS, top_n=3)
        assert [r.index for r in reply.results] == _best_first(want)[:3]
        assert [r.relevance_score for r in reply.results] == pytest.approx(
            sorted(want, reverse=True)[:3], abs=TOLERANCE
        )
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        assert proc.metric("scorer_requests_total", api="cohere", code="OK") == 1
        assert f"HTTP rerank on http://127.0.0.1:{port}" in proc.log()
    finally:
        assert proc.stop() == 0, proc.log()


@needs_wiring
def test_a_taken_http_port_is_refused_at_start_with_exit_code_2(scorer_cache, server_logs):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="exited with 2") as caught:
            start_server(scorer_cache, server_logs, ["--http-port", str(taken.getsockname()[1])])
    assert "cannot listen on HTTP port" in str(caught.value)


@needs_wiring
def test_sigterm_drain_covers_http_calls(scorer_cache, server_logs):
    """Health turns 503 at once, calls are still served through the drain, the call in flight
    finishes, then the port closes and the process exits 0. The drain outlasts the test: a second
    SIGTERM ends it once the call sent during it is taken."""
    port = free_port()
    args = [
        "--http-port",
        str(port),
        "--debug-forward-delay-ms",
        "1500",
        "--drain-seconds",
        "600",
        "--max-wait-ms",
        "0",
    ]
    proc = start_server(scorer_cache, server_logs, args)
    url = f"http://127.0.0.1:{port}"
    body = json.dumps({**Q, "texts": DOCS})
    tokenized = proc.metric("scorer_stage_duration_seconds_count", stage="tokenize")
    with ThreadPoolExecutor(2) as pool:
        in_flight = pool.submit(httpx.post, url + "/rerank", content=body, timeout=60)
        assert proc.wait_metric("scorer_inflight_requests", 1) >= 1
        proc.proc.send_signal(signal.SIGTERM)
        assert _wait(lambda: httpx.get(url + "/health").status_code == 503), "health 200 after SIGTERM"
        during_drain = pool.submit(httpx.post, url + "/rerank", content=body, timeout=60)
        taken = proc.wait_metric("scorer_stage_duration_seconds_count", tokenized + 2, 30, stage="tokenize")
        assert taken == tokenized + 2, "the call sent during the drain was not taken"
        proc.proc.send_signal(signal.SIGTERM)  # the drain ends: the port closes once both calls are done
        assert in_flight.result(60).status_code == 200
        assert during_drain.result(60).status_code == 200
    assert proc.proc.wait(60) == 0, proc.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")


def test_the_prefix_cache_headers_are_the_calls_options(scorer_cache):
    """X-Prefix-Cache: off neither reads nor writes the cache, X-Cache-Salt keeps calls apart, and
    a call that reads its prompt from the cache scores as the first did."""
    engine = build_engine(
        ensure_tiny_model(scorer_cache),
        "torch",
        "cpu",
        config=LIMITS,
        prefix_cache_mib=8,
        prefix_cache_admit=1,
    )  # a prompt kept on first sight: the second call reads it
    server = Live(engine, BatchPolicy(max_wait_s=0.0), DebugKnobs())
    body = {**Q, "documents": ["a shared prefix is computed once", "bread rises"]}

    def hits_and_lookups() -> tuple[float, float]:
        return (
            _sample("scorer_prefix_cache_hit_tokens_total"),
            _sample("scorer_prefix_cache_lookup_tokens_total"),
        )

    def scores(reply: httpx.Response) -> list[float]:
        assert reply.status_code == 200, reply.text
        return [r["relevance_score"] for r in sorted(reply.json()["results"], key=lambda r: r["index"])]

    try:
        first = scores(server.post("/v2/rerank", body))
        hits, lookups = hits_and_lookups()
        again = scores(server.post("/v2/rerank", body))
        assert hits_and_lookups()[0] > hits  # the query's prompt came from the cache
        assert max(abs(a - b) for a, b in zip(first, again, strict=True)) < 1e-4
        hits, lookups = hits_and_lookups()
        scores(server.post("/v2/rerank", body, headers={"X-Prefix-Cache": "off"}))
        assert hits_and_lookups() == (hits, lookups)  # not even looked up
        scores(server.post("/v2/rerank", body, headers={"X-Cache-Salt": "tenant-b"}))
        assert hits_and_lookups()[0] == hits  # another salt shares nothing
        reply = server.post("/v2/rerank", body, headers={"X-Cache-Salt": "s" * 300})
        assert reply.status_code == 400 and reply.json()["field"] == "X-Cache-Salt", reply.text
    finally:
        server.close()


# Integers of every shape


def _int_fields(shape) -> list[str]:
    return [name for name, f in shape.body.model_fields.items() if f.annotation == int | None]


INT_FIELDS = [(path, name) for path, shape in SHAPES.items() for name in _int_fields(shape)]
EDGE_NUMBERS = (-(2**63), -1, 0, 1, 2**31 - 1, 2**31, UINT32_MAX, 2**32, 2**63, 2**64, 1e30, 1.5, -0.0, 2.0)


def test_every_integer_field_of_every_shape_is_in_the_property_test():
    assert INT_FIELDS == [
        ("/v2/rerank", "top_n"),
        ("/v2/rerank", "max_tokens_per_doc"),
        ("/v1/rerank", "top_n"),
    ]


@pytest.mark.parametrize("path, field", INT_FIELDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    value=st.one_of(
        st.sampled_from(EDGE_NUMBERS),
        st.booleans(),
        st.none(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
    )
)
def test_an_integer_field_answers_200_or_400_naming_it_never_500(live, path, field, value):
    body = {**Q, **D, field: value} if path != "/rerank" else {**Q, "texts": DOCS, field: value}
    reply = live.post(path, body)
    valid = value is None or (type(value) is int and 1 <= value <= UINT32_MAX)
    assert reply.status_code == (200 if valid else 400), (value, reply.text)
    if not valid:
        assert reply.json()["field"] == field


# A client that hangs up


def _raw_post(port: int, path: str, body: bytes, headers: str = "") -> socket.socket:
    """A POST sent on a socket of its own, its answer unread."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{headers}\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _wait(condition, timeout: float = 30.0) -> bool:
    """Poll ``condition`` until it holds (the timeout only bounds a failing test)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def stuck(engine):
    """Every forward batch takes 5 s, on the forward thread: a call that arrives during one stays
    queued meanwhile."""
    policy = BatchPolicy(max_wait_s=0.0, loop_path_gaps=math.inf)  # forwards off the event loop
    server = Live(engine, policy, DebugKnobs(forward_delay_s=5.0))
    yield server
    server.close()


def test_a_client_that_hangs_up_cancels_its_queued_call_in_each_shape(stuck, caplog):
    """A call queued behind a batch in its forward, whose client then closes the connection, leaves
    the queue unscored (the batcher counts it dropped, cancelled) and is counted CANCELLED, with
    499 in the log: through each HTTP shape."""
    live = stuck
    caplog.set_level(logging.INFO, logger="scorer.server.http")
    batcher = live.handler.service.batcher
    dropped = _sample("scorer_requests_dropped_total", reason="cancelled")
    cancelled = {api: _count(api, "CANCELLED") for api in ("cohere", "jina", "tei")}
    launched = _sample("scorer_batch_requests_count")
    with ThreadPoolExecutor(1) as pool:
        blocker = pool.submit(live.post, "/rerank", {**Q, "texts": DOCS[:1]})
        assert _wait(lambda: _sample("scorer_batch_requests_count") == launched + 1)  # in its forward
        bodies = {
            "/v2/rerank": {**Q, **D},
            "/v1/rerank": {**Q, **D},
            "/rerank": {**Q, "texts": DOCS},
        }
        socks = [_raw_post(live.port, path, json.dumps(body).encode()) for path, body in bodies.items()]
        assert _wait(lambda: batcher.depth == 3), batcher.depth  # all three queued behind it
        for sock in socks:
            sock.close()
        assert _wait(lambda: _sample("scorer_requests_dropped_total", reason="cancelled") == dropped + 3), (
            _sample("scorer_requests_dropped_total", reason="cancelled") - dropped,
            batcher.depth,
            live.handler.inflight.count,
        )
        assert batcher.depth == 0
        assert _wait(lambda: all(_count(api, "CANCELLED") == n + 1 for api, n in cancelled.items()))
        assert blocker.result(60).status_code == 200  # the batch in its forward is not disturbed
    assert _sample("scorer_batch_requests_count") == launched + 1  # and none other ran
    assert sum(" 499: the client closed the connection" in r.getMessage() for r in caplog.records) == 3


# Sizes: the body, the headers


def test_a_body_over_the_limit_is_refused_by_its_content_length_before_it_is_read(live):
    before = _count("cohere", "RESOURCE_EXHAUSTED")
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=30)
    with sock:  # the headers only: the answer comes without a byte of the body
        sock.sendall(f"POST /v2/rerank HTTP/1.1\r\nHost: t\r\nContent-Length: {300 * 2**20}\r\n\r\n".encode())
        answer = _read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    assert b"connection: close" in answer.lower()
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert error["field"] == "body" and "Content-Length 314572800" in error["message"]
    assert _count("cohere", "RESOURCE_EXHAUSTED") == before + 1


def _read_answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_chunked_body_is_refused_once_it_passes_the_limit(live):
    """No Content-Length: the body is read in pieces and refused as soon as it passes the limit,
    while the client is still sending."""
    before = _count("jina", "RESOURCE_EXHAUSTED")
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=30)
    chunk = b"x" * 16384
    sent = 0
    with sock:
        sock.sendall(b"POST /v1/rerank HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            while sent < 100 * MAX_BODY:  # the server answers long before this
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
                if sent > 2 * MAX_BODY and _count("jina", "RESOURCE_EXHAUSTED") == before + 1:
                    break
        except OSError:  # the server closed the connection after its answer
            pass
    assert _count("jina", "RESOURCE_EXHAUSTED") == before + 1
    assert sent < 100 * MAX_BODY


def test_a_body_that_does_not_arrive_in_time_is_408(engine):
    server = Live(engine, BatchPolicy(), limits=HttpLimits(body_timeout_s=0.5))
    try:
        before = _count("tei", "DEADLINE_EXCEEDED")
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /rerank HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{")
            answer = _read_answer(sock)  # the server's deadline ends the wait
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["field"] == "body"
        assert _count("tei", "DEADLINE_EXCEEDED") == before + 1
    finally:
        server.close()


def _closed_total(reason: str) -> float:
    return _sample("scorer_http_connections_closed_total", reason=reason)


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param(b"X-Big: " + b"a" * 2**20 + b"\r\n", id="a 1 MB header"),
        pytest.param(b"".join(b"X-%d: v\r\n" % i for i in range(20_000)), id="20,000 headers"),
    ],
)
def test_headers_over_their_limits_are_431_before_the_app(live, headers):
    before = _closed_total("headers_too_large")
    inflight = live.handler.inflight.count
    with socket.create_connection(("127.0.0.1", live.port), timeout=30) as sock:
        try:
            sock.sendall(
                b"POST /v2/rerank HTTP/1.1\r\nHost: t\r\n" + headers + b"Content-Length: 2\r\n\r\n{}"
            )
            answer = _read_answer(sock)
        except ConnectionResetError:  # refused before all of it was sent: the answer may be lost
            answer = None
    assert _closed_total("headers_too_large") == before + 1
    if answer is not None:
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert live.handler.inflight.count == inflight
    assert httpx.get(live.url + "/health").status_code == 200


def test_a_content_length_shorter_than_the_body_is_answered_400_and_counted_so(live):
    """The bytes after the declared body do not parse as a request: the client gets the call's
    own 400 (not uvicorn's plain one beside a call counted otherwise), counted once, and the
    connection closes."""
    before = {code: _count("cohere", code) for code in ("INVALID_ARGUMENT", "CANCELLED", "OK")}
    body = json.dumps({**Q, **D}).encode()
    with socket.create_connection(("127.0.0.1", live.port), timeout=30) as sock:
        head = f"POST /v2/rerank HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body) - 10}\r\n\r\n"
        sock.sendall(head.encode() + body)
        answer = _read_answer(sock)
    assert answer.count(b"HTTP/1.1 ") == 1 and answer.startswith(b"HTTP/1.1 400 "), answer
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert error["field"] == "body" and error["code"] == "INVALID_ARGUMENT"
    assert {code: _count("cohere", code) for code in before} == {
        **before,
        "INVALID_ARGUMENT": before["INVALID_ARGUMENT"] + 1,
    }


def test_x_timeout_ms_takes_a_plain_decimal(live):
    reply = live.post("/v2/rerank", {**Q, **D}, headers={"X-Timeout-Ms": "30000.5"})
    assert reply.status_code == 200, reply.text


def test_an_answer_over_the_limit_is_named_as_the_answer_not_the_body():
    from scorer.server.handler import AnswerTooLarge, MessageTooLarge
    from scorer.server.http import HttpFront

    front = HttpFront(SHAPES["/v2/rerank"], {}, None)
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    message, field, status = front._explain(code, "the answer takes 9 bytes", AnswerTooLarge("x"))
    assert (field, status) == ("answer", 413) and message.startswith("answer: ")
    assert front._explain(code, "over", MessageTooLarge("x"))[1:] == ("body", 413)
