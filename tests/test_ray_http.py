"""The Ray deployment's HTTP ingress: one replica on a local Ray, the rerank routes through Serve's
HTTP proxy (under the application's route prefix) with the real Cohere SDK and plain HTTP: scores
as the engine alone and as Ray's gRPC proxy, errors by field, request ids, health, metrics by api."""

from __future__ import annotations

import math
from dataclasses import dataclass

import cohere
import grpc
import httpx
import pytest
from ray_app import RayApp, scrape

from scorer.engine import Engine
from scorer.request import Doc, ScoreOptions, ScoreRequest
from scorer.runtime import build_engine
from scorer.v1 import scorer_pb2 as pb
from scorer.v1 import scorer_pb2_grpc

TOLERANCE = 1e-4
APP = "scorer"
QUERY = "which passage explains prefix caching"
DOCS = [
    "the prompt is computed once and its keys and values are shared",
    "bread rises when yeast ferments",
    "cascade attention merges a shared level and a unique level",
]


@dataclass
class RayHttp:
    url: str  # the application's prefix on Serve's HTTP proxy
    grpc_target: str
    metrics_url: str

    def post(self, path: str, body: dict, headers=None) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60)

    def metric(self, name: str, **labels: str) -> float:
        return scrape(self.metrics_url, name, **labels)


@pytest.fixture(scope="module")
def engine(ray_app: RayApp) -> Engine:
    return build_engine(ray_app.model_dir, device="cpu")


@pytest.fixture(scope="module")
def ray_http(ray_app: RayApp) -> RayHttp:
    return RayHttp(ray_app.http_url, ray_app.grpc_target, ray_app.metrics_url)


def _solo(engine: Engine, **options) -> list[float]:
    request = ScoreRequest(QUERY, [Doc(d) for d in DOCS], options=ScoreOptions(**options))
    return [d.score for d in engine.score(request).results]


def _best_first(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: -scores[i])


@pytest.mark.slow
def test_the_cohere_sdk_through_serves_http_proxy_gets_the_grpc_scores(ray_http, engine):
    want = _solo(engine, truncate="doc_end", max_doc_tokens=4096)
    request = pb.ScoreDocsRequest(prompt=QUERY, docs=[pb.Doc(text=d) for d in DOCS])
    with grpc.insecure_channel(ray_http.grpc_target) as channel:
        through_grpc = scorer_pb2_grpc.ScorerStub(channel).ScoreDocs(
            request, metadata=(("application", APP),)
        )

    reply = cohere.ClientV2(api_key="x", base_url=ray_http.url).rerank(
        model="rerank-v3.5", query=QUERY, documents=DOCS, top_n=2
    )

    assert [r.score for r in through_grpc.results] == pytest.approx(want, abs=TOLERANCE)
    assert [r.index for r in reply.results] == _best_first(want)[:2]
    assert [r.relevance_score for r in reply.results] == pytest.approx(
        sorted(want, reverse=True)[:2], abs=TOLERANCE
    )


@pytest.mark.slow
def test_jina_and_tei_shapes_through_serves_http_proxy(ray_http, engine):
    want = _solo(engine, truncate="doc_end")

    jina = ray_http.post("/v1/rerank", {"model": "m", "query": QUERY, "documents": DOCS})
    tei = ray_http.post("/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True, "return_text": True})

    assert jina.status_code == 200, jina.text
    results = jina.json()["results"]
    assert [set(r) for r in results] == [{"index", "relevance_score", "document"}] * len(DOCS)
    assert [r["index"] for r in results] == _best_first(want)
    assert [r["relevance_score"] for r in results] == pytest.approx(sorted(want, reverse=True), abs=TOLERANCE)
    assert [r["index"] for r in tei.json()] == _best_first(want)
    for r in tei.json():
        assert 1 / (1 + math.exp(-r["score"])) == pytest.approx(want[r["index"]], abs=1e-5)
        assert r["text"] == DOCS[r["index"]]


@pytest.mark.slow
def test_errors_request_ids_health_info_and_metrics_through_serves_http_proxy(ray_http, engine):
    bad = ray_http.post(
        "/v2/rerank", {"query": QUERY, "documents": ["a", ""]}, headers={"X-Request-Id": "ray-http-1"}
    )
    good = ray_http.post(
        "/v2/rerank", {"query": QUERY, "documents": DOCS}, headers={"X-Request-Id": "ray-http-2"}
    )

    assert bad.status_code == 400 and bad.json()["field"] == "documents[1]", bad.text
    assert bad.json()["request_id"] == "ray-http-1" and bad.headers["x-request-id"] == "ray-http-1"
    assert good.json()["id"] == "ray-http-2" and good.headers["x-request-id"] == "ray-http-2"
    plain = ray_http.post("/v2/rerank", {"query": QUERY, "documents": DOCS})  # the id is Serve's proxy's
    assert plain.headers["x-request-id"] == plain.json()["id"] and "," not in plain.json()["id"]
    assert httpx.get(ray_http.url + "/health").json() == {"status": "SERVING"}
    assert httpx.get(ray_http.url + "/info").json()["model_id"] == engine.model_name
    assert ray_http.metric("scorer_requests_total", api="cohere", code="OK") >= 1
    assert ray_http.metric("scorer_requests_total", api="cohere", code="INVALID_ARGUMENT") >= 1
