"""The asyncio driver: open loop (Poisson or constant arrivals) or closed loop (fixed concurrency), over
gRPC here or over HTTP/1.1 to a rerank API (``http_api.HttpDriver``, ``DriveConfig.api``).

In open loop every call has a scheduled send time; its latency runs from that time, not from when the
driver got round to sending it, so a slow server or a slow driver cannot hide queueing (no coordinated
omission). How late the driver sent each call (its lag) is recorded too.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scorer.v1 import scorer_pb2

METHOD = "/scorer.v1.Scorer/ScoreDocs"
APIS = ("grpc", "cohere", "jina", "tei")
"""What a run talks: gRPC ScoreDocs, or one of the HTTP rerank shapes (the server's ``api`` label)."""
MAX_DURATION_S = 24 * 3600.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
TIMEOUT_KEY = "x-timeout-ms"
"""The deadline in milliseconds as metadata (``scorer.server.handler.TIMEOUT_KEY``)."""
SPIN_S = 0.001
"""The last stretch before each send that the open loop spends yielding to the event loop
(``asyncio.sleep(0)``: answers are still taken) instead of sleeping: a sleep ends when the
selector's timeout does, in whole milliseconds rounded up, and then the host must wake the thread.
Sleeping to the send time, sends left 0.7-0.9 ms late at the median (on the H200's host: a bare gRPC
server at 60 calls/s, its 2.4 ms median latency holding that lag; 0.1 ms with a 2 ms spin)."""
SPIN_SHARE = 0.1
"""The open loop spins only at rates where it costs at most this share of a core (rate x spin):
at light load, where the lag is a large part of a call's latency; a busy loop has no idle
stretch to spin in, and the cores it shares with a server on a small machine are not taken."""
_LAT_EDGES = np.geomspace(1e-5, 1e3, 801)  # progress p99: 8 decades, 100 bins each (2.3% wide)


@dataclass(frozen=True)
class Call:
    payload: bytes
    scheme: str
    docs: int


def compile_calls(requests: Sequence[scorer_pb2.ScoreDocsRequest], scheme: str | None = None) -> list[Call]:
    """Serialize once; ``scheme`` overrides every request's options.scheme."""
    out = []
    for req in requests:
        if scheme is not None:
            req = scorer_pb2.ScoreDocsRequest.FromString(req.SerializeToString())
            req.options.scheme = scheme
        out.append(Call(req.SerializeToString(), req.options.scheme or "auto", len(req.docs)))
    return out


@dataclass
class DriveConfig:
    target: str
    duration_s: float
    rate: float = 0.0
    arrival: str = "poisson"
    concurrency: int = 0
    max_requests: int = 0
    deadline_s: float = 10.0
    max_in_flight: int = 10_000
    channels: int = 1
    seed: int = 0
    connect_timeout_s: float = 10.0
    progress_s: float = 1.0
    label: str = ""
    api: str = "grpc"
    api_key: str | None = None  # HTTP: sent as Authorization: Bearer
    http_client: str = ""  # HTTP: aiohttp or httpx ("": aiohttp where installed)
    spin_s: float = SPIN_S  # open loop: the last stretch before a send spent yielding (SPIN_SHARE)

    def validate(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, not {self.api!r}")
        if (self.rate > 0) == (self.concurrency > 0):
            raise ValueError("give exactly one of a rate (open loop) or a concurrency (closed loop)")
        if not 0 < self.duration_s <= MAX_DURATION_S:
            raise ValueError(f"duration must be in (0, {MAX_DURATION_S:g}] seconds")
        if self.arrival not in ("poisson", "constant"):
            raise ValueError(f"arrival must be poisson or constant, not {self.arrival!r}")
        if self.deadline_s <= 0 or self.max_in_flight < 1 or self.channels < 1 or self.max_requests < 0:
            raise ValueError("deadline, max in flight and channels must be positive")
        if not 0 <= self.spin_s <= 1:
            raise ValueError("spin must be 0 to 1000 ms")


@dataclass
class Samples:
    """One entry per call, in completion order; times in seconds from the run's start."""

    sched: list[float] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    code: list[str] = field(default_factory=list)
    scheme: list[str] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)
    docs: list[int] = field(default_factory=list)
    error_examples: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    unfinished: int = 0

    def __len__(self) -> int:
        return len(self.latency)


def schedule(rate: float, duration_s: float, arrival: str, seed: int, max_requests: int = 0) -> np.ndarray:
    """Send times in seconds from the start, all below ``duration_s``.

    Poisson arrivals are drawn given their count, rate x duration (sorted uniform times), so a short run
    offers exactly its rate while keeping Poisson's bursts.
    """
    n = math.ceil(rate * duration_s)
    if arrival == "constant":
        times = np.arange(n) / rate
    else:
        times = np.sort(np.random.default_rng(seed).uniform(0.0, duration_s, n))
    return times[:max_requests] if max_requests else times


class Driver:
    def __init__(self, cfg: DriveConfig, calls: Sequence[Call]) -> None:
        cfg.validate()
        if not calls:
            raise ValueError("no requests to send")
        self.cfg, self.calls = cfg, calls
        self.s = Samples()
        self.inflight = 0
        self.sent = 0
        self.errors = 0
        self._slot_free = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._hist = np.zeros(len(_LAT_EDGES) + 1, dtype=np.int64)
        self._hist_upto = 0

    async def run(self) -> Samples:
        await self._connect()
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time() + 0.01
        progress = asyncio.create_task(self._progress()) if self.cfg.progress_s > 0 else None
        try:
            await (self._open_loop() if self.cfg.rate > 0 else self._closed_loop())
            await self._drain()
        finally:
            self.s.wall_s = self.loop.time() - self.t0
            if progress:
                progress.cancel()
                self._print_progress()
            await self._disconnect()
        return self.s

    async def _connect(self) -> None:
        """Open the connections and wait until the server is SERVING (ConnectionError if not in time)."""
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.use_local_subchannel_pool", 1),
        ]
        self._channels = [
            grpc.aio.insecure_channel(self.cfg.target, options=options) for _ in range(self.cfg.channels)
        ]
        try:
            for ch in self._channels:
                await asyncio.wait_for(ch.channel_ready(), self.cfg.connect_timeout_s)
            await asyncio.wait_for(_serving(self._channels[0]), self.cfg.connect_timeout_s)
        except TimeoutError as e:
            await self._disconnect()
            raise ConnectionError(
                f"{self.cfg.target} not connected and SERVING within {self.cfg.connect_timeout_s:g} s"
            ) from e
        self.methods = [
            ch.unary_unary(METHOD, response_deserializer=scorer_pb2.ScoreDocsResponse.FromString)
            for ch in self._channels
        ]
        # the deadline as metadata too: Ray Serve's gRPC proxy passes metadata on, not deadlines
        self.metadata = ((TIMEOUT_KEY, f"{self.cfg.deadline_s * 1e3:g}"),)

    async def _disconnect(self) -> None:
        for ch in self._channels:
            await ch.close()

    async def _call(self, idx: int, due: float) -> None:
        c = self.calls[idx % len(self.calls)]
        method = self.methods[idx % len(self.methods)]
        self.inflight += 1
        self.sent += 1
        sent = self.loop.time()
        try:
            resp = await method(c.payload, timeout=self.cfg.deadline_s, metadata=self.metadata)
            code, ran = "OK", resp.scheme
        except grpc.aio.AioRpcError as e:
            code, ran = e.code().name, ""
            self.errors += 1
            self.s.error_examples.setdefault(code, e.details() or "")
        self._settle(c, due, sent, self.loop.time(), code, ran)

    def _settle(self, c: Call, due: float, sent: float, end: float, code: str, ran: str) -> None:
        """One call answered: its slot freed and its sample recorded (every front end)."""
        self.inflight -= 1
        self._slot_free.set()
        s = self.s
        s.sched.append(due - self.t0)
        s.lag.append(sent - due)
        s.latency.append(end - due)
        s.code.append(code)
        s.scheme.append(c.scheme)
        s.ran.append(ran)
        s.docs.append(c.docs)

    def _spawn(self, idx: int, due: float) -> None:
        task = self.loop.create_task(self._call(idx, due))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open_loop(self) -> None:
        times = schedule(
            self.cfg.rate, self.cfg.duration_s, self.cfg.arrival, self.cfg.seed, self.cfg.max_requests
        )
        times = times + self.t0
        spin = self.cfg.spin_s if self.cfg.rate * self.cfg.spin_s <= SPIN_SHARE else 0.0
        i, n = 0, len(times)
        while i < n:
            now = self.loop.time()
            if times[i] > now:
                await asyncio.sleep(pause(times[i] - now, spin))
                continue
            if self.inflight >= self.cfg.max_in_flight:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            self._spawn(i, float(times[i]))
            i += 1

    async def _closed_loop(self) -> None:
        end = self.t0 + self.cfg.duration_s
        limit = self.cfg.max_requests or sys.maxsize
        counter = iter(range(limit))

        async def worker() -> None:
            for idx in counter:
                now = self.loop.time()
                if now >= end:
                    return
                await self._call(idx, now)

        await asyncio.sleep(max(0.0, self.t0 - self.loop.time()))
        await asyncio.gather(*(worker() for _ in range(self.cfg.concurrency)))

    async def _drain(self) -> None:
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=self.cfg.deadline_s + 5.0)
        for task in pending:
            task.cancel()
        self.s.unfinished = len(pending)

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.progress_s)
            self._print_progress()

    def _print_progress(self) -> None:
        new = self.s.latency[self._hist_upto :]
        self._hist_upto += len(new)
        if new:
            self._hist += np.bincount(np.searchsorted(_LAT_EDGES, new), minlength=len(self._hist))
        done = len(self.s)
        p99 = _hist_quantile(self._hist, 0.99)
        t = max(self.loop.time() - self.t0, 1e-9)
        label = f"{self.cfg.label} " if self.cfg.label else ""
        print(
            f"[{label}{t:6.1f}s] sent {self.sent} ({self.sent / t:.1f}/s)  done {done}  "
            f"in flight {self.inflight}  errors {self.errors}  p99 {p99 * 1e3:.1f} ms",
            file=sys.stderr,
            flush=True,
        )


async def _serving(channel: grpc.aio.Channel) -> None:
    """Until the standard health service says SERVING; at once if the server has none."""
    check = health_pb2_grpc.HealthStub(channel).Check
    while True:
        try:
            reply = await check(health_pb2.HealthCheckRequest(), timeout=1.0)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return
        await asyncio.sleep(0.1)


def pause(wait_s: float, spin_s: float) -> float:
    """How long the open loop sleeps with ``wait_s`` to go before its next send: all but
    ``spin_s`` of it, then nothing (a yield to the event loop) until the send is due."""
    return wait_s - spin_s if wait_s > spin_s else 0.0


def _hist_quantile(hist: np.ndarray, q: float) -> float:
    total = hist.sum()
    if not total:
        return float("nan")
    k = int(np.searchsorted(np.cumsum(hist), q * total))
    return float(_LAT_EDGES[min(k, len(_LAT_EDGES) - 1)])


def drive(cfg: DriveConfig, calls: Sequence[Call]) -> Samples:
    """One run; ``calls`` from ``compile_calls`` (gRPC) or ``http_api.compile_calls`` (``cfg.api``)."""
    if cfg.api == "grpc":
        return asyncio.run(Driver(cfg, calls).run())
    from .http_api import HttpDriver  # imports the HTTP client only for an HTTP run

    return asyncio.run(HttpDriver(cfg, calls).run())
