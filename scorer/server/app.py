"""``scorer serve``: the grpc.aio server, its health and reflection services, and its lifecycle.

Start: the port opens at once with health NOT_SERVING; the model loads and is warmed up off the
event loop; then health turns SERVING. SIGTERM (or SIGINT): health turns NOT_SERVING at once,
calls are still served for ``--drain-seconds`` so load balancers can move away, then new calls
are refused, calls in flight finish (up to ``--grace-seconds``), and the process exits 0. With
``--http-port`` the HTTP rerank routes (``http.py``) follow the same lifecycle on the same loop and
handler: /health answers 503 until SERVING and again from the signal on.
"""

from __future__ import annotations

import argparse
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
from ..attention import BackendUnavailable
from ..engine import Engine
from ..settings import SERVE, Settings, from_args
from ..v1 import scorer_pb2
from . import loops
from .calls import Inflight, RequestIdFilter
from .frontends import frontend_count, serve_split
from .handler import CallHandler
from .limits import limit_accept_log
from .scoring import ScoringService, process_age_s, ready_engine
from .servicer import ScorerServicer

log = logging.getLogger("scorer.server")

SCORER_SERVICE = scorer_pb2.DESCRIPTOR.services_by_name["Scorer"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s request_id=%(request_id)s %(message)s"


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; returns the exit code (2: a setting that cannot work)."""
    configure_logging("INFO")
    try:
        settings = from_args(args, SERVE)
    except ValueError as e:
        log.error("%s", e)
        return 2
    configure_logging(settings.log_level)
    try:
        return loops.run(serve(settings), settings.busy_poll_ms / 1e3)
    except CannotListen as e:
        log.error("cannot listen on %s", e)
        return 2
    except BackendUnavailable as e:
        log.error("%s (or pass --attention-fallback torch)", e)
        return 2
    except Exception:
        log.exception("server failed")
        return 1


class CannotListen(Exception):
    """A port is taken (or not ours to bind)."""


def configure_logging(level: str, prefix: str = "") -> None:
    """``prefix``: what starts each line (a front-end process's name)."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(prefix + LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    limit_accept_log()  # out of descriptors, asyncio logs each failed accept: one line per 10 s instead


class _Signals:
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


async def serve(args: Settings) -> int:
    signals = _Signals()
    frontends = frontend_count(args.frontends, args.device)
    if frontends:
        return await serve_split(args, signals, frontends)
    handler = CallHandler(max_message_bytes=args.max_message_bytes)
    inflight = handler.inflight
    health = health_aio.HealthServicer()
    await _set_health(health, NOT_SERVING)
    metrics_http = _metrics_http(args)
    try:
        server, port = grpc_server(args, ScorerServicer(handler), health)
    except RuntimeError as e:
        if metrics_http is not None:
            metrics_http.shutdown()
        raise CannotListen(f"gRPC port {args.host}:{args.port}: {e}") from None
    await server.start()
    log.info(
        "listening on %s:%d (%s); metrics on port %s",
        args.host,
        port,
        "TLS" if args.tls_cert else "plaintext",
        args.metrics_port or "off",
    )
    service: ScoringService | None = None
    http = None
    try:
        http = await _start_http(
            args, handler, lambda: handler.service is not None and not signals.stop.is_set()
        )
        service = await _start_service(args, signals)
        if service is not None:
            handler.service = service
            await _set_health(health, SERVING)
            await _serving(service, signals)
        await health.enter_graceful_shutdown()
        await _drain(args, signals)
        await _stop_accepting(server, http, inflight, args.grace_seconds)
    finally:
        await server.stop(0)
        if http is not None:
            await http.stop()
        if service is not None:
            await service.close()
        if metrics_http is not None:
            metrics_http.shutdown()
    log.info("stopped")
    return 0


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
            *args.grpc_options(),  # connection cap, handshake, idle, age, keepalive (limits.py)
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


async def _start_http(
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
            args.api_key,
            reuse_port=reuse_port,
            limits=args.http_limits(),
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
        "; API key required" if args.api_key else "",
    )


def _metrics_http(args: Settings, multiprocess_dir: str | None = None):
    """``/metrics`` on ``--metrics-port`` (see ``metrics.serve_http``), or None when it is 0."""
    if not args.metrics_port:
        return None
    try:
        return metrics.serve_http(args.metrics_port, args.host, multiprocess_dir)
    except OSError as e:
        raise CannotListen(f"metrics port {args.host}:{args.metrics_port}: {e.strerror}") from None


async def _start_service(
    args: Settings, signals: _Signals, loading: asyncio.Future[Engine] | None = None
) -> ScoringService | None:
    """The warm engine's scoring service, started; None when a signal came while loading.
    ``loading``: a load started earlier (``loading_engine``), else one starts now."""
    engine = await _load_or_stop(args, signals, loading)
    if engine is None:
        return None
    service = ScoringService(engine, args.batch_policy(), args.knobs())
    service.start()
    return service


async def _serving(service: ScoringService, signals: _Signals) -> None:
    """The front ends have ``service``: SERVING, until the first signal."""
    metrics.READY.set(1)
    log.info("SERVING %s, %.1f s after the process started", service.engine.model_name, process_age_s())
    await signals.stop.wait()


def loading_engine(args: Settings) -> asyncio.Future[Engine]:
    """Load and warm the model on a thread, from now on."""
    return asyncio.ensure_future(asyncio.to_thread(ready_engine, args))


async def _load_or_stop(
    args: Settings, signals: _Signals, loading: asyncio.Future[Engine] | None = None
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


async def _drain(args: Settings, signals: _Signals) -> None:
    """Health says NOT_SERVING already: calls are still served for ``--drain-seconds`` (a second
    signal cuts it short), so that load balancers move away first."""
    metrics.READY.set(0)
    log.info("NOT_SERVING; still serving new calls for %.1f s", args.drain_seconds)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(signals.hurry.wait(), args.drain_seconds)


async def _stop_accepting(server: grpc.aio.Server, http, inflight: Inflight, grace_s: float) -> None:
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


async def _set_health(health: health_aio.HealthServicer, status: int) -> None:
    for service in ("", SCORER_SERVICE):
        await health.set(service, status)
