"""A no-model ScoreDocs server: answers at once (or after a simulated service time), exports the scorer's
metric names. It measures the load generator's own capacity and lets the tool be tried without a model.

A simulated capacity: ``--workers W --service-ms S`` serves at most W calls at a time, S ms each
(W / S * 1000 calls/s); ``--queue Q`` refuses calls with RESOURCE_EXHAUSTED beyond W + Q in the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from scorer.v1 import scorer_pb2, scorer_pb2_grpc

from . import metrics as m


class StubScorer(scorer_pb2_grpc.ScorerServicer):
    def __init__(
        self,
        workers: int = 0,
        service_s: float = 0.0,
        queue: int = -1,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.service_s = service_s
        self.slots = asyncio.Semaphore(workers) if workers > 0 else None
        self.limit = workers + queue if workers > 0 and queue >= 0 else None
        self.inside = 0
        self.registry = registry
        if registry is not None:
            self.requests = Counter(m.REQUESTS, "calls", ["scheme", "code"], registry=registry)
            self.errors = Counter(m.ERRORS, "errors", ["code"], registry=registry)
            self.docs = Counter(m.DOCS, "docs", ["scheme"], registry=registry)
            self.rejected = Counter(m.REJECTED, "rejected", registry=registry)
            self.inflight = Gauge(m.INFLIGHT, "in flight", registry=registry)
            self.duration = Histogram(
                "scorer_request_duration_seconds", "latency", ["scheme", "code"], registry=registry
            )

    def _observe(self, scheme: str, code: str, docs: int, start: float) -> None:
        if self.registry is None:
            return
        self.requests.labels(scheme=scheme, code=code).inc()
        self.duration.labels(scheme=scheme, code=code).observe(time.perf_counter() - start)
        if code == "OK":
            self.docs.labels(scheme=scheme).inc(docs)
        else:
            self.errors.labels(code=code).inc()

    async def ScoreDocs(  # noqa: N802
        self, request: scorer_pb2.ScoreDocsRequest, context: grpc.aio.ServicerContext
    ) -> scorer_pb2.ScoreDocsResponse:
        start = time.perf_counter()
        if self.limit is not None and self.inside >= self.limit:
            if self.registry is not None:
                self.rejected.inc()
            self._observe("none", "RESOURCE_EXHAUSTED", 0, start)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "stub: queue full")
        self.inside += 1
        if self.registry is not None:
            self.inflight.inc()
        try:
            if self.slots is not None:
                async with self.slots:
                    await asyncio.sleep(self.service_s)
            elif self.service_s:
                await asyncio.sleep(self.service_s)
        finally:
            self.inside -= 1
            if self.registry is not None:
                self.inflight.dec()
        scheme = request.options.scheme if request.options.scheme not in ("", "auto") else "naive"
        n = len(request.docs)
        self._observe(scheme, "OK", n, start)
        return scorer_pb2.ScoreDocsResponse(
            results=[scorer_pb2.DocScore(id=d.id, index=i, score=0.5) for i, d in enumerate(request.docs)],
            scheme=scheme,
            model="stub",
            request_id=request.request_id,
        )


async def serve(args: argparse.Namespace) -> None:
    registry = None
    if args.metrics_port >= 0:
        registry = CollectorRegistry()
        server_http, _ = start_http_server(args.metrics_port, addr=args.host, registry=registry)
        print(f"metrics on http://{args.host}:{server_http.server_port}/metrics", flush=True)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    scorer_pb2_grpc.add_ScorerServicer_to_server(
        StubScorer(args.workers, args.service_ms / 1000, args.queue, registry), server
    )
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    print(f"stub listening on {args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), args.lifetime_s if args.lifetime_s > 0 else None)
    await server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.stub", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    p.add_argument("--metrics-port", type=int, default=-1, help="-1: no /metrics; 0: any free port")
    p.add_argument("--workers", type=int, default=0, help="calls served at once (0: unlimited)")
    p.add_argument("--service-ms", type=float, default=0.0, help="time each call takes")
    p.add_argument("--queue", type=int, default=-1, help="calls waiting beyond --workers (-1: unlimited)")
    p.add_argument("--lifetime-s", type=float, default=3600.0, help="exit after this long (0: never)")
    asyncio.run(serve(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
