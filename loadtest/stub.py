"""A no-model ScoreDocs server: answers at once (or after a simulated service time), exports the scorer's
metric names. It measures the load generator's own capacity and lets the tool be tried without a model.

A simulated capacity: ``--workers W --service-ms S`` serves at most W calls at a time, S ms each
(W / S * 1000 calls/s); ``--queue Q`` refuses calls with RESOURCE_EXHAUSTED beyond W + Q in the server.

``--http-port P`` also serves the HTTP rerank shapes (Cohere /v2/rerank, Jina /v1/rerank, TEI /rerank,
/health) on plain asyncio streams, HTTP/1.1 keep-alive, in the same capacity, refusing with 429 and the
server's JSON error body, and answering 504 once a call's ``X-Timeout-Ms`` passes; its calls are
counted under ``api="cohere"`` etc., the gRPC calls under ``api="grpc"``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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
            self.requests = Counter(m.REQUESTS, "calls", ["api", "scheme", "code"], registry=registry)
            self.errors = Counter(m.ERRORS, "errors", ["api", "code"], registry=registry)
            self.docs = Counter(m.DOCS, "docs", ["scheme"], registry=registry)
            self.rejected = Counter(m.REJECTED, "rejected", registry=registry)
            self.inflight = Gauge(m.INFLIGHT, "in flight", registry=registry)
            self.duration = Histogram(
                "scorer_request_duration_seconds", "latency", ["scheme", "code"], registry=registry
            )

    def _observe(self, scheme: str, code: str, docs: int, start: float, api: str = "grpc") -> None:
        if self.registry is None:
            return
        self.requests.labels(api=api, scheme=scheme, code=code).inc()
        self.duration.labels(scheme=scheme, code=code).observe(time.perf_counter() - start)
        if code == "OK":
            self.docs.labels(scheme=scheme).inc(docs)
        else:
            self.errors.labels(api=api, code=code).inc()

    async def serve_http(self, api: str, docs: int, timeout_s: float | None) -> str:
        """One HTTP call in the simulated capacity: its gRPC code (counted as the server counts it)."""
        start = time.perf_counter()
        if self.limit is not None and self.inside >= self.limit:
            if self.registry is not None:
                self.rejected.inc()
            self._observe("none", "RESOURCE_EXHAUSTED", 0, start, api)
            return "RESOURCE_EXHAUSTED"
        self.inside += 1
        if self.registry is not None:
            self.inflight.inc()
        code = "OK"
        try:
            async with asyncio.timeout(timeout_s):
                if self.slots is not None:
                    async with self.slots:
                        await asyncio.sleep(self.service_s)
                elif self.service_s:
                    await asyncio.sleep(self.service_s)
        except TimeoutError:
            code = "DEADLINE_EXCEEDED"
        finally:
            self.inside -= 1
            if self.registry is not None:
                self.inflight.dec()
        self._observe("naive" if code == "OK" else "none", code, docs, start, api)
        return code

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


HTTP_SHAPES = {
    "/v2/rerank": ("cohere", "documents"),
    "/v1/rerank": ("jina", "documents"),
    "/rerank": ("tei", "texts"),
}
HTTP_STATUS = {"OK": 200, "INVALID_ARGUMENT": 400, "RESOURCE_EXHAUSTED": 429, "DEADLINE_EXCEEDED": 504}
REASONS = {
    200: b"OK",
    400: b"Bad Request",
    404: b"Not Found",
    429: b"Too Many Requests",
    504: b"Gateway Timeout",
}


class HttpStub:
    """The rerank routes and /health over HTTP/1.1 keep-alive: a request's body by Content-Length,
    one request at a time on a connection; every document scores 0.5."""

    def __init__(self, scorer: StubScorer) -> None:
        self.scorer = scorer

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, path, _ = head[0].split(" ", 2)
                headers = {}
                for line in head[1:]:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                size = int(headers.get("content-length") or 0)
                body = await reader.readexactly(size) if size else b""
                status, answer = await self.answer(method, path, headers, body)
                writer.write(
                    b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (status, REASONS.get(status, b"Error"), len(answer), answer)
                )
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def answer(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> tuple[int, bytes]:
        if method == "GET" and path == "/health":
            return 200, b'{"status":"SERVING"}'
        if method != "POST" or path not in HTTP_SHAPES:
            return 404, b'{"detail":"Not Found"}'
        api, field = HTTP_SHAPES[path]
        try:
            docs = len(json.loads(raw)[field])
        except (ValueError, KeyError, TypeError):
            return 400, self.error("INVALID_ARGUMENT", f"{field}: required", field)
        timeout = headers.get("x-timeout-ms")
        code = await self.scorer.serve_http(api, docs, float(timeout) / 1e3 if timeout else None)
        if code != "OK":
            return HTTP_STATUS[code], self.error(code, f"stub: {code}", "")
        if api == "tei":
            return 200, json.dumps([{"index": i, "score": 0.5} for i in range(docs)]).encode()
        results = [{"index": i, "relevance_score": 0.5} for i in range(docs)]
        if api == "jina":
            return 200, json.dumps(
                {"model": "stub", "usage": {"total_tokens": 0}, "results": results}
            ).encode()
        return 200, json.dumps(
            {"id": headers.get("x-request-id", ""), "results": results, "meta": {}}
        ).encode()

    @staticmethod
    def error(code: str, message: str, field: str) -> bytes:
        return json.dumps({"message": message, "field": field, "code": code, "request_id": ""}).encode()


async def serve(args: argparse.Namespace) -> None:
    registry = None
    if args.metrics_port >= 0:
        registry = CollectorRegistry()
        server_http, _ = start_http_server(args.metrics_port, addr=args.host, registry=registry)
        print(f"metrics on http://{args.host}:{server_http.server_port}/metrics", flush=True)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    scorer = StubScorer(args.workers, args.service_ms / 1000, args.queue, registry)
    scorer_pb2_grpc.add_ScorerServicer_to_server(scorer, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    http = None
    if args.http_port >= 0:
        http = await asyncio.start_server(HttpStub(scorer).handle, args.host, args.http_port)
        print(f"stub http on {args.host}:{http.sockets[0].getsockname()[1]}", flush=True)
    print(f"stub listening on {args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), args.lifetime_s if args.lifetime_s > 0 else None)
    if http is not None:
        http.close()
    await server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.stub", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    p.add_argument("--metrics-port", type=int, default=-1, help="-1: no /metrics; 0: any free port")
    p.add_argument(
        "--http-port", type=int, default=-1, help="the HTTP rerank routes; -1: none; 0: any free port"
    )
    p.add_argument("--workers", type=int, default=0, help="calls served at once (0: unlimited)")
    p.add_argument("--service-ms", type=float, default=0.0, help="time each call takes")
    p.add_argument("--queue", type=int, default=-1, help="calls waiting beyond --workers (-1: unlimited)")
    p.add_argument("--lifetime-s", type=float, default=3600.0, help="exit after this long (0: never)")
    asyncio.run(serve(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
