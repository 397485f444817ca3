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

The parts are those of the one-process server (``lifecycle.py``), laid over processes: a front-end
process runs ``frontend_process.py``, and the Jobs and the lifecycle's states cross ``link.py``.

Metrics: the front ends write theirs into prometheus-client's multiprocess directory; the engine
process's /metrics serves them and its own as one set (``metrics.serve_http``).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import socket
import tempfile
import time
from dataclasses import replace

from .. import metrics
from ..lazy_torch import torch
from ..planning.schemes import plugin_modules
from ..settings import Settings
from .frontend_process import frontend_main
from .lifecycle import (
    CannotListen,
    drain,
    loading_engine,
    log_http,
    serve_metrics,
    serve_until_stopped,
    start_service,
)
from .link import EngineLink, frontend_identity

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0
"""How long front-end processes may take to start and bind their ports."""
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
    mp_dir = tempfile.mkdtemp(prefix="scorer-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = mp_dir  # the front ends', spawned after this
    reserved: list[socket.socket] = []
    metrics_http = link = fronts = service = loading = None
    try:
        metrics_http = serve_metrics(args, mp_dir)
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
        service = await start_service(args, signals, loading)
        if service is not None:
            link.serve(service)
            await link.all_ready.wait()
            link.set_state("serving")
            await serve_until_stopped(service, signals)
        link.set_state("draining")
        await drain(args, signals)
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
