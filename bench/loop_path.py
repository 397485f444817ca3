"""The batcher's event-loop path against its worker threads, on a simulated device: which rule for
taking the loop path keeps light-load latency low without costing the overlap at higher load.

The fake engine holds the GIL for the host launch (``--launch-ms`` + ``--launch-per-call-ms`` a
call, in Python, as the real launch mostly is) and returns a collect that sleeps, GIL released,
until its device work ends: batches run on one device in launch order, ``--device-ms`` +
``--device-per-call-ms`` a call each from the start of their launch (or the end of the batch
before), and at least ``TAIL_S`` past the launch. The defaults are a Qwen3-0.6B A call on the
H200: ~3.7 ms of launch alone, ~1.5 ms of device time a call in large batches. Poisson
arrivals at each rate (a share of the threads' capacity, found first with a queue always full),
one process; the rules are values of ``--loop-path-gaps`` (``BatchPolicy.loop_path_gaps``):

- ``threads``: never the loop (inf);
- ``idle``: whenever nothing is in flight (0; session 22's run 2);
- ``gaps1``, ``gaps2``: when calls arrive 1 or 2 times a batch's estimated time apart.

    python -m bench.loop_path [--rates 0.1,0.5,0.8] [--seconds 6] [--out DIR]
    # prints p50 / p99 ms by rule and rate, writes loop_path.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from scorer.engine import ScoreResult, Usage
from scorer.planning import Shape, get
from scorer.request import Doc, Job, ScoreRequest
from scorer.server.batcher import Batcher, BatchPolicy

TAIL_S = 0.0003
"""The device work of a batch ends at least this long after its launch (its last kernels)."""
RULES = {"threads": math.inf, "idle": 0.0, "gaps1": 1.0, "gaps2": 2.0}


class FakeDevice:
    def __init__(self, launch_s: float, launch_per_call_s: float, device_s: float, per_call_s: float):
        self.launch_s, self.launch_per_call_s = launch_s, launch_per_call_s
        self.device_s, self.per_call_s = device_s, per_call_s
        self.free_at = 0.0

    def launch(self, batch: Sequence[Job]):
        began = time.perf_counter()
        end = began + self.launch_s + self.launch_per_call_s * len(batch)
        while time.perf_counter() < end:  # host work holding the GIL
            pass
        # the device starts on the first kernels queued, once done with the batch before
        work = self.device_s + self.per_call_s * len(batch)
        done = self.free_at = max(max(began, self.free_at) + work, end + TAIL_S)
        results = [ScoreResult((), "ragged", Usage(0, 0, 1, 0)) for _ in batch]

        def collect():
            time.sleep(max(0.0, done - time.perf_counter()))
            return results

        return collect


def job() -> Job:
    req = ScoreRequest(prompt="q", docs=[Doc("d")])
    shape = Shape(799, (1,))
    scheme = get("ragged")
    return Job(req, (1,) * 799, ((2,),), (1,), (0,), (3,), shape, scheme, 0, 800)


async def load(device: FakeDevice, gaps: float, rate: float, seconds: float, seed: int) -> list[float]:
    batcher = Batcher(device.launch, BatchPolicy(loop_path_gaps=gaps))
    batcher.start()
    for _ in range(20):  # the forward-time model's first fit
        await batcher.submit(job(), None, "warm")
    rng, latencies, tasks = random.Random(seed), [], []

    async def one(due: float) -> None:
        await batcher.submit(job(), None, "call")
        latencies.append(time.perf_counter() - due)

    start = due = time.perf_counter()
    while due < start + seconds:
        due += rng.expovariate(rate)
        while (left := due - time.perf_counter()) > 0.001:
            await asyncio.sleep(left - 0.001)
        while time.perf_counter() < due:
            await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(one(due)))
    await asyncio.gather(*tasks)
    await batcher.close()
    return latencies


def run(rule: str, device: FakeDevice, rate: float, seconds: float, seed: int) -> dict:
    lat = sorted(asyncio.run(load(device, RULES[rule], rate, seconds, seed)))
    return {
        "rule": rule,
        "rate": rate,
        "calls": len(lat),
        "served_per_s": len(lat) / seconds,
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1e3,
    }


def capacity(device: FakeDevice, seconds: float) -> float:
    """Calls/s the threads rule serves with a queue always full (a closed loop of 64)."""

    async def closed() -> float:
        batcher = Batcher(device.launch, BatchPolicy(loop_path_gaps=math.inf))
        batcher.start()
        done, end = 0, time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < end:
                await batcher.submit(job(), None, "cap")
                done += 1

        await asyncio.gather(*(worker() for _ in range(64)))
        await batcher.close()
        return done / seconds

    return asyncio.run(closed())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="0.1,0.3,0.5,0.8", help="shares of the threads' capacity")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--launch-ms", type=float, default=3.5)
    ap.add_argument("--launch-per-call-ms", type=float, default=0.15)
    ap.add_argument("--device-ms", type=float, default=0.5)
    ap.add_argument("--device-per-call-ms", type=float, default=1.5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    ms = (args.launch_ms, args.launch_per_call_ms, args.device_ms, args.device_per_call_ms)
    device = FakeDevice(*(v / 1e3 for v in ms))
    cap = capacity(device, args.seconds)
    print(f"capacity (threads, queue always full): {cap:.0f} calls/s")
    rows = []
    print("| rule | share | calls/s | served/s | p50 ms | p99 ms |\n|---|---:|---:|---:|---:|---:|")
    for share in map(float, args.rates.split(",")):
        for rule in args.rules.split(","):
            row = run(rule, device, share * cap, args.seconds, seed=1) | {"share": share}
            rows.append(row)
            print(
                f"| {rule} | {share:.1f} | {row['rate']:.0f} | {row['served_per_s']:.0f} | "
                f"{row['p50_ms']:.2f} | {row['p99_ms']:.2f} |",
                flush=True,
            )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {"host": platform.node(), "python": platform.python_version(), "capacity": cap, "rows": rows}
        doc["args"] = vars(args) | {"out": str(args.out)}
        (args.out / "loop_path.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
