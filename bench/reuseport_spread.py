"""How SO_REUSEPORT spreads a client's connections over a server's front-end processes: open
``--channels`` gRPC channels to a running ``scorer serve --frontends N`` (each its own connection),
see which process holds each (``ss -tnp``), close them, ``--trials`` times. Prints how many
connections the busiest front end held, by count of trials, and writes JSON with ``--out``.

    scorer serve --frontends 4 --port 50232 --metrics-port 0 &
    python -m bench.reuseport_spread --target 127.0.0.1:50232 --channels 4 --trials 30
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def spread(target: str, channels: int) -> collections.Counter:
    """Connections per server process for ``channels`` fresh channels."""
    port = target.rsplit(":", 1)[1]
    own = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel, not one shared
    opened = [grpc.insecure_channel(target, options=own) for _ in range(channels)]
    try:
        for ch in opened:  # a call each, so each connection is up
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        out = subprocess.run(
            ["ss", "-tnp", "state", "established", f"( sport = :{port} )"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return collections.Counter(re.findall(r"pid=(\d+)", out))
    finally:
        for ch in opened:
            ch.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--out", type=Path, help="a JSON file for the counts")
    a = ap.parse_args(argv)
    busiest = collections.Counter()
    for _ in range(a.trials):
        per_process = spread(a.target, a.channels)
        assert sum(per_process.values()) == a.channels, per_process
        busiest[max(per_process.values())] += 1
    print(f"| connections on the busiest front end ({a.channels} channels) | trials of {a.trials} |")
    print("|---:|---:|")
    for n in sorted(busiest):
        print(f"| {n} | {busiest[n]} |")
    if a.out:
        counts = {"channels": a.channels, "trials": a.trials, "busiest": dict(busiest)}
        a.out.write_text(json.dumps(counts) + "\n")


if __name__ == "__main__":
    main()
