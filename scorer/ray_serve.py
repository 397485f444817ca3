"""ScoreDocs on Ray Serve: each replica loads the engine once and serves it through ScoringService.

Clients keep the ``scorer.v1.Scorer`` stub and point it at Ray's gRPC proxy; the proxy calls the
deployment's ``ScoreDocs`` (and ``Check``, the standard ``grpc.health.v1`` health check) with the
request proto. Batching, scores, status codes and trailers are those of ``scorer serve``; each
replica serves the ``scorer_`` Prometheus metrics on its own port. See docs/ray.md.

    serve run deploy/ray/serve.yaml
    serve run scorer.ray_serve:build_app model_dir=/models/Qwen3-Reranker-0.6B
"""

# No ``from __future__ import annotations``: Ray validates builder args by the annotation's class.

import asyncio
import logging
import time
from typing import Literal
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health_pb2
from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve import Application
from ray.serve.config import gRPCOptions
from ray.serve.grpc_util import RayServegRPCContext

from . import metrics
from .engine import Engine, EngineConfig
from .server.app import DTYPES, LOG_FORMAT, SCORER_SERVICE
from .server.batcher import BatchPolicy
from .server.calls import Call, Inflight, RequestIdFilter, close_call, open_call
from .server.convert import request_from_proto, response_to_proto
from .server.interceptor import REQUEST_ID_KEY, status_for
from .server.scoring import ScoringService, engine_config, ready_engine
from .v1 import scorer_pb2 as pb

log = logging.getLogger("scorer.ray_serve")

GRPC_SERVICER_FUNCTIONS = [
    "scorer.v1.scorer_pb2_grpc.add_ScorerServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]
SCORE_METHOD = f"/{SCORER_SERVICE}/ScoreDocs"
HEALTHY_SERVICES = ("", SCORER_SERVICE)


def grpc_options(port: int = 9000, request_timeout_s: float | None = None) -> gRPCOptions:
    """The gRPC proxy options that serve ``scorer.v1.Scorer`` and ``grpc.health.v1.Health``."""
    return gRPCOptions(
        port=port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS, request_timeout_s=request_timeout_s
    )


_BATCH = BatchPolicy()
_ENGINE = EngineConfig()


class ScorerArgs(BaseModel):
    """Arguments of one replica: the ``args`` of a serve config, or ``key=value`` after ``serve run``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_dir: str | None = None
    """Checkpoint directory; None: the embedded tiny model under $SCORER_CACHE_DIR."""
    attention_backend: str = "auto"
    device: str | None = None
    """cuda or cpu; None: cuda when the replica sees a GPU."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    auto_policy: str = _ENGINE.auto_policy
    cuda_graph_max_tokens: int = _ENGINE.cuda_graph_max_tokens
    model_kernels: Literal["auto", "torch", "flashinfer"] = "auto"
    max_batch_tokens: int = _BATCH.max_batch_tokens
    max_wait_ms: float = _BATCH.max_wait_s * 1e3
    max_queue: int = _BATCH.max_queue
    max_docs: int = _ENGINE.max_docs
    max_doc_tokens: int = _ENGINE.max_doc_tokens
    call_timeout_s: float | None = None
    """Deadline of each call from its arrival at the replica (Ray's proxy does not pass the client's
    deadline on); it lets the batcher refuse or drop calls that cannot finish in time."""
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9464
    """First port tried for /metrics; 0: no metrics server."""
    metrics_port_tries: int = 8
    """Replicas on one node take the next free port, up to this many from ``metrics_port``."""
    log_level: str = "INFO"

    def batch_policy(self) -> BatchPolicy:
        return BatchPolicy(
            max_batch_tokens=self.max_batch_tokens,
            max_wait_s=self.max_wait_ms / 1e3,
            max_queue=self.max_queue,
        )


@serve.deployment(
    name="Scorer",
    max_ongoing_requests=64,
    graceful_shutdown_wait_loop_s=2.0,
    graceful_shutdown_timeout_s=30.0,
)
class ScorerDeployment:
    """One engine and one ScoringService per replica; ``ScoreDocs`` is the gRPC method."""

    async def __init__(self, args: ScorerArgs | dict | None = None) -> None:
        self.args = ScorerArgs.model_validate(args or {})
        _configure_logging(self.args.log_level)
        engine = await asyncio.to_thread(load_engine, self.args)
        self.service = ScoringService(engine, self.args.batch_policy())
        self.service.start()
        self._inflight = Inflight()
        self._closing = False
        self._metrics_http, self._metrics_port = _serve_metrics(self.args)
        metrics.READY.set(1)
        log.info("SERVING %s; metrics on port %s", engine.model_name, self._metrics_port or "off")

    async def ScoreDocs(
        self, request: pb.ScoreDocsRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.ScoreDocsResponse:
        """Score one call. Through the gRPC proxy a failure is answered with its status code, details
        and trailers (as the standalone interceptor does); through a deployment handle it raises."""
        call, token = open_call(SCORE_METHOD, request.request_id)
        trailers = ((REQUEST_ID_KEY, call.request_id),)
        code, message = grpc.StatusCode.OK, ""
        self._inflight.enter()
        try:
            if grpc_context is not None:
                grpc_context.set_trailing_metadata(list(trailers))
            return await self._score(request, call)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            code, message, extra = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", SCORE_METHOD)
            if grpc_context is None:
                raise
            grpc_context.set_code(code)
            grpc_context.set_details(message)
            grpc_context.set_trailing_metadata(list(trailers + extra))
            return pb.ScoreDocsResponse()
        finally:
            seconds = time.monotonic() - call.started
            self._inflight.leave()
            metrics.observe_request(call.scheme, code.name, seconds)
            log.info(
                "%s %s scheme=%s %.1f ms%s",
                SCORE_METHOD,
                code.name,
                call.scheme,
                seconds * 1e3,
                f": {message}" if message else "",
            )
            close_call(token)

    async def _score(self, request: pb.ScoreDocsRequest, call: Call) -> pb.ScoreDocsResponse:
        timeout = self.args.call_timeout_s
        deadline = None if timeout is None else call.started + timeout
        parsed = request_from_proto(request, call.request_id)
        tokenized, tokenize_seconds = await self.service.tokenize(parsed)
        call.scheme = self.service.scheme(tokenized)
        scored = await self.service.score(tokenized, deadline, call.request_id)
        return response_to_proto(
            request,
            call.request_id,
            self.service.engine.model_name,
            scored,
            tokenize_seconds,
            time.monotonic() - call.started,
        )

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

    def metrics_port(self) -> int:
        """The port this replica's /metrics listens on; 0 when off."""
        return self._metrics_port

    async def __del__(self) -> None:
        """Ray calls this once the replica has drained: finish what is queued, stop /metrics."""
        self._closing = True
        metrics.READY.set(0)
        if (service := getattr(self, "service", None)) is not None:
            await service.close()
        if (server := getattr(self, "_metrics_http", None)) is not None:
            server.shutdown()


def build_app(args: ScorerArgs) -> Application:
    """The application of ``serve run`` / a serve config's ``import_path``: one Scorer deployment."""
    return ScorerDeployment.bind(args.model_dump())


def load_engine(args: ScorerArgs) -> Engine:
    """Build and warm up the engine on this replica's device, and label ``scorer_model_info``."""
    dtype = DTYPES[args.dtype] if args.dtype else None
    return ready_engine(args.model_dir, args.attention_backend, args.device, dtype, engine_config(args))


def _serve_metrics(args: ScorerArgs) -> tuple[WSGIServer | None, int]:
    """Start /metrics on the first free port from ``args.metrics_port``; (server, port) or (None, 0)."""
    if not args.metrics_port:
        return None, 0
    for port in range(args.metrics_port, args.metrics_port + args.metrics_port_tries):
        try:
            return metrics.serve_http(port, args.metrics_host), port
        except OSError:
            continue
    log.warning(
        "no free metrics port in %d..%d; this replica exports no metrics",
        args.metrics_port,
        args.metrics_port + args.metrics_port_tries - 1,
    )
    return None, 0


def _configure_logging(level: str) -> None:
    """The scorer's loggers write the standalone server's lines (with request ids) to stderr, which
    Ray keeps in the replica worker's logs/worker-*.err and streams to the driver."""
    logger = logging.getLogger("scorer")
    if any(isinstance(f, RequestIdFilter) for h in logger.handlers for f in h.filters):
        return
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
