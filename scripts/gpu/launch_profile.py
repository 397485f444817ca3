"""Where a batch's host launch goes (``Engine.launch``, cProfile) on the serving engine: batches of
``b`` calls from a calls file whose prompts the prefix cache holds (each batch run once to write
its prompts, then profiled reading them), and the same batches computing their prompts (cache off):
the top functions by cumulative and own time, and the mean launch and whole ms.
``scheme``: every call's (default: the file's, ``auto``).
    python3 scripts/gpu/launch_profile.py CKPT CALLS.jsonl [b] [batches] [scheme]"""

import cProfile
import io
import pstats
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from loadtest.gen import read_jsonl
from scorer.server.convert import request_from_proto
from scorer.server.scoring import ready_engine
from scorer.settings import Settings

ckpt, calls = sys.argv[1:3]
b = int(sys.argv[3]) if len(sys.argv) > 3 else 1
n = int(sys.argv[4]) if len(sys.argv) > 4 else 10
scheme = sys.argv[5] if len(sys.argv) > 5 else ""
engine = ready_engine(Settings(model=ckpt, prefix_cache_admit=1))
reqs = [request_from_proto(r, str(i)) for i, r in enumerate(read_jsonl(Path(calls)))][: b * n]
if scheme:
    reqs = [replace(r, options=replace(r.options, scheme=scheme)) for r in reqs]
batches = [reqs[i : i + b] for i in range(0, len(reqs), b)]
for mode in ("hit", "off"):
    sent = (
        batches
        if mode == "hit"
        else [
            [replace(r, options=replace(r.options, prefix_cache="off")) for r in batch] for batch in batches
        ]
    )
    if mode == "hit":
        for batch in sent:  # written on first sight (admit 1)
            engine.launch([engine.tokenize(r) for r in batch])()
    prof, launch, whole = cProfile.Profile(), [], []
    for batch in sent:
        jobs = [engine.tokenize(r) for r in batch]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof.enable()
        collect = engine.launch(jobs)
        prof.disable()
        t1 = time.perf_counter()
        collect()
        whole.append(time.perf_counter() - t0)
        launch.append(t1 - t0)
    print(
        f"== {mode}: {len(sent)} batches of {b}: launch {1e3 * sum(launch) / len(launch):.2f} ms,"
        f" whole {1e3 * sum(whole) / len(whole):.2f} ms (mean; profiled)"
    )
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(22)
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:6000])
