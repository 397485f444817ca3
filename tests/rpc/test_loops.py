"""``--busy-poll-ms``: the event loop polls without sleeping for a while after its last I/O
(scorer/server/loops.py). The selector runs on a driven clock: each poll takes a millisecond, a
sleep takes its whole timeout (or until a scripted event), so what it does is decided by its own
calls, not by the host's timing."""

from __future__ import annotations

import asyncio

from scorer.server import loops

POLL_S = 0.001


class ScriptedSelector(loops.BusyPollSelector):
    """Records each look as ("poll",) or ("sleep", timeout); ``events`` are times at which I/O
    becomes ready."""

    def __init__(self, spin_s: float, events=()) -> None:
        self.now = 100.0
        super().__init__(spin_s, clock=lambda: self.now)
        self.events = sorted(events)
        self.looks: list[tuple] = []

    def _look(self, timeout):
        if timeout == 0:
            self.looks.append(("poll",))
            self.now += POLL_S
        else:
            self.looks.append(("sleep", timeout))
            wake = self.now + timeout if timeout is not None else float("inf")
            self.now = min([wake, *self.events[:1]])
        if self.events and self.events[0] <= self.now:
            self.events.pop(0)
            return ["ready"]
        return []


def test_before_any_io_a_select_sleeps_once_as_the_plain_selector_would():
    selector = ScriptedSelector(spin_s=0.3)
    assert selector.select(0.1) == []
    assert selector.looks == [("sleep", 0.1)]
    selector.close()


def test_after_io_the_selector_polls_until_a_due_timer_and_sleeps_once_the_spin_is_over():
    selector = ScriptedSelector(spin_s=0.3, events=[100.0])
    assert selector.select(1.0) == ["ready"]  # the I/O that starts the spin
    selector.looks.clear()
    assert selector.select(0.1) == []  # within the spin: polls until the timer is due, no sleep
    assert set(selector.looks) == {("poll",)} and 95 <= len(selector.looks) <= 101
    selector.now += 0.3  # the spin is over
    selector.looks.clear()
    assert selector.select(0.1) == [] and selector.looks == [("sleep", 0.1)]
    selector.close()


def test_io_arriving_during_the_spin_is_read_at_once_and_restarts_the_spin():
    selector = ScriptedSelector(spin_s=0.05, events=[100.0, 100.02, 100.09])
    assert selector.select(None) == ["ready"]
    selector.looks.clear()
    assert selector.select(None) == ["ready"]  # the write 20 ms in: found by a poll
    assert set(selector.looks) == {("poll",)} and abs(selector.now - 100.02) < 2 * POLL_S
    selector.looks.clear()
    # the next write is 70 ms later: polls 50 ms from the last I/O, then sleeps until the write
    assert selector.select(None) == ["ready"]
    assert selector.looks[-1] == ("sleep", None) and set(selector.looks[:-1]) == {("poll",)}
    assert 45 <= len(selector.looks) - 1 <= 51
    selector.close()


def test_a_zero_timeout_only_looks_even_within_the_spin():
    selector = ScriptedSelector(spin_s=0.3, events=[100.0])
    selector.select(None)
    selector.looks.clear()
    assert selector.select(0) == [] and selector.looks == [("poll",)]
    selector.close()


def test_run_uses_a_busy_polling_loop_only_when_asked():
    async def selector_type():
        return type(asyncio.get_running_loop()._selector)

    assert loops.run(selector_type(), 0.005) is loops.BusyPollSelector
    assert loops.run(selector_type(), 0.0) is not loops.BusyPollSelector
