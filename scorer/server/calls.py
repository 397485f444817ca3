"""The call being served: its request id and concrete scheme, visible to logs and metrics.

The interceptor opens a ``Call`` for every RPC in a context variable; the servicer fills in the
scheme once known; a log filter stamps every record with the request id of the call it is about.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field

from .. import metrics
from ..metrics import UNRESOLVED_SCHEME
from .limits import limit_accept_log

NO_REQUEST = "-"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s request_id=%(request_id)s %(message)s"


@dataclass
class Call:
    method: str
    request_id: str
    scheme: str = UNRESOLVED_SCHEME
    started: float = field(default_factory=time.monotonic)


_current: ContextVar[Call | None] = ContextVar("scorer_call", default=None)


def open_call(method: str, request_id: str) -> tuple[Call, object]:
    """Start tracking a call; ``request_id`` "" gets a generated one. Returns the call and a token
    for ``close_call``."""
    call = Call(method, request_id or uuid.uuid4().hex)
    return call, _current.set(call)


def close_call(token: object) -> None:
    _current.reset(token)  # type: ignore[arg-type]


def current_call() -> Call:
    """The call this task serves; a fresh one when no interceptor opened any."""
    call = _current.get()
    if call is None:
        call, _ = open_call("", "")
    return call


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` to every record: the current call's, else "-" (or one the record has)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            call = _current.get()
            record.request_id = call.request_id if call else NO_REQUEST
        return True


def configure_logging(level: str, prefix: str = "") -> None:
    """The servers' log lines, each with its call's request id; ``prefix``: what starts each line
    (a front-end process's name)."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(prefix + LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    limit_accept_log()  # out of descriptors, asyncio logs each failed accept: one line per 10 s instead


class Inflight:
    """Counts the calls being served, so a shutdown can wait for the last one."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()
        metrics.INFLIGHT.set(self.count)

    def leave(self) -> None:
        self.count -= 1
        metrics.INFLIGHT.set(self.count)
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()
