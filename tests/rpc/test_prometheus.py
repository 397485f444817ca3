"""A real Prometheus (Debian's package) scrapes every deployment, the standalone server (job
``scorer``), a Ray Serve replica's metrics port (job ``scorer-ray``) and the ports of a Ray
application whose front ends share one engine (job ``scorer-ray-shared``: each call's metrics on
its front end's port, the engine's on the Engine replica's): per-scheme latency arrives, the
shipped rules are valid, and every Grafana panel's query returns data for each deployment picked
by the dashboard's ``job`` variable."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pytest
from rpc_harness import REPO, free_port
from rpc_requests import random_request

from scorer.v1 import scorer_pb2_grpc

PROMETHEUS = shutil.which("prometheus")
SCHEMES = ("ragged", "multi_item", "cascade")

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None and not os.environ.get("SCORER_REQUIRE_PROMETHEUS"),
    reason="Debian's prometheus is not installed (.ci/run installs it)",
)


def query(port: int, expr: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


JOBS = ("scorer", "scorer-ray", "scorer-ray-shared")
SHARED = "prom-shared"


class Routed:
    """A stub whose calls carry the ``application`` metadata (two applications on the Ray)."""

    def __init__(self, channel: grpc.Channel, app: str) -> None:
        self.stub, self.metadata = scorer_pb2_grpc.ScorerStub(channel), (("application", app),)

    def ScoreDocs(self, request, timeout: float):  # noqa: N802 (the stub's name)
        return self.stub.ScoreDocs(request, timeout=timeout, metadata=self.metadata)


@pytest.fixture
def shared_ray(ray_app):
    from ray_app import shared_engine_app

    yield from shared_engine_app(ray_app, SHARED, "q", (("a", "a document"),), "ragged")


@pytest.fixture
def ray_stubs(ray_app, shared_ray):
    with grpc.insecure_channel(ray_app.grpc_target) as channel:
        yield Routed(channel, "scorer"), Routed(channel, SHARED)


@pytest.fixture
def prometheus(server, ray_app, shared_ray, tmp_path: Path):
    rules = REPO / "deploy/prometheus/rules.yml"
    subprocess.run(["promtool", "check", "rules", str(rules)], check=True, capture_output=True)
    config, replica = tmp_path / "prometheus.yml", urlsplit(ray_app.metrics_url).netloc
    shared = [f"127.0.0.1:{p}" for d in ("Scorer", "Engine") for p in shared_ray.ports(d).values()]
    assert len(shared) == 3, shared  # two front ends and the engine
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{rules}']\n"
        "scrape_configs:\n"
        f"  - {{job_name: scorer, static_configs: [{{targets: ['127.0.0.1:{server.metrics_port}']}}]}}\n"
        f"  - {{job_name: scorer-ray, static_configs: [{{targets: ['{replica}']}}]}}\n"
        f"  - {{job_name: scorer-ray-shared, static_configs: [{{targets: {shared}}}]}}\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [PROMETHEUS or "prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("wb"),
    )  # fmt: skip
    yield port
    proc.terminate()
    proc.wait(30)


def test_prometheus_scrapes_every_deployment_and_every_panel_has_data(server, ray_stubs, prometheus):
    rng = random.Random(11)
    stubs = {"scorer": server.stub(), "scorer-ray": ray_stubs[0], "scorer-ray-shared": ray_stubs[1]}

    def traffic() -> None:
        for stub in stubs.values():
            for scheme in SCHEMES:
                stub.ScoreDocs(random_request(rng, scheme), timeout=30)

    for stub in stubs.values():  # an error of each, for the errors panel
        bad = random_request(rng, "ragged")
        bad.docs[0].text = ""
        with pytest.raises(grpc.RpcError):
            stub.ScoreDocs(bad, timeout=30)
    traffic()
    traffic()
    expr = "sum by (job, scheme) (scorer_request_duration_seconds_count{code='OK'})"
    deadline, seen = time.monotonic() + 60, {}
    wanted = {(job, scheme) for job in JOBS for scheme in SCHEMES}
    while time.monotonic() < deadline and not all(seen.get(k, 0) >= 2 for k in wanted):
        try:
            result = query(prometheus, expr)["data"]["result"]
            seen = {(r["metric"].get("job"), r["metric"].get("scheme")): float(r["value"][1]) for r in result}
        except OSError:
            pass
        time.sleep(0.5)
    assert all(seen.get(k, 0) >= 2 for k in wanted), seen

    dashboard = json.loads((REPO / "deploy/grafana/scorer-dashboard.json").read_text())
    (job_var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "job"]
    assert job_var["query"] == "label_values(scorer_ready, job)"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    assert all('job=~"$job"' in e for e in exprs)
    queries = {
        (job, e): e.replace("$__rate_interval", "1m").replace("$job", job) for job in JOBS for e in exprs
    }
    empty = set(queries)
    deadline = time.monotonic() + 40
    while empty and time.monotonic() < deadline:
        traffic()  # rate() needs an increase between two scrapes
        time.sleep(1.5)
        for key in sorted(empty):
            reply = query(prometheus, queries[key])
            assert reply["status"] == "success", (key, reply)
            if reply["data"]["result"]:
                empty.discard(key)
    assert not empty, sorted(empty)
    deadline = time.monotonic() + 40
    for job in JOBS:
        expr = queries[(job, exprs[0])].replace("[1m]", "[5m]")
        while True:  # the shared server also holds idle series of other tests' schemes: NaN there
            p50 = {
                r["metric"]["scheme"]: float(r["value"][1])
                for r in query(prometheus, expr)["data"]["result"]
                if r["metric"]["scheme"] in SCHEMES
            }
            if (set(p50) >= set(SCHEMES) and not any(math.isnan(v) for v in p50.values())) or (
                time.monotonic() > deadline
            ):
                break
            # a scheme whose calls on one front end all fell before its series' first scrape has
            # no rate there yet (NaN): more traffic gives it one (about one CI run in three)
            traffic()
            time.sleep(1.5)
        assert set(p50) >= set(SCHEMES), (job, p50)
        assert all(0 < v < 30 for v in p50.values()), (job, p50)
