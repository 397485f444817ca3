"""A front-end process of ``scorer serve --frontends N`` (``frontend_main``), and ``attach``, which
makes any process a front end of a running engine process (a Ray replica): it tokenizes in its
own process and scores through the link (``RemoteScoring``)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

from grpc_health.v1.health import aio as health_aio

from ..engine import EngineInfo, Tokenizing
from ..planning.schemes import import_plugins
from ..request import Job
from ..settings import Settings
from ..tokenizer import BackendTokenizer
from . import loops
from .batcher import Scored
from .calls import configure_logging
from .handler import CallHandler
from .lifecycle import (
    NOT_SERVING,
    SERVING,
    debug_knobs,
    grpc_server,
    listen_http,
    set_health,
    stop_accepting,
)
from .link import FrontLink, frontend_identity
from .scoring import TokenizingService, freeze_heap
from .servicer import ScorerServicer

log = logging.getLogger(__name__)
PARENT_POLL_S = 1.0


class RemoteScoring(TokenizingService):
    """Tokenize here, score in the engine process."""

    def __init__(self, engine: Tokenizing, link: FrontLink, knobs=None) -> None:
        super().__init__(engine, knobs)
        self.link = link

    async def score(self, job: Job, deadline: float | None, request_id: str) -> Scored:
        return await self.link.score(job, deadline, request_id)


def front_tokenizer(info: EngineInfo):
    """The engine's tokenizer in this process: its fast backend as the engine sent it, else (a slow
    tokenizer) loaded from the model's files by transformers."""
    if info.tokenizer is not None:
        return BackendTokenizer(info.tokenizer)
    from ..models.loader import load_tokenizer

    return load_tokenizer(info.model_dir)


def frontend_main(settings: Settings, address: str, index: int, parent: int, plugins=()) -> None:
    """A front-end process (``multiprocessing``'s target): the engine process's signals drive it;
    ``plugins``: the engine process's scheme modules (``plugin_modules``)."""
    import_plugins(plugins)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the engine decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(settings.log_level, f"frontend-{index} ")
    loops.run(_frontend(settings, address, index, parent), settings.busy_poll_ms / 1e3)


async def _frontend(args: Settings, address: str, index: int, parent: int) -> None:
    link = FrontLink(frontend_identity(index))
    await link.connect(address)
    handler = CallHandler.from_settings(args)
    health = health_aio.HealthServicer()
    await set_health(health, NOT_SERVING)  # grpc's servicer starts SERVING; the engine says when
    serving = asyncio.Event()
    server = http = None

    def take(info: EngineInfo) -> None:  # tokenize as the engine does, from now on
        tokenizing = Tokenizing(front_tokenizer(info), info)
        handler.service = RemoteScoring(tokenizing, link, debug_knobs(args))
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
            http = await listen_http(args, handler, serving.is_set, reuse_port=True, quiet=True)
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
                    await set_health(health, SERVING)
                elif state == "draining":
                    serving.clear()
                    await health.enter_graceful_shutdown()
                elif state == "stop":
                    break
        orphaned.cancel()
        await stop_accepting(server, http, handler.inflight, grace_s)
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
    service = RemoteScoring(Tokenizing(front_tokenizer(value), value), link, debug_knobs(settings))
    link.send("ready", None)
    return service
