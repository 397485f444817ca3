"""One local Ray with the scorer application for every Ray test of the session (Ray starts once):
a replica of the embedded tiny model on the CPU behind Serve's gRPC proxy and HTTP proxy."""

from __future__ import annotations

import random
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.generated import serve_pb2, serve_pb2_grpc

from scorer.models.tiny import ensure_tiny_model
from scorer.ray_serve import RAY_ENV, ScorerArgs, build_app, grpc_options

APP = "scorer"


def scrape(url: str, name: str, **labels: str) -> float:
    """Sum of the samples ``name`` at the /metrics ``url`` whose labels include ``labels``."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def free_port() -> int:
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


@dataclass(frozen=True)
class RayApp:
    model_dir: Path
    grpc_target: str  # Serve's gRPC proxy
    http_url: str  # the application's prefix on Serve's HTTP proxy
    metrics_url: str  # the replica's /metrics


def start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayApp]:
    """The ``ray_app`` session fixture of tests/conftest.py (Ray is imported only by its users)."""
    model_dir = ensure_tiny_model(tmp_path_factory.mktemp("ray-scorer-cache"))
    with pytest.MonkeyPatch.context() as env:
        # A busy 2-core runner can starve the proxy's start past Ray's 5 s ready check (it is then
        # killed and restarted, and serve.run fails); Ray's processes inherit this from the driver.
        env.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
        for key, value in RAY_ENV.items():  # as deployed
            env.setenv(key, value)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": http_port}, grpc_options=grpc_options(grpc_port)
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
        http_url, metrics_url = f"http://127.0.0.1:{http_port}/scorer", f"http://127.0.0.1:{port}/metrics"
        app = RayApp(model_dir, f"127.0.0.1:{grpc_port}", http_url, metrics_url)
        _wait_for_routes(app)
        yield app
    finally:
        serve.shutdown()
        ray.shutdown()


def _wait_for_routes(app: RayApp, timeout_s: float = 30.0) -> None:
    """Until both proxies route to the application: they learn of it a moment after serve.run."""
    give_up = time.monotonic() + timeout_s
    with grpc.insecure_channel(app.grpc_target) as channel:
        routes = serve_pb2_grpc.RayServeAPIServiceStub(channel)
        while True:
            try:
                listed = routes.ListApplications(serve_pb2.ListApplicationsRequest(), timeout=10)
                if APP in listed.application_names:
                    break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:  # "Route table is not populated yet."
                    raise
            assert time.monotonic() < give_up, f"the gRPC proxy never routed to {APP!r}"
            time.sleep(0.1)
    while True:
        try:
            if httpx.get(app.http_url + "/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < give_up, "the HTTP proxy never routed to the application"
        time.sleep(0.1)
