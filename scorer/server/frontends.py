"""``scorer serve --frontends N``: the front ends in N processes of their own, the engine in this one.

Every front-end process listens on the gRPC port (and the HTTP port) beside the others
(SO_REUSEPORT: the kernel spreads the connections over them); it parses, validates and tokenizes
its calls, sends each call's Job to the engine process over a Unix socket and answers the call
when the Job's result comes back. The engine process batches the Jobs of every front end together, runs
them and sends each one's ``Scored`` back. So parsing, tokenizing and answering run on other
cores than the thread that plans and launches batches, and scale with N (SGLang's
TokenizerManager and Scheduler, vLLM's API server and EngineCore, split the same way).

The engine process drives the lifecycle. It loads its model while the front ends start (their
imports take about as long). Front ends start with health NOT_SERVING and calls
answered UNAVAILABLE; once the model is warm each one takes the engine's ``EngineInfo`` and
tokenizes as the engine would, and when all have it, health turns SERVING everywhere. On SIGTERM
health turns NOT_SERVING, calls are still served for ``--drain-seconds``, then the front ends stop
taking calls, finish theirs (up to ``--grace-seconds``) and exit, and the engine process exits
last. A front end that dies is started again, and listens once it can score; its calls in
flight fail with UNAVAILABLE on the client's side (the connection drops) and its queued ones are
dropped unscored. A call's deadline travels with its Job (``time.monotonic``
is one clock for every process of a host), and a call cancelled in its front end (deadline,
client gone) is cancelled in the engine process too: a queued one leaves the queue unscored.

The link is length-prefixed pickles over a Unix stream socket, read in asyncio protocols
(``_Frames``): a message wakes only the receiving process's event loop. ZeroMQ, which this used
first, passes each message through an I/O thread on either side, three wake-ups a way: its round
trip was 0.22-1.05 ms against this one's 0.05-0.31 (2-core VM, 0-20 ms between calls,
``bench.link_rtt``), and on the H200 machine it added 1.1-1.9 ms to a call on an idle server
(``bench.light_load``).

Metrics: the front ends write theirs into prometheus-client's multiprocess directory; the engine
process's /metrics serves them and its own as one set (``metrics.serve_http``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from grpc_health.v1.health import aio as health_aio

from .. import metrics
from ..engine import Engine, EngineInfo, Tokenizing
from ..models.loader import load_tokenizer
from ..planning.schemes import import_plugins, plugin_modules
from ..request import Doc, Job
from ..settings import Settings
from . import loops
from .batcher import Closed, Scored
from .handler import CallHandler
from .scoring import ScoringService, TokenizingService, freeze_heap

log = logging.getLogger(__name__)
PICKLE = pickle.HIGHEST_PROTOCOL
HEADER = struct.Struct("!I")  # the length of the pickled (kind, value) that follows
START_TIMEOUT_S = 120.0
"""How long front-end processes may take to start and bind their ports."""
ENGINE_START_TIMEOUT_S = 1800.0
"""How long a replica's engine process may take to load its model and capture its graphs."""
PARENT_POLL_S = 1.0
RESTART_BACKOFF_S = 10.0
"""A front end that dies within this long of its start waits before its next start, longer each
time in a row (0.5 s doubling, up to this), so one that cannot start does not spin."""


def on_gpu(device: str | None) -> bool:
    """Does ``--device`` (None: cuda when available) put the model on a GPU?"""
    return (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")


def frontend_count(value: str, device: str | None) -> int:
    """``--frontends``: a number, or ``auto``: none on the CPU (the model, not the host, is the
    limit there), else one per two cores beyond two, at most four."""
    if value != "auto":
        return int(value)
    return max(0, min(4, (len(os.sched_getaffinity(0)) - 2) // 2)) if on_gpu(device) else 0


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


# -- the engine process's side ------------------------------------------------------------------


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


class Frontends:
    """The front-end processes: started, watched (one that dies is started again), stopped."""

    def __init__(self, settings: Settings, address: str, link: EngineLink, n: int) -> None:
        self.settings, self.address, self.link = settings, address, link
        self.ctx = multiprocessing.get_context("spawn")
        self.procs = [self._spawn(i) for i in range(n)]
        self.stopping = False
        self._watch = asyncio.create_task(self._watch_loop())

    def _spawn(self, index: int) -> multiprocessing.Process:
        proc = self.ctx.Process(
            target=frontend_main,
            args=(self.settings, self.address, index, os.getpid(), plugin_modules()),
            name=f"frontend-{index}",
            daemon=True,
        )
        proc.start()
        return proc

    async def wait_up(self) -> None:
        """Until every front end listens; CannotListen naming the first that could not."""
        from .app import CannotListen

        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                for future in self.link.up.values():
                    if (why := await asyncio.shield(future)) is not None:
                        raise CannotListen(why)
        except TimeoutError:
            raise RuntimeError(f"front ends not listening after {START_TIMEOUT_S:.0f} s") from None

    async def _watch_loop(self) -> None:
        started = [time.monotonic()] * len(self.procs)
        quick_deaths = [0] * len(self.procs)  # in a row, each within RESTART_BACKOFF_S of its start
        while True:
            await asyncio.sleep(0.2)
            for i, proc in enumerate(self.procs):
                if proc.is_alive() or self.stopping:
                    continue
                now = time.monotonic()
                quick_deaths[i] = quick_deaths[i] + 1 if now - started[i] < RESTART_BACKOFF_S else 0
                wait = min(RESTART_BACKOFF_S, 0.5 * 2 ** quick_deaths[i]) if quick_deaths[i] else 0.0
                log.error(
                    "front end %d (pid %d) exited with %s; starting it again%s",
                    i,
                    proc.pid,
                    proc.exitcode,
                    f" in {wait:.1f} s" if wait else "",
                )
                metrics.FRONTEND_RESTARTS.inc()
                _mark_dead(proc.pid)
                proc.join()
                self.link.restarted(frontend_identity(i))
                await asyncio.sleep(wait)
                if self.stopping:
                    return
                self.procs[i], started[i] = self._spawn(i), time.monotonic()

    async def stop(self, grace_s: float) -> None:
        """The front ends finish their calls (they were told to stop) and exit; killed past the grace."""
        self.stopping = True
        self._watch.cancel()
        deadline = time.monotonic() + grace_s + 5.0
        while any(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for proc in self.procs:
            if proc.is_alive():
                log.warning("front end pid %d still running; killing it", proc.pid)
                proc.kill()
            proc.join()


def _mark_dead(pid: int | None) -> None:
    if pid is not None and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT and not listening: the front ends bind the
    same port beside it (0: the free port it got). Raises OSError when another process holds it,
    with SO_REUSEPORT too: a second ``scorer serve --frontends`` on the port would otherwise bind
    beside the first one's front ends and take half of its connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:  # SO_REUSEADDR: past TIME_WAIT only
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    # and SO_REUSEADDR: past the TIME_WAIT connections of a server that just served on the port
    # without SO_REUSEPORT (one process), which SO_REUSEPORT alone does not bind beside
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def serve_split(args: Settings, signals, n: int) -> int:
    """``scorer serve`` with ``n`` front-end processes (see the module's doc)."""
    from .app import CannotListen, _drain, _metrics_http, _serving, _start_service, loading_engine, log_http

    mp_dir = tempfile.mkdtemp(prefix="scorer-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = mp_dir  # the front ends', spawned after this
    reserved: list[socket.socket] = []
    metrics_http = link = fronts = service = loading = None
    try:
        metrics_http = _metrics_http(args, mp_dir)
        ports = {}
        names = {"port": "gRPC port", "http_port": "HTTP port"}  # as the single-process server says
        for name in ("port", "http_port") if args.http_port else ("port",):
            try:
                reserved.append(reserve_port(args.host, getattr(args, name)))
            except OSError as e:
                raise CannotListen(f"{names[name]} {args.host}:{getattr(args, name)}: {e.strerror}") from None
            ports[name] = reserved[-1].getsockname()[1]
        args = replace(args, **ports)
        address = os.path.join(mp_dir, "engine.sock")
        link = EngineLink(address, n)
        await link.start()
        loading = loading_engine(args)  # while the front ends start: their imports take as long as the load
        fronts = Frontends(args, address, link, n)
        await fronts.wait_up()
        for sock in reserved:
            sock.close()
        log.info(
            "listening on %s:%d (%s) in %d front-end processes; metrics on port %s",
            args.host,
            args.port,
            "TLS" if args.tls_cert else "plaintext",
            n,
            args.metrics_port or "off",
        )
        if args.http_port:
            log_http(args, args.http_port)
        service = await _start_service(args, signals, loading)
        if service is not None:
            link.serve(service)
            await link.all_ready.wait()
            link.set_state("serving")
            await _serving(service, signals)
        link.set_state("draining")
        await _drain(args, signals)
        link.set_state("stop", args.grace_seconds)
        await fronts.stop(args.grace_seconds)
    finally:
        for sock in reserved:
            sock.close()
        if loading is not None and not loading.done():
            loading.cancel()  # a front end could not start: the load's thread runs out, its result unread
        if fronts is not None:
            await fronts.stop(0)
        if service is not None:
            await service.close()
        if link is not None:
            await link.close()
        if metrics_http is not None:
            metrics_http.shutdown()
        shutil.rmtree(mp_dir, ignore_errors=True)
    log.info("stopped")
    return 0


# -- a front-end process ------------------------------------------------------------------------


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
    options); the link then pickles each call's tokens once instead of twice."""
    r = job.request
    return replace(job, request=replace(r, docs=tuple(Doc(id=d.id) for d in r.docs), prompt_token_ids=()))


class RemoteScoring(TokenizingService):
    """Tokenize here, score in the engine process."""

    def __init__(self, engine: Tokenizing, link: FrontLink, knobs=None) -> None:
        super().__init__(engine, knobs)
        self.link = link

    async def score(self, job: Job, deadline: float | None, request_id: str) -> Scored:
        return await self.link.score(job, deadline, request_id)


def frontend_main(settings: Settings, address: str, index: int, parent: int, plugins=()) -> None:
    """A front-end process (``multiprocessing``'s target): the engine process's signals drive it;
    ``plugins``: the engine process's scheme modules (``plugin_modules``)."""
    from .app import configure_logging

    import_plugins(plugins)
    torch.set_num_threads(1)  # tokenizing needs none of torch's threads; they would only contend
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the engine decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(settings.log_level, f"frontend-{index} ")
    loops.run(_frontend(settings, address, index, parent), settings.busy_poll_ms / 1e3)


async def _frontend(args: Settings, address: str, index: int, parent: int) -> None:
    from .app import NOT_SERVING, SERVING, _set_health, _start_http, _stop_accepting, grpc_server
    from .servicer import ScorerServicer

    link = FrontLink(frontend_identity(index))
    await link.connect(address)
    handler = CallHandler.from_settings(args)
    health = health_aio.HealthServicer()
    await _set_health(health, NOT_SERVING)  # grpc's servicer starts SERVING; the engine says when
    serving = asyncio.Event()
    server = http = None

    def take(info: EngineInfo) -> None:  # tokenize as the engine does, from now on
        tokenizing = Tokenizing(load_tokenizer(info.model_dir), info)
        handler.service = RemoteScoring(tokenizing, link, args.knobs())
        freeze_heap("frontend")
        link.send("ready", None)

    try:
        # a front end started again while the engine serves takes the engine's info before it
        # listens: the kernel sends it connections from its first moment on
        kind, value = await link.states.get()
        if kind == "ready":
            take(value)
        try:
            server, _ = grpc_server(args, ScorerServicer(handler), health, reuse_port=True)
            await server.start()
            http = await _start_http(args, handler, serving.is_set, reuse_port=True, quiet=True)
        except Exception as e:
            link.send("up", f"gRPC port {args.host}:{args.port}: {e}" if server is None else str(e))
            await asyncio.sleep(0.1)  # let the message leave
            return
        link.send("up", None)
        orphaned = asyncio.create_task(_parent_gone(parent))
        grace_s = 0.0
        while True:
            states = asyncio.ensure_future(link.states.get())
            await asyncio.wait({states, orphaned}, return_when=asyncio.FIRST_COMPLETED)
            if orphaned.done():
                states.cancel()
                log.error("the engine process is gone; stopping")
                break
            kind, value = states.result()
            if kind == "ready":
                take(value)
            elif kind == "state":
                state, grace_s = value
                if state == "serving":
                    serving.set()
                    await _set_health(health, SERVING)
                elif state == "draining":
                    serving.clear()
                    await health.enter_graceful_shutdown()
                elif state == "stop":
                    break
        orphaned.cancel()
        await _stop_accepting(server, http, handler.inflight, grace_s)
    finally:
        if server is not None:
            await server.stop(0)
        if http is not None:
            await http.stop()
        if handler.service is not None:
            await handler.service.close()
        await link.close()


async def _parent_gone(parent: int) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_POLL_S)


# -- an engine process of its own, for one front end (a Ray replica) ---------------------------


class EngineProcess:
    """The engine in a child process of this one, which stays its one front end: a Ray replica
    takes Ray's calls and tokenizes in its own process, while the model, the batcher and the
    device work hold the child's interpreter lock (what ``--frontends`` does for ``scorer
    serve``). The child's metrics go to ``dir`` (prometheus-client's multiprocess mode), which the
    replica's /metrics serves with its own. The child exits when this process's connection to it
    closes, so a replica killed outright takes its engine (and its GPU memory) with it.

    Other processes of the host may join the engine at ``path`` as front ends of their own
    (``attach``): the Ray replicas of ``engine_process=shared``, whose engine is the child of an
    Engine replica."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.dir = tempfile.mkdtemp(prefix="scorer-engine-")
        self.path = os.path.join(self.dir, "engine.sock")
        self.link = FrontLink(frontend_identity(0))
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.dir  # the child's, from its first import on
        try:
            self.proc = multiprocessing.get_context("spawn").Process(
                target=engine_main,
                args=(settings, self.path, plugin_modules()),
                name="scorer-engine",
                daemon=True,
            )
            self.spawned = time.monotonic()
            self.proc.start()
        finally:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]  # this process's metrics stay its own

    def alive(self) -> bool:
        return self.proc.is_alive() and not self.link.gone

    async def start(self) -> RemoteScoring:
        """Once the child's engine is warm: the service that scores through it."""
        give_up = time.monotonic() + ENGINE_START_TIMEOUT_S
        while True:
            self._check(give_up)
            try:
                await self.link.connect(self.path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(0.05)
        listening = time.monotonic()
        service = await attach(self.link, self.settings, lambda: self._check(give_up))
        now = time.monotonic()
        log.info(  # where a replica's start goes: the child's interpreter and imports, then the engine
            "engine process %d ready %.1f s after it was started: %.1f s to its first line (interpreter,"
            " imports), %.1f s to a warm engine (model, graphs, warm-up)",
            self.proc.pid,
            now - self.spawned,
            listening - self.spawned,
            now - listening,
        )
        return service

    def _check(self, give_up: float) -> None:
        if not self.proc.is_alive():
            raise RuntimeError(f"the engine process exited with {self.proc.exitcode} before it was ready")
        if time.monotonic() > give_up:
            raise RuntimeError(f"the engine process not ready after {ENGINE_START_TIMEOUT_S:.0f} s")

    async def close(self) -> None:
        """The child finishes what it holds and exits (killed if it does not within a minute)."""
        await self.link.close()
        await asyncio.to_thread(self.proc.join, 60)
        if self.proc.is_alive():
            log.warning("engine process pid %d still running; killing it", self.proc.pid)
            self.proc.kill()
            self.proc.join()
        shutil.rmtree(self.dir, ignore_errors=True)


async def attach(link: FrontLink, settings: Settings, check: Callable[[], None]) -> RemoteScoring:
    """The service that tokenizes in this process and scores through ``link`` (connected), once
    the engine says it is warm; ``check`` raises while waiting if waiting is no longer worth it."""
    while True:
        check()
        if link.gone:
            raise RuntimeError("the engine process closed the link before it was ready")
        try:
            kind, value = await asyncio.wait_for(link.states.get(), 0.5)
        except TimeoutError:
            continue
        if kind == "ready":
            break
    service = RemoteScoring(Tokenizing(load_tokenizer(value.model_dir), value), link, settings.knobs())
    link.send("ready", None)
    return service


def engine_main(settings: Settings, path: str, plugins=()) -> None:
    """The child of ``EngineProcess`` (``multiprocessing``'s target); ``plugins`` as a front
    end's."""
    from .app import configure_logging

    import_plugins(plugins)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its front end decides when it stops
    configure_logging(settings.log_level, "engine ")
    asyncio.run(_engine_for_one(settings, path))


async def _engine_for_one(settings: Settings, path: str) -> None:
    from .scoring import ready_engine

    link = EngineLink(path, 1)
    await link.start()
    service = None
    try:
        engine = await asyncio.to_thread(ready_engine, settings, "engine")
        service = ScoringService(engine, settings.batch_policy(), settings.knobs())
        service.start()
        link.serve(service)
        ready, lost = asyncio.ensure_future(link.all_ready.wait()), asyncio.ensure_future(link.lost.wait())
        await asyncio.wait({ready, lost}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            link.set_state("serving")
        await lost
        ready.cancel()
    finally:
        if service is not None:
            await service.close()
        await link.close()
