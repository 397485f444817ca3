"""The server's event loops, optionally busy-polling (``--busy-poll-ms``).

A process whose loop sleeps in ``epoll_wait`` pays a wake-up for each message that arrives while it
sleeps: on the GPU host (a VM whose idle CPUs halt) a few hundred microseconds each, and a served
call at light load crosses two such sleeps on the front-end link (the engine process's loop for the
call, the front end's for its scores). With ``busy_poll_s`` the loop polls its selector without
sleeping for that long after the last I/O it saw, so a call or a reply arriving within it is read
at once; past it the loop sleeps as usual. The cost is the polling core, in every process of the
server, while calls keep coming. The poll gives up the GIL at every look (``epoll_wait`` with a
zero timeout releases it), so worker threads that hold it are slowed by a forced switch every
``sys.getswitchinterval()`` at most.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BusyPollSelector(selectors.DefaultSelector):
    """``select`` polls without sleeping for ``spin_s`` after the last I/O it returned (a timer due
    sooner ends the poll at the timer, as a sleep would), then sleeps as usual."""

    def __init__(self, spin_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.spin_s, self._clock = spin_s, clock
        self._last_io = -float("inf")

    def _look(self, timeout: float | None):
        """The plain selector's select: a poll with 0, a sleep otherwise."""
        return super().select(timeout)

    def select(self, timeout: float | None = None):
        now = self._clock()
        spin_until = self._last_io + self.spin_s
        if (timeout is None or timeout > 0) and now < spin_until:
            deadline = None if timeout is None else now + timeout
            end = spin_until if deadline is None else min(spin_until, deadline)
            while True:
                ready = self._look(0)
                now = self._clock()
                if ready:
                    self._last_io = now
                    return ready
                if now >= end:
                    break
            if deadline is not None and now >= deadline:
                return []  # the timer the loop would have slept until is due
            timeout = None if deadline is None else deadline - now
        ready = self._look(timeout)
        if ready:
            self._last_io = self._clock()
        return ready


def run(main: Coroutine[Any, Any, T], busy_poll_s: float = 0.0) -> T:
    """``asyncio.run(main)``, on a busy-polling loop when ``busy_poll_s`` > 0."""
    if busy_poll_s <= 0:
        return asyncio.run(main)
    factory = lambda: asyncio.SelectorEventLoop(BusyPollSelector(busy_poll_s))  # noqa: E731
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
