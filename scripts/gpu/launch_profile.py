"""Where the host time of one A call's launch goes (cProfile), prefix cache on and off, on the
serving engine (Settings as `scorer serve` builds it), each call's prompt new to the cache.
    python3 scripts/gpu/launch_profile.py CKPT A.jsonl OUT_DIR"""

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

ckpt, reqs_path, out = sys.argv[1:4]
engine = ready_engine(Settings(model=ckpt or None))
reqs = [request_from_proto(r, str(i)) for i, r in enumerate(read_jsonl(Path(reqs_path))[:200])]
for cache in (True, False):
    jobs = [
        engine.tokenize(r if cache else replace(r, options=replace(r.options, prefix_cache="off")))
        for r in (reqs[:100] if cache else reqs[100:])
    ]
    for j in jobs[:5]:
        engine.score_batch([j])
    prof = cProfile.Profile()
    t = 0.0
    for j in jobs[5:]:
        torch.cuda.is_available() and torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof.enable()
        collect = engine.launch([j])
        prof.disable()
        t += time.perf_counter() - t0
        collect()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    print(f"cache={cache}: launch {t / len(jobs[5:]) * 1e3:.2f} ms a call (profiled)", file=s)
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumtime").print_stats(45)
    Path(out, f"launch_profile_cache{int(cache)}.txt").write_text(s.getvalue())
    print(s.getvalue().splitlines()[0])
