"""``scorer serve``: the grpc.aio server, its health and reflection services, and its lifecycle.

Start: the port opens at once with health NOT_SERVING; the model loads and is warmed up off the
event loop; then health turns SERVING. SIGTERM (or SIGINT): health turns NOT_SERVING at once,
calls are still served for ``--drain-seconds`` so load balancers can move away, then new calls
are refused, calls in flight finish (up to ``--grace-seconds``), and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from .. import metrics
from ..engine import AUTO_POLICIES, MODEL_KERNELS, Engine, EngineConfig
from ..v1 import scorer_pb2, scorer_pb2_grpc
from .batcher import BatchPolicy
from .calls import Inflight, RequestIdFilter
from .debug import DebugKnobs
from .interceptor import CallInterceptor
from .scoring import ScoringService, engine_config, ready_engine
from .servicer import ScorerServicer

log = logging.getLogger("scorer.server")

SCORER_SERVICE = scorer_pb2.DESCRIPTOR.services_by_name["Scorer"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s request_id=%(request_id)s %(message)s"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    b = BatchPolicy()
    parser.add_argument("--model", metavar="DIR", help="checkpoint directory (default: embedded tiny model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (gRPC and metrics)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port")
    parser.add_argument("--metrics-port", type=int, default=9464, help="Prometheus /metrics port; 0: off")
    parser.add_argument("--attention-backend", default="auto", help="auto, torch or flashinfer")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--auto-policy",
        default=d.auto_policy,
        choices=AUTO_POLICIES,
        help="how scheme=auto picks: calibrated (H200 cost model), article (section 5.3), ragged, or "
        "default (calibrated on FlashInfer, ragged on the CPU, the article's guide for torch on a GPU)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        default=d.cuda_graph_max_tokens,
        help="on CUDA, forward passes up to this many tokens replay piecewise CUDA graphs captured at"
        " start-up (everything but attention); 0: always eager",
    )
    parser.add_argument(
        "--model-kernels",
        default=d.model_kernels,
        choices=MODEL_KERNELS,
        help="norm, RoPE and SiLU-and-mul: flashinfer (fused, fp32 inside), torch (HF's op order), or"
        " auto (flashinfer with FlashInfer attention on CUDA)",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=b.max_batch_tokens,
        help="token budget of one forward pass: calls are merged up to it, a larger call runs alone"
        " in several passes that reuse its prompt's K/V",
    )
    parser.add_argument(
        "--max-wait-ms",
        type=float,
        default=b.max_wait_s * 1e3,
        help="longest a queued call waits for others to fill its batch",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=b.max_queue,
        help="calls waiting beyond this are refused with RESOURCE_EXHAUSTED",
    )
    parser.add_argument("--max-docs", type=int, default=d.max_docs, help="documents per call")
    parser.add_argument("--max-doc-tokens", type=int, default=d.max_doc_tokens, help="tokens per document")
    parser.add_argument(
        "--max-message-bytes", type=int, default=64 * 2**20, help="largest request or response message"
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=5.0,
        help="after SIGTERM: keep serving this long with health NOT_SERVING",
    )
    parser.add_argument(
        "--grace-seconds", type=float, default=30.0, help="after the drain: longest wait for calls in flight"
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain")
    parser.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    parser.add_argument("--log-level", default="INFO")
    knobs = parser.add_argument_group("test knobs (never in production)")
    knobs.add_argument(
        "--debug-forward-delay-ms", type=float, default=0.0, help="sleep this long before every forward batch"
    )
    knobs.add_argument(
        "--debug-oom-above-tokens",
        type=int,
        default=0,
        help="a forward batch over this many tokens raises OutOfMemoryError",
    )
    knobs.add_argument(
        "--debug-fault-prompt",
        default="",
        help="a forward batch with a call of this prompt raises RuntimeError",
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; returns the exit code."""
    configure_logging(args.log_level)
    if bool(args.tls_cert) != bool(args.tls_key):
        log.error("--tls-cert and --tls-key go together")
        return 2
    try:
        return asyncio.run(serve(args))
    except CannotListen as e:
        log.error("cannot listen on %s", e)
        return 2
    except Exception:
        log.exception("server failed")
        return 1


class CannotListen(Exception):
    """A port is taken (or not ours to bind)."""


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


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


async def serve(args: argparse.Namespace) -> int:
    signals = _Signals()
    inflight = Inflight()
    servicer = ScorerServicer()
    health = health_aio.HealthServicer()
    await _set_health(health, NOT_SERVING)
    try:
        metrics_http = metrics.serve_http(args.metrics_port, args.host) if args.metrics_port else None
    except OSError as e:
        raise CannotListen(f"metrics port {args.host}:{args.metrics_port}: {e.strerror}") from None
    try:
        server, port = _grpc_server(args, servicer, health, inflight)
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
    try:
        engine = await _load_or_stop(args, signals)
        if engine is not None:
            service = ScoringService(engine, _policy(args), _knobs(args))
            service.start()
            servicer.service = service
            await _set_health(health, SERVING)
            metrics.READY.set(1)
            log.info("SERVING %s", engine.model_name)
            await signals.stop.wait()
        await _shut_down(args, server, health, inflight, signals)
    finally:
        await server.stop(0)
        if service is not None:
            await service.close()
        if metrics_http is not None:
            metrics_http.shutdown()
    log.info("stopped")
    return 0


def _grpc_server(
    args: argparse.Namespace, servicer: ScorerServicer, health: health_aio.HealthServicer, inflight: Inflight
) -> tuple[grpc.aio.Server, int]:
    """The server with its services registered and its port bound; returns it and the port."""
    server = grpc.aio.server(
        interceptors=[CallInterceptor("scorer.v1", inflight)],
        options=[
            ("grpc.max_receive_message_length", args.max_message_bytes),
            ("grpc.max_send_message_length", args.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    scorer_pb2_grpc.add_ScorerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    services = (SCORER_SERVICE, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(services, server)
    address = f"{args.host}:{args.port}"
    if not args.tls_cert:
        return server, server.add_insecure_port(address)
    key_and_chain = (Path(args.tls_key).read_bytes(), Path(args.tls_cert).read_bytes())
    return server, server.add_secure_port(address, grpc.ssl_server_credentials([key_and_chain]))


async def _load_or_stop(args: argparse.Namespace, signals: _Signals) -> Engine | None:
    """Load and warm the model on a thread; None when a signal came first."""
    loading = asyncio.ensure_future(asyncio.to_thread(_load_engine, args))
    stopping = asyncio.ensure_future(signals.stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if loading.done():
        return loading.result()
    log.info("stop requested while loading the model")
    return None


def _load_engine(args: argparse.Namespace) -> Engine:
    dtype = DTYPES.get(args.dtype or "")
    return ready_engine(args.model, args.attention_backend, args.device, dtype, engine_config(args))


async def _shut_down(
    args: argparse.Namespace,
    server: grpc.aio.Server,
    health: health_aio.HealthServicer,
    inflight: Inflight,
    signals: _Signals,
) -> None:
    await health.enter_graceful_shutdown()
    metrics.READY.set(0)
    log.info("NOT_SERVING; still serving new calls for %.1f s", args.drain_seconds)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(signals.hurry.wait(), args.drain_seconds)
    log.info("refusing new calls; %d in flight", inflight.count)
    stopping = asyncio.ensure_future(server.stop(args.grace_seconds))
    try:
        await asyncio.wait_for(_settled(inflight), args.grace_seconds)
    except TimeoutError:
        log.warning("calls still in flight after %.1f s; cancelling them", args.grace_seconds)
    await server.stop(0)  # ends what is left: health watches, or calls past the grace period
    await stopping


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


def _policy(args: argparse.Namespace) -> BatchPolicy:
    return BatchPolicy(
        max_batch_tokens=args.max_batch_tokens, max_wait_s=args.max_wait_ms / 1e3, max_queue=args.max_queue
    )


def _knobs(args: argparse.Namespace) -> DebugKnobs:
    return DebugKnobs(
        forward_delay_s=args.debug_forward_delay_ms / 1e3,
        oom_above_tokens=args.debug_oom_above_tokens,
        fault_prompt=args.debug_fault_prompt,
    )
