"""ScoreDocs on Ray Serve: each replica loads the engine once and serves it through ScoringService.

Clients keep the ``scorer.v1.Scorer`` stub and point it at Ray's gRPC proxy; the proxy calls the
deployment's ``ScoreDocs`` (and ``Check``, the standard ``grpc.health.v1`` health check) with the
request proto. Through Serve's HTTP proxy the replica serves the HTTP rerank routes of
``scorer serve --http-port`` (Cohere ``/v2/rerank``, Jina ``/v1/rerank``, TEI ``/rerank``,
``/health``, ``/info``; under the application's route prefix): its FastAPI ingress is
``server.http.build_app`` over the replica's handler. Batching, scores, status codes and trailers
are those of ``scorer serve``; each replica serves the ``scorer_`` Prometheus metrics on its own
port. See docs/ray.md.

    serve run deploy/ray/serve.yaml
    serve run scorer.ray_serve:build_app model=/models/Qwen3-Reranker-0.6B
"""

# No ``from __future__ import annotations``: Ray validates builder args by the annotation's class.

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import grpc
import ray
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve import Application, Deployment
from ray.serve.config import gRPCOptions
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle

from . import metrics
from .server.calls import LOG_FORMAT, RequestIdFilter
from .server.engine_process import EngineProcess
from .server.frontend_process import RemoteScoring, attach
from .server.frontends import on_gpu
from .server.handler import CallHandler, Metadata, earliest, expired_code, sent_timeout
from .server.http import build_app as build_http_app
from .server.lifecycle import SCORER_SERVICE, batch_policy, debug_knobs
from .server.link import FrontLink
from .server.scoring import ScoringService, freeze_heap, process_age_s, ready_engine
from .settings import Settings, scorer_args_model
from .v1 import scorer_pb2 as pb

log = logging.getLogger("scorer.ray_serve")

GRPC_SERVICER_FUNCTIONS = [
    "scorer.v1.scorer_pb2_grpc.add_ScorerServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]
HEALTHY_SERVICES = ("", SCORER_SERVICE)
RAY_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
}
"""Ray's switches for the processes of a Ray that serves the scorer (set before Ray starts: each
Ray process inherits them; docs/ray.md, Ray's cost). Ray's HAProxy ingress on each node's gRPC
and HTTP ports, in front of each replica's own gRPC and HTTP servers (direct ingress), with the
rest of ``RAY_SERVE_THROUGHPUT_OPTIMIZED``'s switches: on the H200 a lone call's median through
it equals ``scorer serve``'s, where Serve's Python proxy added 6.5 ms. Ray's router stays in a
loop of its own (the optimized default runs it in the caller's loop, which breaks a handle called
from outside an event loop; the request path does not use it). Serve's proxies, which still
answer ``ListApplications`` behind HAProxy, call the replicas over gRPC."""

HAPROXY_PORT_VARS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
"""HAProxy's stats and metrics ports (Ray's defaults: 8404, 9101, on every interface): a second Ray
on one host needs others."""


def stop_haproxy(node_id: str) -> list[int]:
    """Stop the HAProxy processes of the Ray node ``node_id`` and return their pids: Serve's shutdown
    kills the actor that runs HAProxy without stopping HAProxy, which would hold the node's ports
    (Ray 2.60). They are known by their configuration file, which lives under the node's id."""
    mark = f"/{node_id}/".encode()
    stopped = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or gone
            continue
        if argv[0].endswith(b"/haproxy") and any(mark in a for a in argv):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGTERM)
                stopped.append(int(proc.name))
    return stopped


def grpc_options(port: int = 9000, request_timeout_s: float | None = None) -> gRPCOptions:
    """The gRPC proxy options that serve ``scorer.v1.Scorer`` and ``grpc.health.v1.Health``."""
    return gRPCOptions(
        port=port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS, request_timeout_s=request_timeout_s
    )


ScorerArgs = scorer_args_model()
"""The ``ray`` settings of ``scorer.settings.Settings`` as a pydantic model (unknown keys refused)."""


class RayFront:
    """A call through Serve's gRPC proxy (``context``) or a deployment handle (None: failures raise).
    Ray's proxy does not pass the client's deadline on, but it passes metadata: the deadline is
    ``x-timeout-ms`` from the call's arrival at the replica, or ``call_timeout_s`` (the earlier of
    the two when both are set)."""

    api = "grpc"
    request_id = ""  # in the message

    def __init__(self, context: RayServegRPCContext | None, timeout_s: float | None) -> None:
        self.context = context
        self.timeout_s = timeout_s
        self._deadline: float | None = None

    def deadline(self, started: float) -> float | None:
        sent = None if self.context is None else sent_timeout(self.context.invocation_metadata())
        self._deadline = earliest(*(None if t is None else started + t for t in (sent, self.timeout_s)))
        return self._deadline

    def set_trailers(self, trailers: Metadata) -> None:
        if self.context is not None:
            self.context.set_trailing_metadata(list(trailers))

    def cancelled_code(self) -> grpc.StatusCode:
        return expired_code(self._deadline)

    async def fail(self, code, message, trailers, exc) -> pb.ScoreDocsResponse:
        if self.context is None:
            raise exc
        self.context.set_code(code)
        self.context.set_details(message)
        self.context.set_trailing_metadata(list(trailers))
        return pb.ScoreDocsResponse()


@serve.deployment(
    name="Scorer",
    max_ongoing_requests=int(Settings.max_queue),  # build_app: the application's max_queue
    graceful_shutdown_wait_loop_s=2.0,
    graceful_shutdown_timeout_s=30.0,
    health_check_period_s=2.0,  # how soon a dead replica is noticed and replaced (Ray's default: 10)
    logging_config={"enable_access_log": False},  # each call's own log line has its real code
)
@serve.ingress()
class ScorerDeployment:
    """One engine and one ScoringService per replica; ``ScoreDocs`` is the gRPC method, and the
    HTTP rerank routes are its ingress (built once the replica is up)."""

    async def __init__(self, args: dict | None = None, engine: DeploymentHandle | None = None) -> None:
        self.settings = s = Settings(**ScorerArgs.model_validate(args or {}).model_dump())
        _configure_logging(s.log_level)
        self.handler = CallHandler()
        self._closing = False
        self._engine: EngineProcess | None = None
        self._link: FrontLink | None = None  # to the node's shared engine (engine_process=shared)
        if s.engine_process == "shared":
            if engine is None:
                raise ValueError(
                    "engine_process=shared: the replicas need the application's Engine deployment"
                    " (build the application with scorer.ray_serve.build_app)"
                )
            self._link, self.service = await _join(s, engine)
            freeze_heap("replica")  # this process's heap (an engine here froze in ready_engine)
            where = " (a front end of its node's shared engine)"
        elif engine_in_child(s):
            self._engine = EngineProcess(s)
            self.service = await self._engine.start()
            freeze_heap("replica")
            where = f" (engine in process {self._engine.proc.pid})"
        else:
            self.service = ScoringService(
                await asyncio.to_thread(ready_engine, s, "replica"), batch_policy(s), debug_knobs(s)
            )
            self.service.start()
            where = ""
        self.handler.service = self.service
        self._metrics_http, self._metrics_port = _serve_metrics(s, self._engine.dir if self._engine else None)
        metrics.READY.set(1)
        log.info(
            "SERVING %s%s, %.1f s after the replica's process started; metrics on port %s",
            self.service.engine.model_name,
            where,
            process_age_s(),
            self._metrics_port or "off",
        )

    async def ScoreDocs(
        self, request: pb.ScoreDocsRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.ScoreDocsResponse:
        """Score one call. Through the gRPC proxy a failure is answered with its status code, details
        and trailers (as ``scorer serve`` does); through a deployment handle it raises."""
        return await self.handler.score_docs(request, RayFront(grpc_context, self.settings.call_timeout_s))

    async def Check(
        self, request: health_pb2.HealthCheckRequest, grpc_context: RayServegRPCContext | None = None
    ) -> health_pb2.HealthCheckResponse:
        """grpc.health.v1 Check: SERVING once the replica is up (Ray routes to no replica before)."""
        if request.service not in HEALTHY_SERVICES:
            if grpc_context is not None:
                grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
                grpc_context.set_details(f"unknown service {request.service!r}")
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        status = (
            health_pb2.HealthCheckResponse.NOT_SERVING
            if self._closing
            else health_pb2.HealthCheckResponse.SERVING
        )
        return health_pb2.HealthCheckResponse(status=status)

    def __serve_build_asgi_app__(self):
        """The HTTP routes over this replica's handler; /health is 200 until the replica drains."""
        return build_http_app(
            self.handler,
            serving=lambda: not self._closing,
            api_key=self.settings.api_key,
            default_timeout_s=self.settings.call_timeout_s,
            echo_request_id=False,  # Serve's proxy answers with the call's id
        )

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine process died (its own, or the shared one
        it joined) is replaced."""
        own_gone = self._engine is not None and not self._engine.alive()
        if own_gone or self._link is not None and self._link.gone:
            raise RuntimeError("the replica's engine process is gone")

    def metrics_port(self) -> int:
        """The port this replica's /metrics listens on; 0 when off."""
        return self._metrics_port

    async def __del__(self) -> None:
        """Ray calls this once the replica has drained: finish what is queued, stop /metrics."""
        self._closing = True
        metrics.READY.set(0)
        if (service := getattr(self, "service", None)) is not None:
            await service.close()
        if (engine := getattr(self, "_engine", None)) is not None:
            await engine.close()
        if (link := getattr(self, "_link", None)) is not None:
            await link.close()
        if (server := getattr(self, "_metrics_http", None)) is not None:
            server.shutdown()


async def _join(settings: Settings, engine: DeploymentHandle) -> tuple[FrontLink, RemoteScoring]:
    """Join the shared engine that the Engine deployment runs on this replica's node: this process
    takes Ray's calls and tokenizes, the engine process batches them with its other front ends'."""
    with contextlib.suppress(AttributeError, RuntimeError):  # another Ray's handle, or one in use
        # an Engine replica on this node first, if there is one (Ray 2.60 has no public way to ask)
        engine._init(_prefer_local_routing=True)
    node, path = await engine.address.remote()
    here = ray.get_runtime_context().get_node_id()
    if node != here:
        raise RuntimeError(
            f"engine_process=shared: this replica runs on node {here} and the engine it was given on"
            f" node {node}; a front end must run on its engine's node (docs/ray.md)"
        )
    link = FrontLink(f"replica-{serve.get_replica_context().replica_id.unique_id}")
    await link.connect(path)
    async with asyncio.timeout(60):  # the engine is warm once its deployment answers
        return link, await attach(link, settings, lambda: None)


@serve.deployment(
    name="Engine",
    max_ongoing_requests=64,  # it answers its front ends' address() and metrics_port() alone
    graceful_shutdown_wait_loop_s=2.0,
    graceful_shutdown_timeout_s=30.0,
    health_check_period_s=2.0,
    logging_config={"enable_access_log": False},
)
class EngineDeployment:
    """The engine of ``engine_process=shared`` (one replica per GPU): the model, the batcher and
    the device work in a child process of this replica, which the Scorer replicas of its node join
    as front ends through a Unix socket, as ``scorer serve``'s front-end processes join its engine
    process. The calls' batches then hold every front end's calls; the engine's metrics (batches,
    forward, cache) are on this replica's /metrics, each call's own on its front end's."""

    async def __init__(self, args: dict | None = None) -> None:
        s = Settings(**ScorerArgs.model_validate(args or {}).model_dump())
        _configure_logging(s.log_level)
        self._engine = EngineProcess(s)
        service = await self._engine.start()
        await service.close()  # its tokenizer threads: the front ends tokenize, this replica only owns
        self._node = ray.get_runtime_context().get_node_id()
        self._metrics_http, self._metrics_port = _serve_metrics(s, self._engine.dir)
        metrics.READY.set(1)
        log.info(
            "ENGINE %s in process %d, at %s; %.1f s after the replica's process started; metrics on port %s",
            service.engine.model_name,
            self._engine.proc.pid,
            self._engine.path,
            process_age_s(),
            self._metrics_port or "off",
        )

    def address(self) -> tuple[str, str]:
        """(node id, Unix socket path) of the engine process."""
        return self._node, self._engine.path

    def check_health(self) -> None:
        if not self._engine.alive():
            raise RuntimeError("the shared engine process is gone")

    def metrics_port(self) -> int:
        return self._metrics_port

    async def __del__(self) -> None:
        """The engine finishes what it holds (its front ends drain first), then stops."""
        metrics.READY.set(0)
        if (engine := getattr(self, "_engine", None)) is not None:
            await engine.close()
        if (server := getattr(self, "_metrics_http", None)) is not None:
            server.shutdown()


def build_app(args: ScorerArgs) -> Application:
    """The application of ``serve run`` / a serve config's ``import_path``: one Scorer deployment,
    and with ``engine_process=shared`` the Engine deployment its replicas join (give the Engine the
    GPU and the Scorer none: a serve config's ``deployments`` section, or ``scorer.ray_local``)."""
    if args.engine_process == "shared":
        return deployment_for(args).bind(args.model_dump(), EngineDeployment.bind(args.model_dump()))
    return deployment_for(args).bind(args.model_dump())


def deployment_for(args: ScorerArgs) -> Deployment:
    """The Scorer deployment sized to ``args``: a replica holds as many calls as its batcher queues
    (``max_ongoing_requests`` = ``max_queue``; a serve config's ``deployments`` section still
    overrides it), since calls beyond wait in Ray's router, where they join no batch and no
    deadline is checked."""
    return ScorerDeployment.options(max_ongoing_requests=args.max_queue)


def engine_in_child(args: Settings) -> bool:
    """``engine_process``: auto is on with the model on a GPU (where planning and launching batches
    is what the replica's interpreter must not share), off on the CPU."""
    if args.engine_process != "auto":
        return args.engine_process == "on"
    return on_gpu(args.device)


def _serve_metrics(args: Settings, multiprocess_dir: str | None = None) -> tuple[WSGIServer | None, int]:
    """Start /metrics on the first free port from ``args.metrics_port`` (with the engine process's
    metrics from ``multiprocess_dir``); (server, port) or (None, 0)."""
    if not args.metrics_port:
        return None, 0
    for port in range(args.metrics_port, args.metrics_port + args.metrics_port_tries):
        try:
            return metrics.serve_http(port, args.metrics_host, multiprocess_dir), port
        except OSError:
            continue
    log.warning(
        "no free metrics port in %d..%d; this replica exports no metrics",
        args.metrics_port,
        args.metrics_port + args.metrics_port_tries - 1,
    )
    return None, 0


def _configure_logging(level: str) -> None:
    """The scorer's loggers write the standalone server's lines (with request ids) to the process's
    own stderr, which Ray keeps in the replica worker's logs/worker-*.err and streams to the driver.
    Not to ``sys.stderr``: in a replica that is Serve's ``StreamToLogger``, which walks the caller's
    stack (``traceback.extract_stack``, a stat of every file in it) for each line written; that was
    38% of a replica's request path on the CPU (py-spy, docs/ray.md)."""
    logger = logging.getLogger("scorer")
    if any(isinstance(f, RequestIdFilter) for h in logger.handlers for f in h.filters):
        return
    handler = logging.StreamHandler(sys.__stderr__ or sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
