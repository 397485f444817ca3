"""A real scorer server in a subprocess, and what a test needs to talk to it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from scorer.v1 import scorer_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0
SERVER_ARGS = os.environ.get("SCORER_TEST_SERVER_ARGS", "").split()
"""Appended to every test server's arguments: ``make test`` runs tests/rpc once more with
``--frontends 2``, the split server a GPU machine runs by default."""
CLIENT_OPTIONS = [("grpc.max_receive_message_length", 256 * 2**20)]


def wait_for(predicate, timeout: float, what: str):
    """Poll ``predicate`` until it returns something true, and return that; ``timeout`` only
    bounds a test that would otherwise hang (it fails saying ``what``)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return value


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now and not handed out before by this process: the kernel can hand a port just
    released straight back (seen in CI: two of one test's three ports were the same)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    metrics_port: int
    log_path: Path
    root_cert: bytes | None = None

    @property
    def target(self) -> str:
        return f"{'localhost' if self.root_cert else '127.0.0.1'}:{self.port}"

    def channel(self) -> grpc.Channel:
        if self.root_cert:
            creds = grpc.ssl_channel_credentials(root_certificates=self.root_cert)
            return grpc.secure_channel(self.target, creds, options=CLIENT_OPTIONS)
        return grpc.insecure_channel(self.target, options=CLIENT_OPTIONS)

    def stub(self) -> scorer_pb2_grpc.ScorerStub:
        return scorer_pb2_grpc.ScorerStub(self.channel())

    def health(self, timeout: float = 2.0) -> int:
        with self.channel() as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        return reply.status

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
        total = 0.0
        for family in text_string_to_metric_families(self.metrics_text()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def wait_metric(self, name: str, at_least: float, timeout: float = 10.0, **labels: str) -> float:
        deadline = time.monotonic() + timeout
        while (value := self.metric(name, **labels)) < at_least and time.monotonic() < deadline:
            time.sleep(0.02)
        return value

    def settled(self, name: str, timeout: float = 10.0, **labels: str) -> float:
        """``name`` once no call is in flight: every answered call counted (the handler counts a
        call before it leaves the in-flight gauge, and gRPC's abort answers before either)."""
        wait_for(lambda: self.metric("scorer_inflight_requests") == 0, timeout, "calls stayed in flight")
        return self.metric(name, **labels)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def start_server(
    cache_dir: Path,
    log_dir: Path,
    args: Sequence[str] = (),
    root_cert: bytes | None = None,
    preload: Sequence[str] = (),
) -> ServerProcess:
    """Start ``python -m scorer.server`` on free loopback ports; return once health says SERVING.
    ``preload``: modules of tests/ imported first (a scheme registered by a test, say). A port
    chosen here and taken before the server bound it (``free_port`` frees it first: another
    process's connection can take it meanwhile) is chosen again."""
    for _ in range(3):
        try:
            return _start_server(cache_dir, log_dir, args, root_cert, preload)
        except PortTaken:
            continue
    return _start_server(cache_dir, log_dir, args, root_cert, preload)


class PortTaken(RuntimeError):
    """The server exited because a port ``start_server`` chose was taken before it bound it."""


def _start_server(
    cache_dir: Path,
    log_dir: Path,
    args: Sequence[str],
    root_cert: bytes | None,
    preload: Sequence[str],
) -> ServerProcess:
    port, metrics_port = free_port(), free_port()
    log_path = log_dir / f"server-{port}.log"
    main = ["-m", "scorer.server"]
    if preload:
        imports = "; ".join(f"import {m}" for m in preload)
        main = ["-c", f"{imports}; import runpy; runpy.run_module('scorer.server', run_name='__main__')"]
    cmd = [sys.executable, *main, "--port", str(port), "--metrics-port", str(metrics_port)]
    env = {**os.environ, "SCORER_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [*cmd, "--drain-seconds", "0", *args, *SERVER_ARGS],
            cwd=REPO,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    server = ServerProcess(proc, port, metrics_port, log_path, root_cert)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = server.log()
            ours = any(f":{p}: " in log for p in (port, metrics_port))
            error = PortTaken if ours and "already in use" in log else RuntimeError
            raise error(f"server exited with {proc.returncode}:\n{log}")
        try:
            if server.health(timeout=1.0) == health_pb2.HealthCheckResponse.SERVING:
                return server
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise TimeoutError(f"server not SERVING after {START_TIMEOUT_S} s:\n{server.log()}")
