"""One A call on the serving engine (Settings as `scorer serve` builds it), alone, by variant: the
prefix cache on/off, 0/2/20 ms since the last call (sleeping or spinning meanwhile), launch and
collect on the calling thread or handed to worker threads as the batcher does, torch on 1 thread (PROBE_ALL=1:
also 16, and /dev/cpu_dma_latency held at 0, CPUs kept out of deep idle states, where it can be
opened). Median ms of the launch (host) and the whole call.
    python3 scripts/gpu/idle_probe.py CKPT A.jsonl OUT.json"""

import json
import os
import statistics
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from loadtest.gen import read_jsonl
from scorer.server.convert import request_from_proto
from scorer.server.scoring import ready_engine
from scorer.settings import Settings

ckpt, reqs_path, out = sys.argv[1:4]
engine = ready_engine(Settings(model=ckpt or None))
reqs = [request_from_proto(r, str(i)) for i, r in enumerate(read_jsonl(Path(reqs_path))[:80])]
fwd, col = ThreadPoolExecutor(1), ThreadPoolExecutor(1)


def run(cache: bool, gap: float, spin: bool, hops: bool) -> tuple[float, float]:
    launch, total = [], []
    for r in reqs[:40] if cache else reqs[40:]:  # each prompt new to the cache, as at light load
        req = r if cache else replace(r, options=replace(r.options, prefix_cache="off"))
        job = engine.tokenize(req)
        torch.cuda.is_available() and torch.cuda.synchronize()
        end = time.perf_counter() + gap
        if spin:
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(gap)
        t0 = time.perf_counter()
        if hops:
            collect = fwd.submit(engine.launch, [job]).result()
            t1 = time.perf_counter()
            col.submit(collect).result()
        else:
            collect = engine.launch([job])
            t1 = time.perf_counter()
            collect()
        t2 = time.perf_counter()
        launch.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    return statistics.median(launch), statistics.median(total)


def table(label: str) -> list[dict]:
    rows = []
    for cache in (True, False):
        for gap in (0.0, 0.002, 0.02):
            for spin in (False, True) if gap else (False,):
                for hops in (False, True):
                    if engine.cache is not None:
                        engine.cache.clear()
                    la, to = run(cache, gap, spin, hops)
                    row = dict(
                        variant=label,
                        cache=cache,
                        gap_ms=gap * 1e3,
                        spin=spin,
                        hops=hops,
                        launch_ms=la,
                        total_ms=to,
                    )
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


rows = table("1 thread")
if os.environ.get("PROBE_ALL") == "1":  # torch's threads and the CPUs' idle states: no effect seen
    torch.set_num_threads(16)
    rows += table("16 threads")
    torch.set_num_threads(1)
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
        os.write(fd, struct.pack("i", 0))
        rows += table("cpu_dma_latency 0")
        os.close(fd)
    except OSError as e:
        print("no /dev/cpu_dma_latency:", e)
Path(out).write_text(json.dumps(rows, indent=1))
