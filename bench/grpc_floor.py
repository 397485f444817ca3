"""The floor under a served call's "outside" (bench.light_load: client latency less the server's own
time): a bare ScoreDocs server that answers at once, in a process of its own, and the light-load
probe's one-call-at-a-time loop against it, with the same requests, ``--gap-ms`` after each answer.
What it measures is both gRPC stacks and the host's wake-ups, with no scorer code in the way.

    python -m bench.grpc_floor --requests /tmp/A.jsonl [--gap-ms 0,20] [--server aio|sync|aio-busy]
        [--client aio|sync] [--out DIR]

``aio-busy``: the aio server's event loop polls its selector without sleeping for 50 ms after
each event (``BusyPollSelector``), so a call 20 ms after the last finds it awake: how much of the
host's wake-up a busy-polling server loop would save.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import selectors
import socket
import statistics
import time
from concurrent import futures
from pathlib import Path

import grpc

from loadtest.gen import read_jsonl
from scorer.v1 import scorer_pb2 as pb
from scorer.v1 import scorer_pb2_grpc

from .light_load import probe
from .timing import append_records


class Answer(scorer_pb2_grpc.ScorerServicer):
    """One score per doc, nothing computed."""

    @staticmethod
    def response(request: pb.ScoreDocsRequest) -> pb.ScoreDocsResponse:
        return pb.ScoreDocsResponse(
            results=[pb.DocScore(index=i, score=0.5) for i in range(len(request.docs))]
        )


class AioAnswer(Answer):
    async def ScoreDocs(self, request, context):  # noqa: N802 (the gRPC method's name)
        return self.response(request)


class SyncAnswer(Answer):
    def ScoreDocs(self, request, context):  # noqa: N802
        return self.response(request)


class BusyPollSelector(selectors.DefaultSelector):
    """``select`` polls without blocking while its last event is less than ``busy_poll_s`` old."""

    def __init__(self, busy_poll_s: float = 0.05) -> None:
        super().__init__()
        self.busy_poll_s = busy_poll_s
        self._last_event = time.monotonic()

    def select(self, timeout: float | None = None):
        start = now = time.monotonic()
        until = self._last_event + self.busy_poll_s
        if timeout is not None:
            until = min(until, now + timeout)
        ready = []
        while now < until and not ready:
            ready = super().select(0)
            now = time.monotonic()
        if not ready:
            ready = super().select(None if timeout is None else max(0.0, timeout - (now - start)))
        if ready:
            self._last_event = time.monotonic()
        return ready


def serve(kind: str, port: int) -> None:
    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(4))
        scorer_pb2_grpc.add_ScorerServicer_to_server(SyncAnswer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return

    async def run() -> None:
        server = grpc.aio.server()
        scorer_pb2_grpc.add_ScorerServicer_to_server(AioAnswer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    if kind == "aio-busy":
        with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(BusyPollSelector())) as runner:
            runner.run(run())
        return
    asyncio.run(run())


def probe_sync(target: str, requests: list, gap_s: float, calls: int) -> float:
    """``bench.light_load.probe``'s client latency, with gRPC's blocking client."""
    with grpc.insecure_channel(target) as channel:
        stub = scorer_pb2_grpc.ScorerStub(channel)
        for r in requests[:5]:
            stub.ScoreDocs(r, timeout=10)
        ms = []
        for r in requests[5 : 5 + calls]:
            time.sleep(gap_s)
            t0 = time.perf_counter()
            stub.ScoreDocs(r, timeout=10)
            ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=Path, required=True, help="the load tool's JSONL")
    ap.add_argument("--gap-ms", default="0,20")
    ap.add_argument("--calls", type=int, default=80)
    ap.add_argument("--server", choices=("aio", "sync", "aio-busy"), default="aio")
    ap.add_argument("--client", choices=("aio", "sync"), default="aio")
    ap.add_argument("--port", type=int, default=0, help="the server's port (0: a free one)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    requests = read_jsonl(a.requests)
    if not a.port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            a.port = s.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(a.server, a.port), daemon=True)
    server.start()
    target = f"127.0.0.1:{a.port}"
    try:
        with grpc.insecure_channel(target) as channel:  # the server's process is up and listening
            grpc.channel_ready_future(channel).result(timeout=30)
        records = []
        print("| server | client | gap ms | round trip p50 ms |\n|---|---|---:|---:|")
        for gap in (float(g) for g in a.gap_ms.split(",")):
            if a.client == "sync":
                med = probe_sync(target, requests, gap / 1e3, a.calls)
            else:
                med = asyncio.run(probe(target, requests, gap / 1e3, a.calls))["client"]
            poll = os.environ.get("GRPC_POLL_STRATEGY", "")  # gRPC's own default when empty
            records.append(
                {"server": a.server, "client": a.client, "poll": poll, "gap_ms": gap, "p50_ms": med}
            )
            print(f"| grpc {a.server} | grpc {a.client} | {gap:g} | {med:.2f} |", flush=True)
    finally:
        server.terminate()
    if a.out:
        append_records(a.out / "grpc_floor.json", records)


if __name__ == "__main__":
    main()
