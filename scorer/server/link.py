"""The link between a front-end process and the engine process: ``FrontLink`` is a front end's
end (one future per call), ``EngineLink`` the engine's (a Unix socket the front ends connect to,
each Job scored through the one ``ScoringService``).

The link is length-prefixed pickles over a Unix stream socket, read in asyncio protocols
(``_Frames``): a message wakes only the receiving process's event loop. ZeroMQ, which this used
first, passes each message through an I/O thread on either side, three wake-ups a way: its round
trip was 0.22-1.05 ms against this one's 0.05-0.31 (2-core VM, 0-20 ms between calls;
bench/RESULTS.md, What did not pay), and on the H200 machine it added 1.1-1.9 ms to a call on an idle server
(``bench.light_load``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import struct
from collections.abc import Callable
from dataclasses import replace

from ..engine import Engine, EngineInfo
from ..request import Doc, Job
from .batcher import Closed, Scored
from .scoring import ScoringService

log = logging.getLogger(__name__)
PICKLE = pickle.HIGHEST_PROTOCOL
HEADER = struct.Struct("!I")  # the length of the pickled (kind, value) that follows


class _Frames(asyncio.Protocol):
    """One end of a link: each message is ``(kind, value)`` pickled behind its length; ``on``
    gets each one as it arrives, ``gone`` the end of the connection."""

    def __init__(self, on: Callable[[_Frames, str, object], None], gone: Callable[[_Frames], None]) -> None:
        self.on, self.gone = on, gone
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buf)
            if len(self.buf) < HEADER.size + n:
                return
            kind, value = pickle.loads(memoryview(self.buf)[HEADER.size : HEADER.size + n])
            del self.buf[: HEADER.size + n]
            try:
                self.on(self, kind, value)
            except Exception:
                log.exception("bad message %r", kind)

    def connection_lost(self, exc) -> None:
        self.transport = None
        self.gone(self)

    def send(self, kind: str, value) -> None:
        """Queue a message (never blocks; dropped once the connection is gone)."""
        if self.transport is not None:
            body = pickle.dumps((kind, value), PICKLE)
            self.transport.write(HEADER.pack(len(body)) + body)


class EngineLink:
    """The engine process's end: a Unix socket the front ends connect to, each saying first which
    one it is (``hello``; a restarted one's connection replaces its predecessor's). Jobs that
    arrive are scored through ``service`` and their results (or exceptions) sent back.

    ``frontends`` front ends are expected (their identities ``frontend-<i>``: the engine serves
    once all are ready, and ``lost`` is set when one of them goes). Others may join and leave at
    any time (the Ray replicas of ``engine_process=shared``): each gets the engine's state as it
    joins, and one that leaves has its calls cancelled."""

    def __init__(self, path: str, frontends: int) -> None:
        self.path = path
        self.identities = [frontend_identity(i) for i in range(frontends)]
        self.up: dict[str, asyncio.Future[str | None]] = {}
        self.ready: set[str] = set()
        self.all_ready = asyncio.Event()
        self.service: ScoringService | None = None
        self.info: EngineInfo | None = None
        self.state = "loading"  # then "serving", "draining", "stop"
        self.grace_s = 0.0
        self._calls: dict[tuple[str, int], asyncio.Task] = {}
        self._ends: dict[str, _Frames] = {}  # each front end's connection
        self._names: dict[_Frames, str] = {}
        self._server: asyncio.AbstractServer | None = None
        self.lost = asyncio.Event()  # a front end's connection closed (its process is gone or done)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.up = {ident: loop.create_future() for ident in self.identities}
        self._server = await loop.create_unix_server(lambda: _Frames(self._on, self._gone), self.path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._calls.values()):
            task.cancel()
        for end in list(self._ends.values()):
            if end.transport is not None:
                end.transport.close()

    def serve(self, service: ScoringService) -> None:
        """The model is warm: every front end gets its EngineInfo (and acknowledges it)."""
        self.service, self.info = service, service.info
        for ident in self._everyone():
            self._send(ident, "ready", self.info)

    def set_state(self, state: str, grace_s: float = 0.0) -> None:
        """``serving``, ``draining`` or ``stop`` (finish the calls in flight within ``grace_s``)."""
        self.state, self.grace_s = state, grace_s
        for ident in self._everyone():
            self._send(ident, "state", (state, grace_s))

    def _everyone(self) -> list[str]:
        """The expected front ends and those that joined (a shared engine's)."""
        return list(dict.fromkeys([*self.identities, *self._ends]))

    def restarted(self, ident: str) -> None:
        """The front end ``ident`` died and is started again. Its calls' clients are gone with it:
        they are cancelled (a queued one leaves the queue unscored), and no result of theirs may
        reach the new process, whose call ids start from 0 again."""
        self.ready.discard(ident)
        for (owner, _), task in list(self._calls.items()):
            if owner == ident:
                task.cancel()

    def _send(self, ident: str, kind: str, value) -> None:
        end = self._ends.get(ident)
        if end is not None:
            end.send(kind, value)

    def _gone(self, end: _Frames) -> None:
        ident = self._names.pop(end, None)
        if ident is not None and self._ends.get(ident) is end:
            del self._ends[ident]
            if ident in self.identities:
                self.lost.set()
            else:  # one that joined (a shared engine's): nobody waits for its calls
                self.restarted(ident)

    def _on(self, end: _Frames, kind: str, value) -> None:
        if kind == "hello":  # a front end starting: it listens once it can score, if it can
            self._names[end], self._ends[value] = value, end
            if self.info is not None:  # a restarted one: the engine is loaded already
                end.send("ready", self.info)
            else:
                end.send("state", ("loading", 0.0))
            return
        ident = self._names.get(end)
        if ident is None or self._ends.get(ident) is not end:
            return  # a connection that said no hello, or a dead front end's last words
        if kind == "score":
            call_id, job, deadline, request_id = value
            task = asyncio.create_task(self._score(ident, call_id, job, deadline, request_id))
            self._calls[ident, call_id] = task
            task.add_done_callback(lambda t: self._forget((ident, call_id), t))
        elif kind == "cancel":
            task = self._calls.get((ident, value))
            if task is not None:
                task.cancel()
        elif kind == "up":  # the front end listens (None) or could not (why)
            future = self.up.get(ident)
            if future is not None and not future.done():
                future.set_result(value)
            elif value is not None:  # a restarted one
                log.error("front end %s cannot listen: %s", ident, value)
        elif kind == "ready":  # it tokenizes as the engine does now
            self.ready.add(ident)
            if self.ready.issuperset(self.identities):
                self.all_ready.set()
            if self.state != "loading":
                end.send("state", (self.state, self.grace_s))

    def _forget(self, key: tuple[str, int], task: asyncio.Task) -> None:
        if self._calls.get(key) is task:  # not a later call of a restarted front end's, same id
            del self._calls[key]

    async def _score(self, ident: str, call_id: int, job: Job, deadline, request_id: str) -> None:
        service = self.service
        try:
            if service is None:
                raise RuntimeError("a call reached the engine before it was ready")
            engine: Engine = service.engine
            scored = await service.score(engine.peeked(job) if engine.cache else job, deadline, request_id)
            reply = (call_id, True, scored)
        except asyncio.CancelledError:
            return  # its front end cancelled it and waits for nothing
        except Exception as exc:
            reply = (call_id, False, _portable(exc))
        self._send(ident, "done", reply)


def _portable(exc: Exception) -> Exception:
    """``exc`` if it survives pickling, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc, PICKLE))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def frontend_identity(index: int) -> str:
    return f"frontend-{index}"


class FrontLink:
    """A front end's end: a connection to the engine process's socket, one future per call;
    ``identity`` says which front end it is (``frontend-<i>``, or any other name on a shared
    engine)."""

    def __init__(self, identity: str) -> None:
        self.identity = identity
        self.states: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._end: _Frames | None = None
        self.gone = False  # the engine process closed the connection: nothing will answer

    async def connect(self, path: str) -> None:
        """Connect and say which front end this is."""
        _, self._end = await asyncio.get_running_loop().create_unix_connection(
            lambda: _Frames(self._on, self._gone), path
        )
        self.send("hello", self.identity)

    def send(self, kind: str, value) -> None:
        self._end.send(kind, value)

    async def score(self, job: Job, deadline: float | None, request_id: str) -> Scored:
        if self.gone:
            raise Closed("the engine process is gone")
        call_id = next(self._ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            self.send("score", (call_id, for_engine(job), deadline, request_id))
            return await future
        except asyncio.CancelledError:
            self.send("cancel", call_id)
            raise
        finally:
            self._calls.pop(call_id, None)

    def _on(self, end: _Frames, kind: str, value) -> None:
        if kind == "done":
            call_id, ok, result = value
            future = self._calls.get(call_id)
            if future is not None and not future.done():
                (future.set_result if ok else future.set_exception)(result)
        else:
            self.states.put_nowait((kind, value))

    def _gone(self, end: _Frames) -> None:
        self.gone = True
        for future in self._calls.values():  # the engine process is gone: nothing will answer
            if not future.done():
                future.set_exception(Closed("the engine process is gone"))

    async def close(self) -> None:
        if self._end is not None and self._end.transport is not None:
            self._end.transport.close()


def for_engine(job: Job) -> Job:
    """``job`` as the engine process reads it: the docs' text and token ids stay in the front end,
    which answers from its own Job (the engine needs their ids, the tokens in ``items`` and the
    options); the link then pickles each call's tokens once instead of twice, the prompt's as
    one bytes object (``TokenIds``: an 8,000-id prompt's Job pickled and read back in 0.12-0.18 ms
    on a 2-core VM, where its tuple of ints took 0.31-0.42)."""
    r = job.request
    return replace(job, request=replace(r, docs=tuple(Doc(id=d.id) for d in r.docs), prompt_token_ids=()))
