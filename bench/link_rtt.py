"""Round trip of one small message between two processes, by link and by pause between
messages: the Unix stream socket of ``scorer serve --frontends`` (``server.frontends._Frames``)
and, where pyzmq is installed, the ZeroMQ DEALER/ROUTER over ipc that it replaced.

    python -m bench.link_rtt [--out DIR]      # prints a table, writes link_rtt.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

GAPS_MS = (0.0, 2.0, 20.0)
CALLS = 300


def _unix_server(path: str) -> None:
    from scorer.server.frontends import _Frames

    async def main():
        def on(end, kind, value):
            async def reply():
                end.send("done", value)

            asyncio.get_running_loop().create_task(reply())  # as EngineLink answers: from a task

        await asyncio.get_running_loop().create_unix_server(lambda: _Frames(on, lambda e: None), path)
        await asyncio.sleep(3600)

    asyncio.run(main())


async def _unix_client(path: str, gap_s: float) -> list[float]:
    from scorer.server.frontends import _Frames

    loop = asyncio.get_running_loop()
    waiting: dict[int, asyncio.Future] = {}
    _, end = await loop.create_unix_connection(
        lambda: _Frames(lambda e, k, v: waiting.pop(v).set_result(None), lambda e: None), path
    )
    out = []
    for i in range(CALLS):
        await asyncio.sleep(gap_s)
        t0 = time.perf_counter()
        waiting[i] = loop.create_future()
        end.send("score", i)
        await waiting[i]
        out.append((time.perf_counter() - t0) * 1e3)
    end.transport.close()
    return out


def _zmq_server(address: str) -> None:
    import zmq
    import zmq.asyncio

    async def main():
        sock = zmq.asyncio.Context().socket(zmq.ROUTER)
        sock.bind(address)
        while True:
            ident, kind, payload = await sock.recv_multipart()

            async def reply(ident=ident, payload=payload):
                sock.send_multipart([ident, b"done", payload], flags=zmq.NOBLOCK)

            asyncio.get_running_loop().create_task(reply())

    asyncio.run(main())


async def _zmq_client(address: str, gap_s: float) -> list[float]:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    out = []
    for i in range(CALLS):
        await asyncio.sleep(gap_s)
        t0 = time.perf_counter()
        sock.send_multipart([b"score", str(i).encode()], flags=zmq.NOBLOCK)
        await sock.recv_multipart()
        out.append((time.perf_counter() - t0) * 1e3)
    sock.close(0)
    ctx.term()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="link-rtt-")
    links = [("unix socket", _unix_server, _unix_client, f"{tmp}/engine.sock")]
    try:
        import zmq  # noqa: F401

        links.append(("zeromq ipc", _zmq_server, _zmq_client, f"ipc://{tmp}/zmq"))
    except ImportError:
        print("pyzmq is not installed: the unix socket alone")
    records = []
    print("| link | " + " | ".join(f"p50 ms, {g:g} ms apart" for g in GAPS_MS) + " |")
    print("|---|" + "---:|" * len(GAPS_MS))
    for name, server, client, address in links:
        proc = mp.get_context("spawn").Process(target=server, args=(address,), daemon=True)
        proc.start()
        time.sleep(2.0)
        p50 = [statistics.median(asyncio.run(client(address, g / 1e3))) for g in GAPS_MS]
        proc.kill()
        records += [{"link": name, "gap_ms": g, "p50_ms": v} for g, v in zip(GAPS_MS, p50, strict=True)]
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in p50) + " |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "link_rtt.json").write_text(json.dumps({"records": records}, indent=1))


if __name__ == "__main__":
    main()
