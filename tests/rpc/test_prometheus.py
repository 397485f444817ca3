"""A real Prometheus (Debian's package) scrapes the server: per-scheme latency arrives, and the
shipped rules and every Grafana panel's query are valid PromQL over the real series."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from rpc_harness import REPO, free_port
from rpc_requests import random_request

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


@pytest.fixture
def prometheus(server, tmp_path: Path):
    rules = REPO / "deploy/prometheus/rules.yml"
    subprocess.run(["promtool", "check", "rules", str(rules)], check=True, capture_output=True)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{rules}']\n"
        "scrape_configs:\n"
        f"  - {{job_name: scorer, static_configs: [{{targets: ['127.0.0.1:{server.metrics_port}']}}]}}\n"
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


def test_prometheus_scrapes_per_scheme_latency_and_dashboard_queries_are_valid(server, prometheus):
    rng = random.Random(11)
    stub = server.stub()
    for scheme in SCHEMES:
        for _ in range(2):
            stub.ScoreDocs(random_request(rng, scheme), timeout=30)
    expr = "sum by (scheme) (scorer_request_duration_seconds_count{code='OK'})"
    deadline, seen = time.monotonic() + 60, {}
    while time.monotonic() < deadline and not all(seen.get(s, 0) >= 2 for s in SCHEMES):
        try:
            result = query(prometheus, expr)["data"]["result"]
            seen = {r["metric"].get("scheme"): float(r["value"][1]) for r in result}
        except OSError:
            pass
        time.sleep(0.5)
    assert all(seen.get(s, 0) >= 2 for s in SCHEMES), seen

    dashboard = json.loads((REPO / "deploy/grafana/scorer-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for e in exprs:
        reply = query(prometheus, e.replace("$__rate_interval", "1m"))
        assert reply["status"] == "success", (e, reply)
    p50_expr, p50 = exprs[0].replace("$__rate_interval", "5m"), []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and {r["metric"]["scheme"] for r in p50} < set(SCHEMES):
        for scheme in SCHEMES:  # rate() needs an increase between two scrapes
            stub.ScoreDocs(random_request(rng, scheme), timeout=30)
        time.sleep(1.5)
        p50 = query(prometheus, p50_expr)["data"]["result"]
    assert {r["metric"]["scheme"] for r in p50} >= set(SCHEMES)
    for r in p50:  # the shared server also holds idle series of other tests' schemes: NaN there
        if r["metric"]["scheme"] in SCHEMES:
            assert 0 < float(r["value"][1]) < 30
