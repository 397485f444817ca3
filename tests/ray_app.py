"""One local Ray with the scorer application for every Ray test of the session (Ray starts once):
a replica of the embedded tiny model on the CPU behind Serve's gRPC proxy and HTTP proxy; and what
the tests that add applications of their own share: the proxy's routes, the replicas' processes,
open-loop load through the proxy."""

from __future__ import annotations

import csv
import io
import os
import random
import re
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
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
from scorer.ray_serve import (
    HAPROXY_PORT_VARS,
    RAY_ENV,
    EngineDeployment,
    ScorerArgs,
    build_app,
    deployment_for,
    grpc_options,
    stop_haproxy,
)
from scorer.v1 import scorer_pb2 as pb
from scorer.v1 import scorer_pb2_grpc

APP = "scorer"
DIED = {
    grpc.StatusCode.UNAVAILABLE: re.compile(r"Stream removed"),
    grpc.StatusCode.UNKNOWN: re.compile(r"Received http2 header with status: 500"),
}
"""The codes and details of a call that was on a replica when its process died, through Ray's
HAProxy (``RAY_ENV``): its HTTP/2 stream reset, or, on a loaded 2-core host (seen once in CI, with
the reset for the victim's other calls), HAProxy's own HTTP 500 for the backend it lost, which
gRPC reads as UNKNOWN. Serve's Python proxy answered INTERNAL, "The actor ... is unavailable" or
"died unexpectedly", instead (docs/ray.md, Faults)."""


ENGINE_DIED = {
    grpc.StatusCode.UNAVAILABLE,  # on the replica when its engine died, or sent to it after
    grpc.StatusCode.INTERNAL,  # on the replica when Serve stopped it
    grpc.StatusCode.CANCELLED,  # sent to the replica as Serve stopped it: its stream reset
    grpc.StatusCode.DEADLINE_EXCEEDED,  # waiting for a replica
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""The codes of the calls under load while a replica's engine dies and Serve replaces the replica
(a front end of the shared engine, or one with an engine process of its own): none is computed by
the dead engine (docs/ray.md, Faults)."""


ANSWER_LAG_S = 2.0
"""How long after its deadline a call's end may be recorded: the gRPC client's own deadline ends
it, and its done callback runs on a client thread, seen 0.55 s late on a loaded 2-core host."""


def longest_call(calls) -> float:
    """The longest a call of ``calls`` (``Load``'s) took, sent to ended: with every one bounded by
    its client's deadline, under ``deadline_s + ANSWER_LAG_S`` unless something held one past it."""
    return max(c.ended - c.sent for c in calls)


def died_on_replica(call) -> bool:
    """Was ``call`` (a ``Call`` of ``Load``) answered as one on a replica that died (``DIED``)?"""
    return call.code in DIED and bool(DIED[call.code].match(call.future.details()))


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


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free port below the ephemeral range and above Ray's worker ports (10002-19999): Ray's own
    processes bind ephemeral ports while starting and would race for one picked from there. Never
    one this process handed out before (it may not be bound yet)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(20000, max(low, 20100)), 100):
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free port below the ephemeral range")


@dataclass(frozen=True)
class RayApp:
    model_dir: Path
    grpc_target: str  # Serve's gRPC proxy
    http_url: str  # the application's prefix on Serve's HTTP proxy
    metrics_url: str  # the replica's /metrics
    haproxy_stats: str  # Ray's HAProxy's stats, CSV

    def routed(self, app: str) -> set[str]:
        """The replicas Ray's HAProxy routes the application's gRPC calls to: their servers UP in its
        stats. A dead replica's server stays UP until HAProxy marks it DOWN (3 errors seen on its
        connections, or 2 failed health checks) or Serve's controller takes it out of HAProxy's
        configuration."""
        with urllib.request.urlopen(self.haproxy_stats, timeout=10) as answer:
            rows = csv.DictReader(io.StringIO(answer.read().decode().removeprefix("# ")))
        replica = f"SERVE_REPLICA_{app}-"
        return {
            row["svname"]
            for row in rows
            if row["pxname"].startswith("grpc")
            and row["svname"].startswith(replica)
            and row["status"].startswith("UP")
        }


DIRECT_INGRESS_PORTS = {
    "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": 32000,
    "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": 33000,
    "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": 42000,
    "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": 43000,
}
"""The replicas' own HTTP and gRPC ports (direct ingress) of the tests' Ray: not Ray's defaults
(30000-31000, 40000-41000), which another Ray on this host (``make deploy-local``'s test) uses."""


def start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayApp]:
    """The ``ray_app`` session fixture of tests/conftest.py (Ray is imported only by its users)."""
    model_dir = ensure_tiny_model(tmp_path_factory.mktemp("ray-scorer-cache"))
    with pytest.MonkeyPatch.context() as env:
        # A busy 2-core runner can starve the proxy's start past Ray's 5 s ready check (it is then
        # killed and restarted, and serve.run fails); Ray's processes inherit this from the driver.
        env.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
        for key, value in RAY_ENV.items():  # as deployed
            env.setenv(key, value)
        # a replica of direct ingress drains 30 s at least before it stops (for load balancers of
        # other hosts); HAProxy here learns at once
        env.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
        # not HAProxy's defaults: make deploy-local's test runs beside
        haproxy_ports = {key: free_port() for key in HAPROXY_PORT_VARS}
        for key, port in haproxy_ports.items():
            env.setenv(key, str(port))
        # nor the replicas' default port ranges: gRPC servers bind with SO_REUSEPORT, so a replica of
        # that other Ray would share this one's port and take its calls
        for key, port in DIRECT_INGRESS_PORTS.items():
            env.setenv(key, str(port))
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    node = ray.get_runtime_context().get_node_id()
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
        stats = f"http://127.0.0.1:{haproxy_ports['RAY_SERVE_HAPROXY_STATS_PORT']}/stats;csv"
        app = RayApp(model_dir, f"127.0.0.1:{grpc_port}", http_url, metrics_url, stats)
        _wait_for_routes(app)
        yield app
    finally:
        serve.shutdown()
        ray.shutdown()
        stop_haproxy(node)


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


def applications(channel: grpc.Channel) -> set[str]:
    """The applications the gRPC proxy routes to."""
    routes = serve_pb2_grpc.RayServeAPIServiceStub(channel)
    return set(routes.ListApplications(serve_pb2.ListApplicationsRequest(), timeout=10).application_names)


def wait_for_applications(channel: grpc.Channel, apps: set[str], timeout_s: float = 30.0) -> None:
    """Until the proxy routes to exactly ``apps`` (a test's own application added or deleted: the
    Ray tests that send no ``application`` metadata need the session's application alone)."""
    give_up = time.monotonic() + timeout_s
    while applications(channel) != apps:
        assert time.monotonic() < give_up, f"the gRPC proxy never routed to exactly {apps}"
        time.sleep(0.1)


def replica_pids(app: str, deployment: str = "Scorer") -> set[int]:
    """The processes of the deployment's replicas: Ray titles a replica worker
    ``ray::ServeReplica:<app>:<deployment>``."""
    title = f"ray::ServeReplica:{app}:{deployment}".encode()
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(title):
                pids.add(int(proc.name))
        except OSError:
            continue
    return pids


def listening_ports(pid: int) -> set[int]:
    """The TCP ports the process listens on: its sockets' inodes looked up in /proc/net/tcp{,6}
    (which replica of several serves which metrics port)."""
    try:
        inodes = {
            link[len("socket:[") : -1]
            for fd in Path(f"/proc/{pid}/fd").iterdir()
            if (link := _readlink(fd)).startswith("socket:[")
        }
    except OSError:  # the process is gone
        return set()
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _readlink(path: Path) -> str:
    try:
        return str(path.readlink())
    except OSError:
        return ""


@dataclass
class Sent:
    sent: float
    future: grpc.Future
    ended: float = 0.0

    @property
    def code(self) -> grpc.StatusCode:
        return self.future.code()


class Load:
    """Open-loop calls through the proxy from a thread, ``burst`` calls every ``period_s`` whatever
    the answers, each with a ``deadline_s`` gRPC deadline, sent as ``x-timeout-ms`` too (Ray's
    proxy drops the gRPC one), and routed to ``app``; ``calls`` holds them in the order sent.
    ``with Load(...) as load:`` runs it; leaving the block stops sending and waits for every call's
    end."""

    def __init__(
        self,
        stub: scorer_pb2_grpc.ScorerStub,
        request: Callable[[int], pb.ScoreDocsRequest],
        app: str,
        deadline_s: float,
        burst: int = 1,
        period_s: float = 0.1,
    ) -> None:
        self.calls: list[Sent] = []
        self._send = lambda i: stub.ScoreDocs.future(
            request(i),
            metadata=(("application", app), ("x-timeout-ms", f"{deadline_s * 1e3:g}")),
            timeout=deadline_s,
        )
        self._burst, self._period_s = burst, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for c in self.calls:
            c.future.exception()  # waits for its end
        give_up = time.monotonic() + 5.0  # each one's done callback runs just after
        while not all(c.ended for c in self.calls) and time.monotonic() < give_up:
            time.sleep(0.01)

    def _run(self) -> None:
        started, bursts = time.monotonic(), 0
        while not self._stop.is_set():
            for _ in range(self._burst):
                call = Sent(time.monotonic(), self._send(len(self.calls)))
                call.future.add_done_callback(lambda _, c=call: setattr(c, "ended", time.monotonic()))
                self.calls.append(call)
            bursts += 1
            self._stop.wait(max(0.0, started + bursts * self._period_s - time.monotonic()))

    def first_answer(self, after: float, code: grpc.StatusCode = grpc.StatusCode.OK) -> float | None:
        """When the first call sent after ``after`` that was answered ``code`` ended, if one has."""
        answered = (c for c in list(self.calls) if c.sent > after and c.ended and c.code == code)
        return next((c.ended for c in answered), None)


def engine_pids(replica: int) -> set[int]:
    """The replica's engine process: its child started by multiprocessing's spawn."""
    out = set()
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or b"spawn_main" not in (proc / "cmdline").read_bytes():
                continue
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == replica:
                out.add(int(proc.name))
        except OSError:
            continue
    return out


def unrouted(app: RayApp, name: str, before: set[str]) -> float:
    """When Ray's HAProxy was seen to route application ``name``'s calls to one replica fewer of
    ``before`` (``routed`` before a replica was killed): no call sent after it reaches the dead one."""
    fewer = lambda: before - app.routed(name) and time.monotonic()  # noqa: E731
    return wait_until(fewer, 60, f"HAProxy routed to every replica of {name} for a minute", 0.02)


def wait_until(condition, timeout_s: float, what: str, every_s: float = 0.05):
    """``condition()``'s first truthy value, polled every ``every_s``; fails with ``what`` after
    ``timeout_s``."""
    give_up = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < give_up, what
        time.sleep(every_s)
    return value


def kill(pid: int, timeout_s: float = 5.0) -> float:
    """SIGKILL the process and return when it was seen dead (gone, or a zombie): ``os.kill``
    returns before the kernel has torn it down, and a call sent in between still reaches it."""
    os.kill(pid, signal.SIGKILL)
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state in ("Z", "X"):
            break
        time.sleep(0.001)
    return time.monotonic()


Docs = tuple[tuple[str, str], ...]
"""A call's docs: (id, text) pairs."""


@dataclass(frozen=True)
class LoadedApp:
    """A second application on the session's Ray that tests put load on: one call (``prompt`` and
    ``docs``, (id, text) pairs, scored with ``scheme``) sent again and again, its scores from the
    engine in this process, and the range its replicas' /metrics ports come from (each replica
    takes the first free one)."""

    name: str
    channel: grpc.Channel
    metrics_ports: range
    prompt: str
    docs: Docs
    scheme: str
    expected: list[float]

    def request(self, i: int) -> pb.ScoreDocsRequest:
        return pb.ScoreDocsRequest(
            prompt=self.prompt,
            docs=[pb.Doc(id=doc_id, text=text) for doc_id, text in self.docs],
            options=pb.ScoreOptions(scheme=self.scheme),
            request_id=f"{self.name}-{i}",
        )

    def load(self, deadline_s: float, burst: int, period_s: float) -> Load:
        stub = scorer_pb2_grpc.ScorerStub(self.channel)
        return Load(stub, self.request, self.name, deadline_s, burst=burst, period_s=period_s)

    def ports(self, deployment: str = "Scorer") -> dict[int, int]:
        """pid -> metrics port of each replica of the deployment that has opened its /metrics."""
        pids = replica_pids(self.name, deployment)
        found = {pid: listening_ports(pid) & set(self.metrics_ports) for pid in pids}
        return {pid: min(ports) for pid, ports in found.items() if ports}

    def metric(self, port: int, name: str, **labels: str) -> float:
        return scrape(f"http://127.0.0.1:{port}/metrics", name, **labels)

    def served(self, port: int) -> float:
        """Calls that replica answered OK since its process started."""
        return self.metric(port, "scorer_requests_total", code="OK")

    def assert_scores(self, calls: list[Sent], tolerance: float = 1e-4) -> None:
        """Every call answered OK scored as the engine alone."""
        for c in calls:
            if c.code == grpc.StatusCode.OK:
                scores = [r.score for r in c.future.result().results]
                assert scores == pytest.approx(self.expected, abs=tolerance), c.future.result().request_id


def reference(model_dir: Path, prompt: str, docs: Docs, scheme: str) -> tuple[list[float], int]:
    """The call's scores by the engine in this process, and its tokens."""
    from scorer.request import Doc, ScoreOptions, ScoreRequest
    from scorer.runtime import build_engine

    engine = build_engine(model_dir, device="cpu")
    request = ScoreRequest(
        prompt, tuple(Doc(text, i) for i, text in docs), options=ScoreOptions(scheme=scheme)
    )
    return [d.score for d in engine.score(request).results], engine.tokenize(request).tokens


def run_loaded(
    ray_app: RayApp,
    name: str,
    app,
    args: ScorerArgs,
    prompt: str,
    docs: Docs,
    scheme: str,
    expected: list[float],
) -> Iterator[LoadedApp]:
    """A module fixture's body: ``app`` (bound with ``args``) runs as the application ``name`` beside
    the session's until the module's tests are done."""
    serve.run(app, name=name, route_prefix=f"/{name}")
    with grpc.insecure_channel(ray_app.grpc_target) as channel:
        wait_for_applications(channel, {APP, name})
        try:
            ports = range(args.metrics_port, args.metrics_port + args.metrics_port_tries)
            yield LoadedApp(name, channel, ports, prompt, docs, scheme, expected)
        finally:
            serve.delete(name)
            wait_for_applications(channel, {APP})  # the other Ray tests call without application metadata


def shared_engine_app(
    ray_app: RayApp, name: str, prompt: str, docs: Docs, scheme: str, **knobs
) -> Iterator[LoadedApp]:
    """A fixture's body: the application ``name`` with ``engine_process=shared``, two Scorer
    front ends and one Engine replica (no CPU reserved: the session's Ray has 2, and the shared
    application's replica holds one), ``knobs`` the rest of its ScorerArgs."""
    expected, _ = reference(ray_app.model_dir, prompt, docs, scheme)
    args = ScorerArgs(
        model=str(ray_app.model_dir),
        device="cpu",
        engine_process="shared",
        metrics_host="127.0.0.1",
        metrics_port=free_port(),
        **knobs,
    )
    no_cpu = {"num_cpus": 0}
    engine = EngineDeployment.options(ray_actor_options=no_cpu).bind(args.model_dump())
    fronts = deployment_for(args).options(num_replicas=2, ray_actor_options=no_cpu)
    app = fronts.bind(args.model_dump(), engine)
    yield from run_loaded(ray_app, name, app, args, prompt, docs, scheme, expected)
