"""Limits of the network edge that need nothing of the HTTP stack: how many connections a process
keeps open (``--max-connections``, its default from the file-descriptor limit), the gRPC server's
connection options (the same cap, a handshake deadline, idle and age limits, keepalive pings), and
a bounded log of the accept loop's failures.

Every open connection holds a file descriptor; one process that runs out can accept nothing more,
and asyncio's accept loop then logs ``socket.accept() out of system resource`` at every retry (a
server under ``ulimit -n 300`` with 400 idle connections wrote 92 MB of it in 24 s). The cap keeps
the HTTP and the gRPC listener each under a quarter of what the limit leaves (a listener accepts
up to the cap more in one burst before it can close any: HTTP's accept backlog is the cap), and
``AcceptLogLimit`` keeps whatever failures remain to one line per interval with a count.
``http_edge.py`` enforces the HTTP side (cap, header and body deadlines, header sizes);
docs/limits.md lists every limit and what a client sees.
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections.abc import Callable

RESERVED_FDS = 128
"""File descriptors kept for the process itself: the model's files, the front-end link, the
metrics server, the tokenizer's and torch's own."""
MOST_CONNECTIONS = 10_000
"""The default cap's ceiling, however high the descriptor limit."""
FEWEST_CONNECTIONS = 8


def default_max_connections(nofile: int | None = None) -> int:
    """Connections per listener (HTTP, gRPC) of one process: a quarter of what the soft
    RLIMIT_NOFILE leaves after ``RESERVED_FDS`` (each listener's open connections and one burst
    of accepts), within ``FEWEST_CONNECTIONS``..``MOST_CONNECTIONS``."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if nofile == resource.RLIM_INFINITY:
        return MOST_CONNECTIONS
    return max(FEWEST_CONNECTIONS, min(MOST_CONNECTIONS, (nofile - RESERVED_FDS) // 4))


def grpc_options(
    max_connections: int,
    handshake_timeout_s: float,
    idle_s: float,
    max_age_s: float,
    age_grace_s: float,
    keepalive_s: float,
) -> list[tuple[str, int]]:
    """grpc.aio server options for the connection limits (grpc core's channel arguments): at most
    ``max_connections`` open (more are closed as they are accepted), a connection that has not
    finished its HTTP/2 handshake within ``handshake_timeout_s`` closed, one without a call for
    ``idle_s`` sent GOAWAY, one older than ``max_age_s`` (0: no limit) sent GOAWAY with
    ``age_grace_s`` for its calls to finish, and a ping every ``keepalive_s`` (20 s to answer) so
    that a peer gone without a FIN is found."""
    options = [
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", _ms(handshake_timeout_s)),
        ("grpc.max_connection_idle_ms", _ms(idle_s)),
        ("grpc.keepalive_time_ms", _ms(keepalive_s)),
        ("grpc.keepalive_timeout_ms", 20_000),
    ]
    if max_age_s > 0:
        options += [
            ("grpc.max_connection_age_ms", _ms(max_age_s)),
            ("grpc.max_connection_age_grace_ms", _ms(age_grace_s)),
        ]
    return options


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1e3))


ACCEPT_FAILED = "socket.accept() out of system resource"
"""How asyncio's accept loop starts the record it logs at each failed accept (EMFILE, ENFILE,
ENOBUFS, ENOMEM)."""


class RateLimitedLog:
    """At most one line per ``interval_s`` about a recurring event; the next line says how many
    happened since the last one. ``clock`` is injectable for tests."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self._last = -float("inf")
        self._count = 0
        self._lock = threading.Lock()

    def due(self) -> int:
        """0 while the event is to stay quiet; else the number of events (this one included) the
        line about it reports."""
        with self._lock:
            self._count += 1
            now = self.clock()
            if now - self._last < self.interval_s:
                return 0
            self._last, count, self._count = now, self._count, 0
            return count


class AcceptLogLimit(logging.Filter):
    """A filter on the ``asyncio`` logger: its accept-failure records pass at most once per
    interval, rewritten to one line (no traceback) with the count since the last one; every
    other record passes as it is."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.limit = RateLimitedLog(interval_s, clock)

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(ACCEPT_FAILED):
            return True
        count = self.limit.due()
        if not count:
            return False
        error = record.exc_info[1] if record.exc_info else None
        record.msg = (
            "%s (%s): %d failed accepts in the last %.0f s; raise the file-descriptor limit"
            " or lower --max-connections"
        )
        record.args = (ACCEPT_FAILED, error, count, self.limit.interval_s)
        record.exc_info = record.exc_text = None
        return True


def limit_accept_log(interval_s: float = 10.0) -> AcceptLogLimit:
    """Install ``AcceptLogLimit`` on the ``asyncio`` logger (once: a later call returns the filter
    installed first)."""
    logger = logging.getLogger("asyncio")
    for existing in logger.filters:
        if isinstance(existing, AcceptLogLimit):
            return existing
    limit = AcceptLogLimit(interval_s)
    logger.addFilter(limit)
    return limit
