"""The generator's own capacity: tiny calls against the stub server (started here, on loopback), at rising
open-loop rates and then closed loop, with the driver's CPU time per call.

    python -m loadtest.capacity --rates 1000,2000,3000,4000 --duration 3 --out capacity.json
    python -m loadtest.capacity --api cohere --rates 250,500,1000 [--http-client httpx]   (HTTP mode)

A closed-loop second warms the stub up first. A rate counts as sustained when the calls succeeded,
the achieved rate is within 3% of it, the driver's p99 lag behind its schedule stayed under 10 ms
and the calls' p99 latency under 50 ms. The stub shares the machine: on a small one the number is
the pair's, which bounds the driver's from below.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scorer.v1 import scorer_pb2

from . import http_api
from .driver import APIS, Call, DriveConfig, compile_calls, drive
from .stats import LAG_BEHIND_S, summarize

SUSTAINED_FRACTION = 0.97
SUSTAINED_P99_MS = 50.0  # tiny calls to an instant stub: a longer p99 means calls queue somewhere
STUB_START_S = 30.0
WARMUP_S = 1.0  # a fresh stub answers slowly for its first second or two


@contextmanager
def stub_server(*args: str, host: str = "127.0.0.1", http: bool = False) -> Iterator[tuple[str, str | None]]:
    """Yield the stub's target and its /metrics URL (None unless ``--metrics-port`` is in ``args``);
    ``http``: the target of its HTTP rerank routes instead of its gRPC port."""
    cmd = [sys.executable, "-m", "loadtest.stub", "--host", host, "--port", "0", "--lifetime-s", "900", *args]
    cmd += ["--http-port", "0"] if http else []
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        target, http_target, metrics_url = None, None, None
        deadline = time.monotonic() + STUB_START_S
        while target is None and time.monotonic() < deadline:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line:
                raise RuntimeError(f"stub exited with {proc.wait()}")
            if m := re.match(r"metrics on (\S+)", line):
                metrics_url = m.group(1)
            if m := re.match(r"stub http on (\S+)", line):
                http_target = m.group(1)
            if m := re.match(r"stub listening on (\S+)", line):
                target = m.group(1)
        if target is None:
            raise TimeoutError(f"stub not listening after {STUB_START_S} s")
        yield (http_target if http else target), metrics_url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tiny_calls(n: int = 64) -> list[Call]:
    reqs = [
        scorer_pb2.ScoreDocsRequest(
            prompt_token_ids=[40, 41, 42, 43],
            docs=[scorer_pb2.Doc(id="d0", token_ids=[44, 45, 46, 47])],
            request_id=f"cap-{i}",
        )
        for i in range(n)
    ]
    return compile_calls(reqs)


def tiny_text_calls(api: str, n: int = 64) -> list[Call]:
    """The same shape in text, for an HTTP api (the rerank shapes take no token ids)."""
    reqs = [
        scorer_pb2.ScoreDocsRequest(
            prompt="w40 w41 w42 w43",
            docs=[scorer_pb2.Doc(id="d0", text="w44 w45 w46 w47")],
            request_id=f"cap-{i}",
        )
        for i in range(n)
    ]
    return http_api.compile_calls(reqs, api)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(target: str, cfg_kw: dict, calls: list[Call]) -> dict:
    cfg = DriveConfig(target=target, progress_s=0.0, **cfg_kw)
    cpu = _cpu_s()
    samples = drive(cfg, calls)
    cpu = _cpu_s() - cpu
    s = summarize(samples, cfg)
    lag_p99 = s["generator"]["lag_seconds"]["p99"] or 0.0
    out = {
        "rate": cfg.rate or None,
        "concurrency": cfg.concurrency or None,
        "calls": s["requests"],
        "failed": s["failed"],
        "by_code": s["by_code"],
        "error_examples": s["error_examples"],
        "achieved_rps": round(s["achieved_rps"], 1),
        "latency_p50_ms": round((s["latency_seconds"]["p50"] or 0) * 1e3, 2),
        "latency_p99_ms": round((s["latency_seconds"]["p99"] or 0) * 1e3, 2),
        "lag_p99_ms": round(lag_p99 * 1e3, 2),
        "driver_cpu_us_per_call": round(cpu / max(s["requests"], 1) * 1e6, 1),
    }
    if cfg.rate:
        out["sustained"] = bool(
            not s["failed"]
            and s["achieved_rps"] >= SUSTAINED_FRACTION * cfg.rate
            and lag_p99 < LAG_BEHIND_S
            and out["latency_p99_ms"] < SUSTAINED_P99_MS
        )
    return out


def run(
    rates: list[float],
    duration_s: float,
    concurrency: int,
    stub_args: tuple[str, ...] = (),
    api: str = "grpc",
    http_client: str = "",
) -> dict:
    """``api``: gRPC (the default) or an HTTP rerank shape, against the stub's HTTP routes."""
    http = api != "grpc"
    calls = tiny_text_calls(api) if http else tiny_calls()
    kw = {"api": api, "http_client": http_api.resolve_client(http_client)} if http else {}
    with stub_server(*stub_args, http=http) as (target, _):
        drive(DriveConfig(target=target, duration_s=WARMUP_S, concurrency=16, progress_s=0.0, **kw), calls)
        steps = [measure(target, {"rate": r, "duration_s": duration_s, **kw}, calls) for r in rates]
        closed = measure(target, {"concurrency": concurrency, "duration_s": duration_s, **kw}, calls)
    sustained = [s["rate"] for s in steps if s["sustained"]]
    return {
        "api": api,
        **({"http_client": kw["http_client"]} if http else {}),
        "cpus": len(os.sched_getaffinity(0)),
        "duration_s": duration_s,
        "open_loop": steps,
        "closed_loop": closed,
        "max_sustained_rps": max(sustained, default=None),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.capacity", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1000,2000,3000,4000")
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, default=64, help="closed-loop step")
    p.add_argument("--out", type=Path, help="also write the result as JSON here")
    p.add_argument("--api", choices=APIS, default="grpc", help="gRPC, or an HTTP rerank shape")
    p.add_argument("--http-client", choices=http_api.CLIENTS, help="HTTP: default aiohttp where installed")
    args = p.parse_args(argv)
    result = run(
        [float(r) for r in args.rates.split(",")],
        args.duration,
        args.concurrency,
        api=args.api,
        http_client=args.http_client or "",
    )
    for s in result["open_loop"]:
        print(
            f"rate {s['rate']:>7g}/s: achieved {s['achieved_rps']:>7.1f}/s  "
            f"p99 {s['latency_p99_ms']:6.2f} ms  "
            f"lag p99 {s['lag_p99_ms']:6.2f} ms  driver {s['driver_cpu_us_per_call']:5.1f} us CPU/call  "
            f"{'sustained' if s['sustained'] else 'NOT sustained'}"
        )
    c = result["closed_loop"]
    print(
        f"closed loop x{c['concurrency']}: {c['achieved_rps']:.1f}/s  p99 {c['latency_p99_ms']:.2f} ms  "
        f"driver {c['driver_cpu_us_per_call']:.1f} us CPU/call"
    )
    over = "" if args.api == "grpc" else f" ({args.api} over {result['http_client']})"
    print(f"max sustained open-loop rate{over} on {result['cpus']} CPUs: {result['max_sustained_rps']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
