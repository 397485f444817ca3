"""``--busy-poll-ms``: the event loop polls without sleeping for a while after its last I/O
(scorer/server/loops.py). Polling shows as the thread's CPU time; a sleep takes none."""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading
import time

import pytest

from scorer.server import loops


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    yield a, b
    a.close()
    b.close()


def timed_select(selector, timeout):
    """(ready, wall seconds, this thread's CPU seconds) of one select."""
    wall, cpu = time.monotonic(), time.thread_time()
    ready = selector.select(timeout)
    return ready, time.monotonic() - wall, time.thread_time() - cpu


def write_later(sock: socket.socket, delay: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay), sock.send(b"x")))
    thread.start()
    return thread


def test_after_io_the_selector_polls_until_a_due_timer_and_sleeps_once_the_spin_is_over(pair):
    a, b = pair
    selector = loops.BusyPollSelector(spin_s=0.3)
    selector.register(a, selectors.EVENT_READ)
    ready, _, cpu = timed_select(selector, 0.1)  # no I/O seen yet: a plain sleep
    assert ready == [] and cpu < 0.03
    b.send(b"x")
    assert len(selector.select(1.0)) == 1
    a.recv(1)
    ready, wall, cpu = timed_select(selector, 0.1)  # within the spin: polls until the timer is due
    assert ready == [] and 0.09 <= wall < 0.25 and cpu > 0.5 * wall
    time.sleep(0.3)  # the spin is over
    ready, wall, cpu = timed_select(selector, 0.1)
    assert ready == [] and wall >= 0.09 and cpu < 0.03
    selector.close()


def test_io_arriving_during_the_spin_is_read_and_the_spin_then_gives_way_to_a_sleep(pair):
    a, b = pair
    selector = loops.BusyPollSelector(spin_s=0.05)
    selector.register(a, selectors.EVENT_READ)
    b.send(b"x")
    selector.select(None)
    a.recv(1)
    writer = write_later(b, 0.02)  # within the spin
    ready, wall, cpu = timed_select(selector, None)
    writer.join()
    assert len(ready) == 1 and wall < 0.045 and cpu > 0.5 * wall
    a.recv(1)
    writer = write_later(b, 0.3)  # after it: polls 50 ms, then sleeps until the write
    ready, wall, cpu = timed_select(selector, None)
    writer.join()
    assert len(ready) == 1 and wall >= 0.28 and cpu < 0.2
    assert selector.select(0) == ready  # a zero timeout only looks
    selector.close()


def test_run_uses_a_busy_polling_loop_only_when_asked():
    async def selector_type():
        return type(asyncio.get_running_loop()._selector)

    assert loops.run(selector_type(), 0.005) is loops.BusyPollSelector
    assert loops.run(selector_type(), 0.0) is not loops.BusyPollSelector
