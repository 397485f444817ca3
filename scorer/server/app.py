"""``scorer serve``: the grpc.aio server, its health and reflection services, and its lifecycle, in
one process (``frontends.py`` lays the same parts, ``lifecycle.py``, over N front-end processes).

Start: the port opens at once with health NOT_SERVING; the model loads and is warmed up off the
event loop; then health turns SERVING. SIGTERM (or SIGINT): health turns NOT_SERVING at once,
calls are still served for ``--drain-seconds`` so load balancers can move away, then new calls
are refused, calls in flight finish (up to ``--grace-seconds``), and the process exits 0. With
``--http-port`` the HTTP rerank routes (``http.py``) follow the same lifecycle on the same loop and
handler: /health answers 503 until SERVING and again from the signal on.
"""

from __future__ import annotations

import logging

from grpc_health.v1.health import aio as health_aio

from ..attention import BackendUnavailable
from ..settings import Settings
from . import loops, stacks
from .calls import configure_logging
from .frontends import frontend_count, serve_split
from .handler import CallHandler
from .lifecycle import (
    NOT_SERVING,
    SERVING,
    CannotListen,
    Signals,
    drain,
    grpc_server,
    listen_http,
    serve_metrics,
    serve_until_stopped,
    set_health,
    start_service,
    stop_accepting,
)
from .scoring import ScoringService
from .servicer import ScorerServicer

log = logging.getLogger("scorer.server")


def run(settings: Settings) -> int:
    """Serve until SIGTERM or SIGINT; returns the exit code (2: a port or backend that cannot
    work). ``scorer.server.run`` checks the settings first."""
    configure_logging(settings.log_level)
    stacks.from_environment()  # SCORER_STACK_SAMPLES: where this process's threads spend their time
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


async def serve(args: Settings) -> int:
    signals = Signals()
    frontends = frontend_count(args.frontends, args.device)
    if frontends:
        return await serve_split(args, signals, frontends)
    handler = CallHandler.from_settings(args)
    inflight = handler.inflight
    health = health_aio.HealthServicer()
    await set_health(health, NOT_SERVING)
    metrics_http = serve_metrics(args)
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
        http = await listen_http(
            args, handler, lambda: handler.service is not None and not signals.stop.is_set()
        )
        service = await start_service(args, signals)
        if service is not None:
            handler.service = service
            await set_health(health, SERVING)
            await serve_until_stopped(service, signals)
        await health.enter_graceful_shutdown()
        await drain(args, signals)
        await stop_accepting(server, http, inflight, args.grace_seconds)
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
