"""Calls/s of the host path alone: the long repeated prompt (``host_path.LONG_GEN``: an 8,000-id
prompt and 32 docs of 4 ids, token ids, each prompt reused by 10 calls in a row) through the real
gRPC front ends of ``scorer serve`` (``--frontends 0``: one process; 1, 2: front-end processes
and the link) to an engine that does a GPU engine's host work for each batch (the prefix cache's
reservation, the plan on its pool, the batch's token ids) and skips the model's forward
(``HostOnlyEngine``; torch on one thread, as a GPU server's ``--host-threads 1``): what the host
path alone can serve.

A closed loop of ``--concurrency`` calls in flight, each on a connection of its own (the kernel
spreads connections over the front ends), sending the serialized calls in order; calls/s over
``--seconds`` after ``--warmup`` seconds, latency percentiles, the cache's hit share from the
server's metrics. Records appended to ``host_served.json`` under ``--label``.

    python -m bench.host_served [--frontends 0,1,2] [--seconds 10] [--concurrency 8] [--label L] [--out DIR]

``--device C0_MS,US_PER_ROW`` puts a simulated device behind the engine: each batch holds it
for C0 ms plus US µs a row its plan computes, one batch at a time (2.5,4.3: a cache-off call of
this workload ~37 ms, as on the H100's replica). ``--rates`` runs an open loop instead: the load
tool's Poisson sweep of those rates against each ``--server-flags`` configuration in turn (the
batcher's policies compared where its queueing meets a device's), records in
``host_served_open.json``:

    python -m bench.host_served --frontends 1 --device 2.5,4.3 --rates 150,160,170,180 --seconds 6 \
        --rounds 2 --server-flags="--cut-before-heavy 0" --server-flags="--cut-before-heavy 4"

``--gen`` sends other calls (``loadtest.gen`` arguments), e.g. a saturating mix of sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtest import report
from scorer import readout
from scorer.engine import Engine, ScoreResult, logical_tokens
from scorer.request import Job

from .host_path import LONG_GEN, long_calls, long_checkpoint
from .timing import append_records, environment

SCORE_METHOD = "/scorer.v1.Scorer/ScoreDocs"
START_TIMEOUT_S = 180.0


DEVICE_ENV = "SCORER_BENCH_DEVICE"
"""``C0_MS,US_PER_ROW`` (``--device``): the host-only engine's batches hold a simulated device."""


class HostOnlyEngine(Engine):
    """An engine whose batches do the host work of a GPU's (the prefix cache's lease, the plan on
    its pool, the token ids) and no forward: every label log-prob is -0.5. With ``simulated``
    (seconds a batch, seconds a row its plan computes) each batch also holds a simulated device, one
    batch at a time in launch order, and its results wait for its end there: the batcher then
    meets the queueing of a device without one."""

    simulated: tuple[float, float] | None = None
    _device_free = 0.0

    def launch(self, jobs: Sequence[Job]) -> Callable[[], list[ScoreResult]]:
        plan, lease, cached = self._plan_on_cache(jobs)
        ordered = [jobs[i] for i in plan.requests]
        logical_tokens(ordered, self.device, cached)
        flat = [-0.5] * sum(len(j.label_ids) * len(j.items) for j in ordered)
        end = None
        if self.simulated is not None:  # launches come one at a time, from the forward thread
            per_batch, per_row = self.simulated
            start = max(time.monotonic(), self._device_free)
            end = self._device_free = start + per_batch + per_row * plan.num_slots  # the rows computed

        def collect() -> list[ScoreResult]:
            if end is not None:
                time.sleep(max(0.0, end - time.monotonic()))
            if lease is not None:
                lease.release()
            return readout.results(ordered, plan.requests, flat, cached)

        return collect


def serve(argv: list[str]) -> int:
    """``scorer serve`` with ``argv``, its engine a HostOnlyEngine (the front ends are scorer's own)."""
    from scorer.server import run
    from scorer.settings import SERVE, Settings, add_arguments

    build = Settings.build_engine

    def host_only(self, config=None) -> Engine:
        engine = build(self, config)
        engine.__class__ = HostOnlyEngine
        if device := os.environ.get(DEVICE_ENV):
            per_batch_ms, per_row_us = (float(x) for x in device.split(","))
            engine.simulated = (per_batch_ms / 1e3, per_row_us / 1e6)
        return engine

    Settings.build_engine = host_only
    torch.set_num_threads(1)  # as a GPU server's engine process (--host-threads 1)
    parser = argparse.ArgumentParser(prog="python -m bench.host_served --serve")
    add_arguments(parser, SERVE)
    return run(parser.parse_args(argv))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model: Path, frontends: int, log_path: Path, flags: Sequence[str] = (), device: str = ""
) -> tuple[subprocess.Popen, int, int]:
    """A HostOnlyEngine server on free ports, with more ``flags`` and ``device`` (``DEVICE_ENV``),
    once its health says SERVING."""
    port, metrics_port = free_port(), free_port()
    args = [
        "--model", str(model), "--device", "cpu", "--attention-backend", "torch",
        "--auto-policy", "calibrated", "--prefix-cache-mib", "64", "--frontends", str(frontends),
        "--port", str(port), "--metrics-port", str(metrics_port), "--drain-seconds", "0",
        "--log-level", "WARNING", *flags,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.host_served", "--serve", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", DEVICE_ENV: device},
        )
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: see {log_path}")
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return proc, port, metrics_port
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not serve within {START_TIMEOUT_S:.0f} s: see {log_path}")


async def closed_loop(
    target: str, calls: list[bytes], concurrency: int, warmup_s: float, seconds: float
) -> dict:
    """``concurrency`` calls in flight, each worker on its own connection; the calls answered
    within the measured window."""
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 << 20)]
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(concurrency)]
    order = itertools.cycle(calls)
    start = time.perf_counter() + warmup_s
    end = start + seconds
    latencies: list[float] = []
    errors: dict[str, int] = {}

    async def worker(channel: grpc.aio.Channel) -> None:
        call = channel.unary_unary(SCORE_METHOD)  # bytes in, bytes out: no client-side (de)serializing
        while (t0 := time.perf_counter()) < end:
            try:
                await call(next(order), timeout=30)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            t1 = time.perf_counter()
            if t0 >= start and t1 <= end:
                if code == "OK":
                    latencies.append((t1 - t0) * 1e3)
                else:
                    errors[code] = errors.get(code, 0) + 1

    try:
        await asyncio.gather(*(worker(c) for c in channels))
    finally:
        for c in channels:
            await c.close()
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")

    return {
        "calls_s": len(latencies) / seconds,
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
        "mean_ms": statistics.fmean(latencies) if latencies else float("nan"),
        "calls": len(latencies),
        "errors": errors,
    }


def cache_hit_share(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("scorer_prefix_cache_hit_tokens_total", "scorer_prefix_cache_lookup_tokens_total"):
            values[name] = float(value)
    lookup = values.get("scorer_prefix_cache_lookup_tokens_total", 0.0)
    return values.get("scorer_prefix_cache_hit_tokens_total", 0.0) / lookup if lookup else 0.0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        sys.exit(serve(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frontends", default="0,1,2", help="comma-separated --frontends of the servers")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured, per server")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    ap.add_argument("--concurrency", type=int, default=8, help="calls in flight")
    ap.add_argument("--calls", type=int, default=1000, help="distinct calls sent in turn")
    ap.add_argument("--label", default="", help="the code measured, in its records")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="", help="C0_MS,US_PER_ROW: batches hold a simulated device")
    ap.add_argument(
        "--rates",
        default="",
        help="an open loop instead: Poisson calls at each rate (calls/s), by the load tool, --seconds each",
    )
    ap.add_argument(
        "--server-flags",
        action="append",
        default=[],
        help="--rates: a server configuration's extra flags (repeat to compare; each one in turn)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="--rates: sweeps of each configuration, alternated")
    ap.add_argument(
        "--gen",
        default=LONG_GEN,
        help="--rates: the calls, as loadtest.gen arguments (default: the long repeated prompt)",
    )
    a = ap.parse_args(argv)
    root = Path(tempfile.gettempdir()) / "scorer-bench"
    root.mkdir(exist_ok=True)
    model = long_checkpoint(root)
    if a.rates:
        return main_open_loop(a, model, root)
    calls = long_calls(a.calls)
    records = []
    print("| code | front ends | calls/s | docs/s | p50 ms | p99 ms | prompt tokens hit | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for n in (int(x) for x in a.frontends.split(",")):
        proc, port, metrics_port = start_server(model, n, root / f"host_served_{n}.log", device=a.device)
        try:
            r = asyncio.run(closed_loop(f"127.0.0.1:{port}", calls, a.concurrency, a.warmup, a.seconds))
            r["cache_hit_share"] = cache_hit_share(metrics_port)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        r |= {"frontends": n, "docs_s": r["calls_s"] * 32}
        print(
            f"| {a.label} | {n} | {r['calls_s']:.1f} | {r['docs_s']:.0f} | {r['p50_ms']:.1f}"
            f" | {r['p99_ms']:.1f} | {r['cache_hit_share']:.1%} | {r['errors'] or '-'} |"
        )
        records.append(r)
    if a.out:
        env = environment(torch.device("cpu"))
        common = {"label": a.label, "env": env, "concurrency": a.concurrency, "seconds": a.seconds}
        append_records(a.out / "host_served.json", [common | r for r in records])


def main_open_loop(a: argparse.Namespace, model: Path, root: Path) -> None:
    """Each ``--server-flags`` configuration (the first ``--frontends``) swept over ``--rates`` by
    the load tool (``loadtest.run``, Poisson arrivals, 2 s deadlines) on ``--gen``'s calls (default
    ``LONG_GEN``), the configurations in turn for ``--rounds``; docs/s and p99 per rate, records
    appended to ``host_served_open.json``."""
    from loadtest.gen import main as gen_main

    requests = root / "open.jsonl"
    gen_main(["--out", str(requests), "--requests", "1000", *a.gen.split()])
    frontends = int(a.frontends.split(",")[0])
    configs = a.server_flags or [""]
    records = []
    print("| code | round | server flags | offered calls/s | calls/s | docs/s | p99 ms | failed |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for k in range(a.rounds):
        for flags in configs:
            log = root / "host_served_open.log"
            proc, port, _ = start_server(model, frontends, log, flags.split(), a.device)
            try:
                runs = sweep(port, requests, a.rates, a.seconds, root / "open_sweep")
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
            for r in runs:
                print(
                    f"| {a.label} | {k} | {flags or '-'} | {r['offered_calls_s']:g} | {r['calls_s']:.1f}"
                    f" | {r['docs_s']:.0f} | {r['p99_ms'] or float('nan'):.1f} | {r['failed']} |"
                )
            records.append({"round": k, "server_flags": flags, "runs": runs})
    if a.out:
        common = {"label": a.label, "env": environment(torch.device("cpu")), "frontends": frontends}
        common |= {"device": a.device, "seconds": a.seconds, "gen": a.gen}
        append_records(a.out / "host_served_open.json", [common | r for r in records])


def sweep(port: int, requests: Path, rates: str, seconds: float, out: Path) -> list[dict]:
    """The load tool's sweep of ``rates`` against the server on ``port``: per rate, the offered and
    achieved calls/s, docs/s, p99 (ms) and the calls that failed."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "loadtest.run", "--target", f"127.0.0.1:{port}", "--requests", str(requests),
        "--sweep", rates, "--schemes", "auto", "--duration", str(seconds), "--warmup", "1", "--pause", "1",
        "--deadline-ms", "2000", "--quiet", "--no-samples", "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return report.rate_rows(report.load(out))


if __name__ == "__main__":
    main()
