"""The HTTP server's connections under abuse: uvicorn's httptools protocol with a cap on open
connections, a deadline for a request's headers, and limits on their size and number.

uvicorn has none of these: its ``limit_concurrency`` answers 503 to requests but keeps idle
connections open for good, and its keep-alive timer only runs between requests, so a connection
that never sends a request, or sends its headers a byte a second, is kept. ``EdgeProtocol``:

- at ``max_connections`` open, a new connection closes an idle one (no request in progress),
  as nginx reuses its keep-alive connections: the one open longest of those that never completed
  a request (the idle and slow-header floods), else the one idle longest between keep-alive
  requests (whose client reconnects); when every open connection has a request in progress, the
  new one is answered 503 and closed at once;
- a connection whose request headers are not complete ``header_timeout_s`` after it opened (or
  after its last response) is closed, with a 408 when it had sent part of them;
- headers over ``max_header_bytes`` in all, or more than ``max_headers`` fields, are answered 431
  and the connection closed, before the request reaches the app;
- bytes after a request that cannot be parsed (a Content-Length shorter than the body sent) no
  longer cut off the request in progress with uvicorn's plain-text 400: the request is answered
  by the app (``malformed`` in its scope) and the connection closed after it.

The body's size and deadline are the app's (``http.read_body``). Each connection closed here is
counted in ``scorer_http_connections_closed_total`` by reason.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass, field

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .. import metrics
from .limits import RateLimitedLog, default_max_connections

MALFORMED = "scorer.malformed"
"""Scope key: why the bytes after the request could not be parsed (the app answers 400)."""


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int = field(default_factory=default_max_connections)
    keep_alive_s: float = 5.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 32 * 1024
    max_headers: int = 100


class _Refuse(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


class Edge:
    """What the connections of one server share: the limits, and the idle ones, longest idle
    first: those that never completed a request (``fresh``), and those kept alive after one."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.fresh: OrderedDict[EdgeProtocol, None] = OrderedDict()
        self.kept: OrderedDict[EdgeProtocol, None] = OrderedDict()
        self.refusals = RateLimitedLog()

    def idle(self, conn: EdgeProtocol, served: bool) -> None:
        (self.kept if served else self.fresh)[conn] = None

    def busy(self, conn: EdgeProtocol) -> None:
        self.fresh.pop(conn, None)
        self.kept.pop(conn, None)

    def is_idle(self, conn: EdgeProtocol) -> bool:
        return conn in self.fresh or conn in self.kept

    def to_evict(self) -> EdgeProtocol | None:
        for idle in (self.fresh, self.kept):
            if idle:
                return next(iter(idle))
        return None


def closed(reason: str) -> None:
    metrics.HTTP_CONNECTIONS_CLOSED.labels(reason).inc()


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's protocol within ``edge``'s limits (pass ``functools.partial(EdgeProtocol,
    edge=...)`` as uvicorn's ``http``)."""

    def __init__(self, *args, edge: Edge, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.edge = edge
        self._header_bytes = 0
        self._header_count = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False  # closing, or past bytes that do not parse: nothing more is read
        self._served = False  # a request of this connection's answered

    # -- the cap

    def connection_made(self, transport) -> None:
        limits = self.edge.limits
        if len(self.connections) >= limits.max_connections:
            if (idle := self.edge.to_evict()) is not None:
                idle._close("evicted")
            else:  # every connection has a request in progress
                self.transport = transport
                self._close("over_cap", 503, f"over --max-connections {limits.max_connections}")
                if count := self.edge.refusals.due():
                    self.logger.warning(
                        "HTTP: %d connections refused over --max-connections %d (every open one busy)",
                        count,
                        limits.max_connections,
                    )
                return
        super().connection_made(transport)
        self._waiting()

    def connection_lost(self, exc) -> None:
        self.edge.busy(self)
        self._cancel_timer()
        super().connection_lost(exc)

    # -- between requests: idle, the header deadline and sizes

    def _waiting(self) -> None:
        """No request in progress: idle from now on, the next one's headers due in time."""
        self._header_bytes = self._header_count = 0
        self.edge.idle(self, self._served)
        self._cancel_timer()
        self._header_timer = self.loop.call_later(self.edge.limits.header_timeout_s, self._header_timeout)

    def _busy(self) -> None:
        self.edge.busy(self)
        self._cancel_timer()

    def _cancel_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._header_bytes:
            self._close("header_timeout", 408, "request headers not complete in time")
        else:
            self._close("idle_timeout")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        waiting = self.edge.is_idle(self)
        if waiting:
            self._header_bytes += len(data)
        try:
            super().data_received(data)
        except _Refuse as r:
            self._close(r.reason, r.status, r.message)
            return
        limit = self.edge.limits.max_header_bytes
        if waiting and self.edge.is_idle(self) and self._header_bytes > limit:
            self._close("headers_too_large", 431, f"request headers over {limit} bytes")

    def on_message_begin(self) -> None:
        self._header_count = 0
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.edge.limits.max_headers:
            raise _Refuse(431, "headers_too_large", f"more than {self.edge.limits.max_headers} header fields")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._busy()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        self._served = True
        super().on_response_complete()
        request_in_progress = self.cycle is not None and not self.cycle.response_complete  # pipelined
        if not self.transport.is_closing() and not request_in_progress:
            self._waiting()

    def send_400_response(self, msg: str) -> None:
        """Bytes that do not parse: with a request in progress (the bytes after its body, when its
        Content-Length is shorter than the body), its answer is the app's 400 and the rest of the
        connection is dropped; otherwise uvicorn's plain 400."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            closed("malformed")
            super().send_400_response(msg)
            return
        cycle.scope[MALFORMED] = "bytes after the request's body (a Content-Length shorter than the body?)"
        cycle.keep_alive = False
        self._refused = True
        self.transport.pause_reading()

    # -- closing

    def _close(self, reason: str, status: int | None = None, message: str = "") -> None:
        """Close the connection (counted under ``reason``), answering ``status`` with a JSON error
        first when given (no request of it reached the app)."""
        self._refused = True
        self.edge.busy(self)
        self._cancel_timer()
        closed(reason)
        if status is not None:
            self.transport.write(_error_response(status, message))
        self.transport.close()


PHRASES = {503: "Service Unavailable", 408: "Request Timeout", 431: "Request Header Fields Too Large"}
CODES = {503: "UNAVAILABLE", 408: "DEADLINE_EXCEEDED", 431: "INVALID_ARGUMENT"}


def _error_response(status: int, message: str) -> bytes:
    """An HTTP/1.1 answer with the routes' error body, closing the connection."""
    field = "headers" if status == 431 else ""
    body = json.dumps({"message": message, "field": field, "code": CODES[status], "request_id": ""})
    head = (
        f"HTTP/1.1 {status} {PHRASES[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return (head + body).encode()
