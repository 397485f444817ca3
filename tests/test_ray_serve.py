"""The Ray Serve deployment: one replica on a local Ray, called through Ray's gRPC proxy with the
real stub, scores as the engine alone, bad input as INVALID_ARGUMENT, the scorer_ metrics."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from ray.serve.schema import ServeDeploySchema
from ray_app import RayApp

from scorer.engine import Engine
from scorer.ray_serve import GRPC_SERVICER_FUNCTIONS, HEALTHY_SERVICES, RAY_ENV, ScorerArgs, build_app
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


@dataclass
class RayScorer:
    channel: grpc.Channel
    metrics_url: str

    def stub(self) -> scorer_pb2_grpc.ScorerStub:
        return scorer_pb2_grpc.ScorerStub(self.channel)


@pytest.fixture(scope="module")
def model_dir(ray_app: RayApp) -> Path:
    return ray_app.model_dir


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return build_engine(model_dir, device="cpu")


@pytest.fixture(scope="module")
def ray_scorer(ray_app: RayApp) -> Iterator[RayScorer]:
    with grpc.insecure_channel(ray_app.grpc_target) as channel:
        yield RayScorer(channel, ray_app.metrics_url)


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


def test_each_call_logs_its_line_to_the_replica_workers_stderr_file(ray_scorer):
    """The standalone server's line per call, with its request id and real code, lands in the
    replica worker's logs/worker-*.err, written to the process's stderr itself (not through Serve's
    stderr-to-logger wrapper, which walks the stack for every line: docs/ray.md)."""
    import ray

    request = _request("ragged", "ray-log-line")
    ray_scorer.stub().ScoreDocs(request, metadata=(("application", APP),), timeout=30)
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    line = "request_id=ray-log-line /scorer.v1.Scorer/ScoreDocs OK scheme=ragged"
    give_up = time.monotonic() + 10  # a worker's stderr reaches its file a moment later
    while not any(line in f.read_text(errors="replace") for f in logs.glob("worker-*.err")):
        assert time.monotonic() < give_up, f"no {line!r} in {logs}/worker-*.err"
        time.sleep(0.2)


@pytest.mark.slow
def test_concurrent_calls_share_a_forward_and_keep_their_own_scores(ray_scorer, engine):
    """The calls queue behind a long one (400 docs, ~0.3 s on this CPU) and share its next forward:
    sent without it, an idle replica launches each call at once, and on a loaded host each could
    finish before the next arrives (CI saw 8 calls in 8 batches)."""
    schemes = ("naive", "ragged", "cascade", "multi_item") * 2
    long_call = pb.ScoreDocsRequest(
        prompt=PROMPT, docs=[pb.Doc(id=str(i), text=DOCS[0][1] * 4) for i in range(400)]
    )
    before = _batch_counts(ray_scorer)

    busy = ray_scorer.stub().ScoreDocs.future(long_call, timeout=60)
    futures = [ray_scorer.stub().ScoreDocs.future(_request(s), timeout=30) for s in schemes]
    replies = [f.result() for f in futures]

    assert len(busy.result().results) == len(long_call.docs)
    for scheme, reply in zip(schemes, replies, strict=True):
        assert reply.scheme == scheme
        assert [r.score for r in reply.results] == pytest.approx(_solo(engine, scheme), abs=TOLERANCE)
    calls, batches = (after - start for after, start in zip(_batch_counts(ray_scorer), before, strict=True))
    assert calls == len(schemes) + 1
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
    (head,) = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    for container in (head, worker):  # Ray's switches reach every Ray process of the cluster
        assert {e["name"]: e["value"] for e in container["env"]} == RAY_ENV


def test_the_kuberay_manifest_asks_for_two_gpu_replicas_one_per_worker_pod():
    """Two replicas on two GPUs as deployed: two replicas at least, each on its own GPU worker pod, the
    gRPC proxy's port on every worker, ready once that proxy routes a health check to a replica."""
    docs = list(yaml.safe_load_all((ROOT / "deploy/kuberay/rayservice.yaml").read_text()))
    (service,) = [d for d in docs if d["kind"] == "RayService"]
    config = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    ((deployment,),) = [app.deployments for app in config.applications]
    scaling = deployment.autoscaling_config
    grpc_port = config.grpc_options.port

    assert scaling["min_replicas"] >= 2 and scaling["initial_replicas"] >= scaling["min_replicas"]
    (workers,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == scaling["min_replicas"]
    assert workers["maxReplicas"] == scaling["max_replicas"]
    (worker,) = workers["template"]["spec"]["containers"]
    for need in ("requests", "limits"):  # one replica per pod: as many GPUs as a replica takes
        assert worker["resources"][need]["nvidia.com/gpu"] == deployment.ray_actor_options.num_gpus == 1
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports["serve-grpc"] == grpc_port
    probe = worker["readinessProbe"]["grpc"]
    assert (probe["port"], probe["service"]) == (grpc_port, "scorer.v1.Scorer")
    assert probe["service"] in HEALTHY_SERVICES
    (grpc_service,) = [d for d in docs if d["kind"] == "Service"]
    (port,) = grpc_service["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (grpc_port, "serve-grpc")
    labels = {**workers["template"]["metadata"]["labels"], "ray.io/serve": "true"}  # KubeRay: proxy healthy
    assert grpc_service["spec"]["selector"].items() <= labels.items()


def test_the_one_host_config_binds_front_ends_to_an_engine_that_holds_the_gpu():
    """deploy/ray/serve-one-host.yaml: engine_process=shared, the Scorer front ends without a GPU,
    the Engine with one, and build_app binds exactly those two deployments."""
    config = ServeDeploySchema.model_validate(
        yaml.safe_load((ROOT / "deploy/ray/serve-one-host.yaml").read_text())
    )
    (app,) = config.applications
    assert (app.name, app.import_path, app.route_prefix) == (APP, "scorer.ray_serve:build_app", "/scorer")
    args = ScorerArgs.model_validate(app.args)
    assert args.engine_process == "shared"
    options = {d.name: d for d in app.deployments}
    assert options["Scorer"].ray_actor_options.num_gpus == 0
    assert options["Engine"].ray_actor_options.num_gpus == 1
    bound = build_app(args)
    (engine,) = bound._bound_deployment.init_args[1:]  # no public accessor
    assert {bound._bound_deployment.name, engine._bound_deployment.name} == set(options)


def test_a_replica_holds_as_many_calls_as_its_batcher_queues():
    """Calls beyond ``max_ongoing_requests`` wait in Ray's router, outside any batch."""
    app = build_app(ScorerArgs(max_queue=100))
    assert app._bound_deployment._deployment_config.max_ongoing_requests == 100  # no public accessor
