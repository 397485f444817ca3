"""Replay a JSONL request set against a ScoreDocs server and write a report directory.

    python -m loadtest.run --target 127.0.0.1:50051 --requests reqs.jsonl --rate 50 --duration 30 \\
        --out report/

Open loop (``--rate``, Poisson or ``--arrival constant``), closed loop (``--concurrency``), or a sweep of
rates (``--sweep 10,20,40``), each run bounded by ``--duration`` and ``--max-requests``. ``--schemes``
sends the whole set once per scheme (overriding options.scheme), which gives one curve per scheme.
``--api cohere|jina|tei --target HOST:HTTP_PORT`` sends the same set to that HTTP rerank shape
instead of gRPC (text requests only; see loadtest/http_api.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from . import http_api, report
from . import metrics as m
from . import schemes as scheme_names
from .driver import APIS, MAX_DURATION_S, SPIN_S, Call, DriveConfig, compile_calls, drive
from .gen import read_jsonl
from .stats import Arrays, capacity, summarize


def run_one(
    cfg: DriveConfig, calls: list[Call], warmup_s: float, metrics_url: str | None
) -> tuple[dict, Arrays]:
    """One run; with ``metrics_url`` reconciled with the server's counts of ``cfg.api``'s calls."""
    before = m.scrape(metrics_url, api=cfg.api) if metrics_url else None
    samples = drive(cfg, calls)
    summary = summarize(samples, cfg, warmup_s)
    if metrics_url and before is not None:
        totals = summary["client_totals"]
        after = m.scrape_settled(metrics_url, totals["requests"], before, api=cfg.api)
        summary["server"] = m.reconcile(totals, after, cfg.api)
    return summary, Arrays.of(samples)


def series_name(calls: Sequence[Call]) -> str:
    """What a run is named by: the scheme its calls ask for ("auto" when they leave it out), or
    "mixed" when they ask for different ones."""
    asked = {c.scheme for c in calls}
    return asked.pop() if len(asked) == 1 else "mixed"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--target",
        default="127.0.0.1:50051",
        help="host:port (default 127.0.0.1:50051; HTTP: its --http-port)",
    )
    p.add_argument(
        "--api",
        choices=APIS,
        default="grpc",
        help="gRPC ScoreDocs (default), or an HTTP rerank shape: cohere, jina, tei (loadtest/http_api.py)",
    )
    p.add_argument(
        "--requests",
        type=Path,
        required=True,
        help="JSONL from loadtest.gen (cycled; each run of a sweep goes on where the last stopped)",
    )
    p.add_argument("--out", type=Path, required=True, help="report directory")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="open loop: calls/s offered")
    load.add_argument("--concurrency", type=int, help="closed loop: calls kept in flight")
    load.add_argument("--sweep", help="open loop at each of these rates in turn, e.g. 10,20,40")
    p.add_argument("--arrival", choices=("poisson", "constant"), default="poisson")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per run (default 30)")
    p.add_argument("--max-requests", type=int, default=0, help="stop a run after this many calls")
    p.add_argument("--deadline-ms", type=float, default=10_000.0, help="per call (default 10000)")
    p.add_argument("--warmup", type=float, default=0.0, help="seconds at each run's start left out of stats")
    p.add_argument("--schemes", help="comma list: run the set once per scheme, overriding options.scheme")
    p.add_argument(
        "--metrics-url", help="the server's Prometheus endpoint, e.g. http://127.0.0.1:9464/metrics"
    )
    p.add_argument(
        "--max-in-flight", type=int, default=10_000, help="open loop: the driver waits beyond this"
    )
    p.add_argument(
        "--channels",
        type=int,
        default=1,
        help="gRPC connections to spread calls over; HTTP: connections opened before the first call",
    )
    p.add_argument("--api-key", help="HTTP: sent as Authorization: Bearer KEY (the server's --api-key)")
    p.add_argument(
        "--http-client", choices=http_api.CLIENTS, help="HTTP: the client (default aiohttp where installed)"
    )
    p.add_argument("--pause", type=float, default=1.0, help="seconds between the runs of a sweep")
    p.add_argument("--stop-when-saturated", action="store_true", help="sweep: skip a scheme's higher rates")
    p.add_argument("--slo-p99-ms", type=float, help="sweep: capacity counts only runs with p99 within this")
    p.add_argument("--seed", type=int, default=0, help="arrival times")
    p.add_argument(
        "--spin-ms",
        type=float,
        default=SPIN_S * 1e3,
        help=f"open loop: the last milliseconds before each send spent yielding instead of sleeping, which"
        f" ends up to 1 ms late, at rates where that takes at most a tenth of a core (default"
        f" {SPIN_S * 1e3:g}; 0: sleep to the send time)",
    )
    p.add_argument("--quiet", action="store_true", help="no live progress on stderr")
    p.add_argument("--no-samples", action="store_true", help="do not write samples.csv")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rates = [float(x) for x in args.sweep.split(",")] if args.sweep else [args.rate or 0.0]
        schemes = args.schemes.split(",") if args.schemes else [None]
        if any(s not in scheme_names() for s in schemes if s is not None):
            raise ValueError(f"unknown scheme in {args.schemes!r}; known: {', '.join(scheme_names())}")
        if args.sweep and any(r <= 0 for r in rates):
            raise ValueError("sweep rates must be positive")
        if not 0 <= args.warmup < args.duration <= MAX_DURATION_S:
            raise ValueError("need 0 <= --warmup < --duration")
        requests = read_jsonl(args.requests)
        http, dropped, client = args.api != "grpc", {}, ""
        if http:
            if any(s not in (None, "auto") for s in schemes):
                raise ValueError(
                    f"--api {args.api} runs every call as scheme auto (the rerank shapes have no scheme): "
                    f"drop --schemes {args.schemes} or use --api grpc"
                )
            dropped = http_api.check_text(requests, args.api)
            client = http_api.resolve_client(args.http_client or "")
        elif args.api_key or args.http_client:
            raise ValueError("--api-key and --http-client are for an HTTP --api")
    except (ValueError, OSError) as e:
        parser.error(str(e))
    if client == "httpx":
        print(
            "warning: httpx spends 1 to 8 ms of CPU a call (more with more connections, encode/httpx#3215): "
            "the generator keeps to its schedule up to about 100 calls/s; aiohttp, where installed, to 2,000",
            file=sys.stderr,
        )
    if http and dropped:
        fields = ", ".join(f"{name} ({n} requests)" for name, n in dropped.items())
        print(
            f"warning: --api {args.api} cannot send {fields}: its calls run without them (scheme auto, "
            "the template's default instruction)",
            file=sys.stderr,
        )
    base = dict(
        target=args.target,
        duration_s=args.duration,
        arrival=args.arrival,
        concurrency=args.concurrency or 0,
        max_requests=args.max_requests,
        deadline_s=args.deadline_ms / 1000,
        max_in_flight=args.max_in_flight,
        channels=args.channels,
        seed=args.seed,
        spin_s=args.spin_ms / 1e3,
        progress_s=0.0 if args.quiet else 1.0,
        api=args.api,
        api_key=args.api_key,
        http_client=client,
    )
    runs, arrays = [], []
    for scheme in schemes:
        calls = http_api.compile_calls(requests, args.api) if http else compile_calls(requests, scheme)
        name = series_name(calls)
        sent = 0  # each run of a sweep goes on where the last stopped (a repeated context stays new)
        for rate in rates:
            label = f"{name} @ {rate:g}/s" if rate else f"{name} x{args.concurrency} concurrent"
            label = f"{args.api} {label}" if http else label
            cfg = DriveConfig(**base, rate=rate, label=label)
            try:
                at = sent % len(calls)
                summary, a = run_one(cfg, calls[at:] + calls[:at], args.warmup, args.metrics_url)
                sent += summary["client_totals"]["requests"]
            except (ConnectionError, ValueError, OSError) as e:
                print(f"error: {label}: {e}", file=sys.stderr)
                return 1
            runs.append({"label": label, "scheme": name, "api": args.api, **summary})
            arrays.append((label, a))
            _print_line(runs[-1])
            if args.stop_when_saturated and summary["saturation"]["saturated"]:
                break
            if len(rates) > 1:
                time.sleep(args.pause)
    rep = {
        "loadtest_version": 1,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {
            "target": args.target,
            "api": args.api,
            **(
                {"api_path": http_api.APIS[args.api].path, "http_client": client, "http_dropped": dropped}
                if http
                else {}
            ),
            "requests_file": str(args.requests),
            "rates": rates if args.rate or args.sweep else None,
            "concurrency": args.concurrency,
            "arrival": args.arrival,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "max_requests": args.max_requests,
            "deadline_s": args.deadline_ms / 1000,
            "schemes": schemes if args.schemes else None,
            "metrics_url": args.metrics_url,
            "channels": args.channels,
            "max_in_flight": args.max_in_flight,
            "seed": args.seed,
            "slo_p99_ms": args.slo_p99_ms,
        },
        "workload": {
            "requests": len(requests),
            "docs_mean": float(np.mean([len(r.docs) for r in requests])),
            "schemes": sorted({r.options.scheme or "auto" for r in requests}),
        },
        "sweep": bool(args.sweep) or len(schemes) > 1,
        "runs": runs,
    }
    if rep["sweep"]:
        rep["capacity"] = capacity(runs, args.slo_p99_ms / 1000 if args.slo_p99_ms else None)
    else:
        rep.update({k: v for k, v in runs[0].items() if k not in ("label", "timeline")})
    report.write(args.out, rep, arrays, samples=not args.no_samples)
    print(f"report: {args.out / 'report.md'}", file=sys.stderr)
    return 0


def _print_line(r: dict) -> None:
    lat = r["latency_seconds"]
    p99 = "-" if lat["p99"] is None else f"{lat['p99'] * 1e3:.1f} ms"
    sat = "SATURATED: " + "; ".join(r["saturation"]["reasons"]) if r["saturation"]["saturated"] else "ok"
    server = ""
    if "server" in r:
        verdict = r["server"]["verdict"]
        server = "  /metrics " + (verdict if verdict != "do not match" else "DO NOT MATCH")
        st = r["server"].get("server_stages") or {}
        if "forward_ms_mean" in st:
            server += f" (queue {st.get('queue_ms_mean', 0):g} / forward {st['forward_ms_mean']:g} ms a call"
            server += f", {st['batch_calls_mean']:g} calls a batch)" if "batch_calls_mean" in st else ")"
    print(
        f"{r['label']}: {r['achieved_rps']:.1f} ok calls/s, {r['achieved_docs_per_s']:.0f} docs/s, "
        f"p99 {p99}, failed {r['failed']}{server}  [{sat}]",
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(main())
