"""A call's time at light load, by stage: one call at a time over gRPC, ``--gap-ms`` after the last
answer, each answer's own ``timing`` (queue, tokenize, forward, server total) beside the client's
latency, so what an idle server adds to its engine shows where it goes.

    python -m bench.light_load --target 127.0.0.1:50051 --requests /tmp/A.jsonl --gap-ms 0,20 --out DIR

Prints a table of medians (ms) per gap and writes ``light_load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import grpc

from loadtest.gen import read_jsonl
from scorer.v1 import scorer_pb2 as pb
from scorer.v1 import scorer_pb2_grpc

from .timing import append_records

STAGES = ("client", "server", "outside", "tokenize", "queue", "forward", "rest")


async def probe(target: str, requests: list[pb.ScoreDocsRequest], gap_s: float, calls: int) -> dict:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = scorer_pb2_grpc.ScorerStub(channel)
        for r in requests[:5]:  # the channel and the server's first-use paths
            await stub.ScoreDocs(r, timeout=10)
        rows = {s: [] for s in STAGES}
        for r in requests[5 : 5 + calls]:
            await asyncio.sleep(gap_s)
            t0 = time.perf_counter()
            t = (await stub.ScoreDocs(r, timeout=10)).timing
            client = (time.perf_counter() - t0) * 1e3
            server = t.total_seconds * 1e3
            parts = {
                "tokenize": t.tokenize_seconds * 1e3,
                "queue": t.queue_seconds * 1e3,
                "forward": t.forward_seconds * 1e3,
            }
            values = {"client": client, "server": server, "outside": client - server, **parts}
            values["rest"] = server - sum(parts.values())
            for k, v in values.items():
                rows[k].append(v)
    return {s: statistics.median(v) for s, v in rows.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--requests", type=Path, required=True, help="the load tool's JSONL")
    ap.add_argument("--gap-ms", default="0,20", help="comma-separated pauses between calls")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--label", default="", help="a name for this server's configuration")
    ap.add_argument("--out", type=Path, help="directory for light_load.json (appended to)")
    args = ap.parse_args(argv)
    requests = read_jsonl(args.requests)
    records = []
    print(f"| config | gap ms | {' | '.join(STAGES)} |\n|---|---:|{'---:|' * len(STAGES)}")
    for gap in (float(g) for g in args.gap_ms.split(",")):
        med = asyncio.run(probe(args.target, requests, gap / 1e3, args.calls))
        records.append({"config": args.label, "gap_ms": gap, **{f"{k}_ms": v for k, v in med.items()}})
        print(f"| {args.label} | {gap:g} | " + " | ".join(f"{med[s]:.2f}" for s in STAGES) + " |", flush=True)
    if args.out:
        append_records(args.out / "light_load.json", records)


if __name__ == "__main__":
    main()
