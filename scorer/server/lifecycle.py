"""What both layouts of ``scorer serve`` share: the one-process server (``app.py``) and the
front ends in processes of their own (``frontends.py``) are two arrangements of these parts.

Health states and the gRPC server with its services (``grpc_server``), the HTTP routes and the
metrics endpoint on their ports (``CannotListen`` when a port is taken), the signals, loading and
starting the scoring service, SERVING until the first signal (``serve_until_stopped``), the drain
and the stop (``drain``, ``stop_accepting``), and the log format.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from .. import metrics
from ..engine import Engine
from ..settings import Settings
from ..v1 import scorer_pb2
from . import limits
from .auth import load_keys, metrics_guard
from .batcher import BatchPolicy
from .calls import Inflight
from .debug import DebugKnobs
from .handler import CallHandler
from .limits import default_max_connections
from .scoring import ScoringService, process_age_s, ready_engine
from .servicer import ScorerServicer

log = logging.getLogger("scorer.server")

SCORER_SERVICE = scorer_pb2.DESCRIPTOR.services_by_name["Scorer"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class CannotListen(Exception):
    """A port is taken (or not ours to bind)."""


class Signals:
    """First SIGTERM/SIGINT: shut down; a second one cuts the drain short."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._received, sig)

    def _received(self, sig: signal.Signals) -> None:
        log.info("received %s", sig.name)
        (self.hurry if self.stop.is_set() else self.stop).set()


def grpc_server(
    args: Settings, servicer: ScorerServicer, health: health_aio.HealthServicer, reuse_port: bool = False
) -> tuple[grpc.aio.Server, int]:
    """The server with its services registered and its port bound; returns it and the port.
    ``reuse_port``: beside other processes' servers on the same port (front-end processes)."""
    server = grpc.aio.server(
        options=[
            # twice the limit: a request up to that is refused by the handler, answered and counted
            ("grpc.max_receive_message_length", 2 * args.max_message_bytes),
            ("grpc.max_send_message_length", args.max_message_bytes),
            ("grpc.so_reuseport", int(reuse_port)),
            *grpc_options(args),  # connection cap, handshake, idle, age, keepalive (limits.py)
        ],
    )
    server.add_generic_rpc_handlers((scorer_handlers(servicer),))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    services = (SCORER_SERVICE, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(services, server)
    address = f"{args.host}:{args.port}"
    if not args.tls_cert:
        return server, server.add_insecure_port(address)
    key_and_chain = (Path(args.tls_key).read_bytes(), Path(args.tls_cert).read_bytes())
    return server, server.add_secure_port(address, grpc.ssl_server_credentials([key_and_chain]))


def scorer_handlers(servicer: ScorerServicer) -> grpc.GenericRpcHandler:
    """``scorer.v1.Scorer`` with ScoreDocs taking the request's bytes: the handler parses them."""
    score = grpc.unary_unary_rpc_method_handler(
        servicer.ScoreDocs, response_serializer=scorer_pb2.ScoreDocsResponse.SerializeToString
    )
    return grpc.method_handlers_generic_handler(SCORER_SERVICE, {"ScoreDocs": score})


async def listen_http(
    args: Settings,
    handler: CallHandler,
    serving: Callable[[], bool],
    reuse_port: bool = False,
    quiet: bool = False,
):
    """The HTTP rerank routes on ``--http-port``, or None (then nothing of the HTTP stack is imported);
    /health is 200 while ``serving()``, as gRPC's health is SERVING."""
    if not args.http_port:
        return None
    from .http import start_http

    try:
        http = await start_http(
            handler,
            serving,
            args.host,
            args.http_port,
            handler.keys,
            reuse_port=reuse_port,
            limits=http_limits(args),
        )
    except OSError as e:
        raise CannotListen(f"HTTP port {args.host}:{args.http_port}: {e.strerror}") from None
    if not quiet:
        log_http(args, http.port)
    return http


def log_http(args: Settings, port: int) -> None:
    log.info(
        "HTTP rerank on http://%s:%d (Cohere /v2/rerank, Jina /v1/rerank, TEI /rerank)%s",
        args.host,
        port,
        "; API key required" if load_keys(args.api_key, args.api_key_file) else "",
    )


def serve_metrics(args: Settings, multiprocess_dir: str | None = None):
    """``/metrics`` on ``--metrics-port`` (see ``metrics.serve_http``), or None when it is 0."""
    if not args.metrics_port:
        return None
    try:
        return metrics.serve_http(args.metrics_port, args.host, multiprocess_dir, metrics_guard(args))
    except OSError as e:
        raise CannotListen(f"metrics port {args.host}:{args.metrics_port}: {e.strerror}") from None


def connections(s: Settings) -> int:
    """``--max-connections`` as a number."""
    return default_max_connections() if s.max_connections == "auto" else int(s.max_connections)


def grpc_options(s: Settings) -> list[tuple[str, int]]:
    """The gRPC server's connection cap, handshake, idle, age and keepalive (``limits.grpc_options``)."""
    return limits.grpc_options(
        connections(s),
        s.http_header_timeout_s,
        s.grpc_idle_timeout_s,
        s.grpc_max_connection_age_s,
        s.grace_seconds,
        s.grpc_keepalive_s,
    )


def http_limits(s: Settings):
    """The HTTP edge's limits (``http_edge.HttpLimits``)."""
    from .http_edge import HttpLimits  # the HTTP stack is imported only with --http-port

    return HttpLimits(
        connections(s),
        s.http_keep_alive_s,
        s.http_header_timeout_s,
        s.http_body_timeout_s,
        s.max_header_bytes,
        s.max_headers,
    )


def batch_policy(s: Settings) -> BatchPolicy:
    """The batcher's policy from ``s``."""
    return BatchPolicy(
        s.max_batch_tokens, s.max_wait_ms / 1e3, s.max_queue, s.loop_path_gaps, s.cut_before_heavy
    )


def debug_knobs(s: Settings) -> DebugKnobs:
    """The test knobs from ``s`` (all off unless a ``--debug-*`` flag sets one)."""
    return DebugKnobs(
        s.debug_forward_delay_ms / 1e3,
        s.debug_oom_above_tokens,
        s.debug_fault_prompt,
        s.debug_tokenize_delay_ms / 1e3,
    )


async def start_service(
    args: Settings, signals: Signals, loading: asyncio.Future[Engine] | None = None
) -> ScoringService | None:
    """The warm engine's scoring service, started; None when a signal came while loading.
    ``loading``: a load started earlier (``loading_engine``), else one starts now."""
    engine = await _load_or_stop(args, signals, loading)
    if engine is None:
        return None
    service = ScoringService(engine, batch_policy(args), debug_knobs(args))
    service.start()
    return service


async def serve_until_stopped(service: ScoringService, signals: Signals) -> None:
    """The front ends have ``service``: SERVING, until the first signal."""
    metrics.READY.set(1)
    log.info("SERVING %s, %.1f s after the process started", service.engine.model_name, process_age_s())
    await signals.stop.wait()


def loading_engine(args: Settings) -> asyncio.Future[Engine]:
    """Load and warm the model on a thread, from now on."""
    return asyncio.ensure_future(asyncio.to_thread(ready_engine, args))


async def _load_or_stop(
    args: Settings, signals: Signals, loading: asyncio.Future[Engine] | None = None
) -> Engine | None:
    """The loaded, warm model (``loading``'s, or a load started now); None when a signal came first."""
    loading = loading or loading_engine(args)
    stopping = asyncio.ensure_future(signals.stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if loading.done():
        return loading.result()
    log.info("stop requested while loading the model")
    return None


async def drain(args: Settings, signals: Signals) -> None:
    """Health says NOT_SERVING already: calls are still served for ``--drain-seconds`` (a second
    signal cuts it short), so that load balancers move away first."""
    metrics.READY.set(0)
    log.info("NOT_SERVING; still serving new calls for %.1f s", args.drain_seconds)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(signals.hurry.wait(), args.drain_seconds)


async def stop_accepting(server: grpc.aio.Server, http, inflight: Inflight, grace_s: float) -> None:
    """New calls refused; the calls in flight finish within ``grace_s``, then are cancelled."""
    log.info("refusing new calls; %d in flight", inflight.count)
    stopping = asyncio.ensure_future(server.stop(grace_s))
    if http is not None:  # stops listening; its calls in flight are in ``inflight`` too
        stopping_http = asyncio.ensure_future(http.stop(grace_s))
    try:
        await asyncio.wait_for(_settled(inflight), grace_s)
    except TimeoutError:
        log.warning("calls still in flight after %.1f s; cancelling them", grace_s)
    await server.stop(0)  # ends what is left: health watches, or calls past the grace period
    await stopping
    if http is not None:
        await stopping_http


async def _settled(inflight: Inflight) -> None:
    """Until no call is in flight, twice in a row a moment apart (a call may be starting)."""
    while True:
        await inflight.wait_idle()
        await asyncio.sleep(0.05)
        if inflight.count == 0:
            return


async def set_health(health: health_aio.HealthServicer, status: int) -> None:
    for service in ("", SCORER_SERVICE):
        await health.set(service, status)
