"""The engine in a child process of its own, for one front end: a Ray replica (``engine_process``)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time

from ..planning.schemes import import_plugins, plugin_modules
from ..settings import Settings
from . import stacks
from .calls import configure_logging
from .frontend_process import RemoteScoring, attach
from .lifecycle import batch_policy, debug_knobs
from .link import EngineLink, FrontLink, frontend_identity
from .scoring import ScoringService, ready_engine

log = logging.getLogger(__name__)
ENGINE_START_TIMEOUT_S = 1800.0
"""How long a replica's engine process may take to load its model and capture its graphs."""


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


def engine_main(settings: Settings, path: str, plugins=()) -> None:
    """The child of ``EngineProcess`` (``multiprocessing``'s target); ``plugins`` as a front
    end's."""
    import_plugins(plugins)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its front end decides when it stops
    configure_logging(settings.log_level, "engine ")
    sampler = stacks.from_environment(f".engine-{os.getpid()}")  # SCORER_STACK_SAMPLES
    try:
        asyncio.run(_engine_for_one(settings, path))
    finally:  # a multiprocessing child may leave without running atexit
        if sampler is not None:
            sampler.stop()


async def _engine_for_one(settings: Settings, path: str) -> None:
    link = EngineLink(path, 1)
    await link.start()
    service = None
    try:
        engine = await asyncio.to_thread(ready_engine, settings, "engine")
        service = ScoringService(engine, batch_policy(settings), debug_knobs(settings))
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
