"""The Ray Serve deployment: one replica on a local Ray, called through Ray's gRPC proxy with the
real stub, scores as the engine alone, bad input as INVALID_ARGUMENT, the scorer_ metrics."""

from __future__ import annotations

import random
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import ray
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.generated import serve_pb2, serve_pb2_grpc
from ray.serve.schema import ServeDeploySchema

from scorer.engine import Engine
from scorer.models.tiny import ensure_tiny_model
from scorer.ray_serve import GRPC_SERVICER_FUNCTIONS, ScorerArgs, build_app, grpc_options
from scorer.request import Doc, ScoreOptions, ScoreRequest
from scorer.runtime import build_engine
from scorer.v1 import scorer_pb2 as pb
from scorer.v1 import scorer_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4
APP = "scorer"
PROMPT = "which passage explains prefix caching"
DOCS = (
    ("a", "the prompt is computed once and its keys and values are shared"),
    ("b", "bread rises when yeast ferments"),
    ("c", "cascade attention merges a shared level and a unique level"),
)


def _free_port() -> int:
    """A free port below the ephemeral range and above Ray's worker ports (10002-19999): Ray's own
    processes bind ephemeral ports while starting and would race for one picked from there."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(20000, max(low, 20100)), 100):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


@dataclass
class RayScorer:
    channel: grpc.Channel
    metrics_url: str

    def stub(self) -> scorer_pb2_grpc.ScorerStub:
        return scorer_pb2_grpc.ScorerStub(self.channel)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("scorer-cache"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return build_engine(model_dir, device="cpu")


@pytest.fixture(scope="module")
def ray_scorer(model_dir: Path) -> Iterator[RayScorer]:
    with pytest.MonkeyPatch.context() as env:
        # A busy 2-core runner can starve the proxy's start past Ray's 5 s ready check (it is then
        # killed and restarted, and serve.run fails); Ray's processes inherit this from the driver.
        env.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    grpc_port, metrics_port = _free_port(), _free_port()
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": _free_port()}, grpc_options=grpc_options(grpc_port)
        )
        args = ScorerArgs(
            model=str(model_dir),
            device="cpu",
            max_wait_ms=50,
            metrics_host="127.0.0.1",
            metrics_port=metrics_port,
        )
        handle = serve.run(build_app(args), name=APP, route_prefix="/scorer")
        port = handle.metrics_port.remote().result()
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            _wait_for_route(channel, APP)
            yield RayScorer(channel, f"http://127.0.0.1:{port}/metrics")
    finally:
        serve.shutdown()
        ray.shutdown()


def _wait_for_route(channel: grpc.Channel, app: str, timeout_s: float = 30.0) -> None:
    """Until the proxy routes to ``app``: it learns of a new application a moment after serve.run."""
    routes = serve_pb2_grpc.RayServeAPIServiceStub(channel)
    give_up = time.monotonic() + timeout_s
    while True:
        try:
            listed = routes.ListApplications(serve_pb2.ListApplicationsRequest(), timeout=10)
            if app in listed.application_names:
                return
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:  # "Route table is not populated yet."
                raise
        assert time.monotonic() < give_up, f"the gRPC proxy never routed to {app!r}"
        time.sleep(0.1)


def _metrics(ray_scorer: RayScorer) -> dict[str, float]:
    with urllib.request.urlopen(ray_scorer.metrics_url, timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def _batch_counts(ray_scorer: RayScorer) -> tuple[float, float]:
    """Calls put through forward batches so far, and the batches."""
    m = _metrics(ray_scorer)
    return m["scorer_batch_requests_sum"], m["scorer_batch_requests_count"]


def _solo(engine: Engine, scheme: str) -> list[float]:
    docs = tuple(Doc(text, doc_id) for doc_id, text in DOCS)
    return [
        d.score for d in engine.score(ScoreRequest(PROMPT, docs, options=ScoreOptions(scheme=scheme))).results
    ]


def _request(scheme: str, request_id: str = "") -> pb.ScoreDocsRequest:
    return pb.ScoreDocsRequest(
        prompt=PROMPT,
        docs=[pb.Doc(id=doc_id, text=text) for doc_id, text in DOCS],
        options=pb.ScoreOptions(scheme=scheme),
        request_id=request_id,
    )


@pytest.mark.slow
def test_scores_through_the_ray_grpc_proxy_equal_the_engine_alone(ray_scorer, engine):
    for scheme in ("naive", "ragged", "cascade"):
        reply, call = ray_scorer.stub().ScoreDocs.with_call(
            _request(scheme, f"ray-{scheme}"), metadata=(("application", APP),), timeout=30
        )

        assert reply.scheme == scheme
        assert (reply.request_id, reply.model) == (f"ray-{scheme}", engine.model_name)
        assert [r.id for r in reply.results] == [doc_id for doc_id, _ in DOCS]
        assert [r.score for r in reply.results] == pytest.approx(_solo(engine, scheme), abs=TOLERANCE)
        assert ("x-request-id", f"ray-{scheme}") in tuple(call.trailing_metadata())


@pytest.mark.slow
def test_concurrent_calls_share_a_forward_and_keep_their_own_scores(ray_scorer, engine):
    schemes = ("naive", "ragged", "cascade", "multi_item") * 2
    before = _batch_counts(ray_scorer)

    futures = [ray_scorer.stub().ScoreDocs.future(_request(s), timeout=30) for s in schemes]
    replies = [f.result() for f in futures]

    for scheme, reply in zip(schemes, replies, strict=True):
        assert reply.scheme == scheme
        assert [r.score for r in reply.results] == pytest.approx(_solo(engine, scheme), abs=TOLERANCE)
    calls, batches = (after - start for after, start in zip(_batch_counts(ray_scorer), before, strict=True))
    assert calls == len(schemes)
    assert batches < calls


@pytest.mark.slow
def test_bad_input_is_invalid_argument_naming_the_field(ray_scorer):
    request = _request("ragged", "ray-bad")
    request.docs[1].text = ""

    with pytest.raises(grpc.RpcError) as caught:
        ray_scorer.stub().ScoreDocs(request, timeout=30)

    err = caught.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("docs[1].text")
    trailers = dict(err.trailing_metadata())
    assert (trailers["x-invalid-field"], trailers["x-request-id"]) == ("docs[1].text", "ray-bad")


@pytest.mark.slow
def test_grpc_health_and_scorer_metrics(ray_scorer):
    health = health_pb2_grpc.HealthStub(ray_scorer.channel)
    for service in ("", "scorer.v1.Scorer"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    ray_scorer.stub().ScoreDocs(_request("naive"), timeout=30)

    with urllib.request.urlopen(ray_scorer.metrics_url, timeout=10) as r:
        text = r.read().decode()

    assert 'scorer_requests_total{api="grpc",code="OK",scheme="naive"}' in text
    assert 'scorer_requests_total{api="grpc",code="INVALID_ARGUMENT",scheme="none"}' in text
    assert "scorer_ready 1.0" in text
    assert 'scorer_model_info{attention_backend="torch",attention_requested="auto",device="cpu"' in text


def test_serve_config_validates_and_is_the_kuberay_serve_config():
    config = yaml.safe_load((ROOT / "deploy/ray/serve.yaml").read_text())
    docs = list(yaml.safe_load_all((ROOT / "deploy/kuberay/rayservice.yaml").read_text()))
    (service,) = [d for d in docs if d["kind"] == "RayService"]

    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == config
    parsed = ServeDeploySchema.model_validate(config)
    assert parsed.grpc_options.grpc_servicer_functions == GRPC_SERVICER_FUNCTIONS
    (app,) = parsed.applications
    assert (app.name, app.import_path, app.route_prefix) == (APP, "scorer.ray_serve:build_app", "/scorer")
    ScorerArgs.model_validate(app.args)
    (deployment,) = app.deployments
    assert deployment.name == "Scorer"
    assert deployment.ray_actor_options.num_gpus == 1
    assert deployment.autoscaling_config["min_replicas"] >= 1
    (workers,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (worker,) = workers["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["readinessProbe"]["grpc"]["port"] == parsed.grpc_options.port
