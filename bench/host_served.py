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
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
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

from scorer import readout
from scorer.engine import Engine, ScoreResult, logical_tokens
from scorer.request import Job

from .host_path import long_calls, long_checkpoint
from .timing import append_records, environment

SCORE_METHOD = "/scorer.v1.Scorer/ScoreDocs"
START_TIMEOUT_S = 180.0


class HostOnlyEngine(Engine):
    """An engine whose batches do the host work of a GPU's (the prefix cache's lease, the plan on
    its pool, the token ids) and no forward: every label log-prob is -0.5."""

    def launch(self, jobs: Sequence[Job]) -> Callable[[], list[ScoreResult]]:
        plan, lease, cached = self._plan_on_cache(jobs)
        ordered = [jobs[i] for i in plan.requests]
        logical_tokens(ordered, self.device, cached)
        flat = [-0.5] * sum(len(j.label_ids) * len(j.items) for j in ordered)

        def collect() -> list[ScoreResult]:
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


def start_server(model: Path, frontends: int, log_path: Path) -> tuple[subprocess.Popen, int, int]:
    """A HostOnlyEngine server on free ports, once its health says SERVING."""
    port, metrics_port = free_port(), free_port()
    args = [
        "--model", str(model), "--device", "cpu", "--attention-backend", "torch",
        "--auto-policy", "calibrated", "--prefix-cache-mib", "64", "--frontends", str(frontends),
        "--port", str(port), "--metrics-port", str(metrics_port), "--drain-seconds", "0",
        "--log-level", "WARNING",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.host_served", "--serve", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
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
    a = ap.parse_args(argv)
    root = Path(tempfile.gettempdir()) / "scorer-bench"
    root.mkdir(exist_ok=True)
    model = long_checkpoint(root)
    calls = long_calls(a.calls)
    records = []
    print("| code | front ends | calls/s | docs/s | p50 ms | p99 ms | prompt tokens hit | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for n in (int(x) for x in a.frontends.split(",")):
        proc, port, metrics_port = start_server(model, n, root / f"host_served_{n}.log")
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


if __name__ == "__main__":
    main()
