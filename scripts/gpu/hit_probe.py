"""Small batches of A calls on the serving engine (Settings as `scorer serve` builds it) by what the
prefix cache does with their prompts, side by side on one engine: ``off`` (the call's option),
``first`` (cache on, a prompt's first sighting: nothing written), ``write`` (its second: the batch
writes the pool), ``hit`` (its third: the prompt's K/V read from the pool, however few rows that
saves), ``rule`` (its fourth, under the serving default ``--prefix-cache-min-read``: a batch whose
hits save fewer rows computes its prompts). For each group of
``b`` calls with prompts of their own the five run in turn, each after a gap of 0 or 20 ms; medians
of the launch (host) and the whole batch, ms. Is a hit cheaper than computing the prompt for the
batches a lightly loaded server runs? Each file of calls is probed in turn (text calls with the
reranker template share its head: there ``first`` and ``write`` read those blocks too, ``off`` does
not). Groups of calls per batch size and gap: env HIT_GROUPS (default 25).
    python3 scripts/gpu/hit_probe.py CKPT OUT.json CALLS.jsonl [CALLS.jsonl ...]"""

import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from loadtest.gen import read_jsonl
from scorer.server.convert import request_from_proto
from scorer.server.scoring import ready_engine
from scorer.settings import Settings

ckpt, out, *files = sys.argv[1:]
groups = int(os.environ.get("HIT_GROUPS", "25"))
engine = ready_engine(Settings(model=ckpt or None, prefix_cache_admit=2))  # the sightings below are admit 2's
assert engine.cache is not None, "the prefix cache is off in this engine's settings"
MODES = ("off", "first", "write", "hit", "rule")
RULE = engine.min_cache_read, engine.min_cache_read_rows  # the serving default; the others read every hit


def timed(batch, gap: float) -> tuple[float, float, int]:
    """One batch after ``gap`` s of idle: launch ms, whole ms, prompt tokens read from the cache."""
    jobs = [engine.tokenize(r) for r in batch]
    torch.cuda.is_available() and torch.cuda.synchronize()
    time.sleep(gap)
    t0 = time.perf_counter()
    collect = engine.launch(jobs)
    t1 = time.perf_counter()
    results = collect()
    t2 = time.perf_counter()
    cached = sum(r.usage.cached_prompt_tokens for r in results)
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3, cached


def probe(calls: str, reqs: list) -> list[dict]:
    engine.cache.clear()
    rows, start = [], 0
    for b in (1, 2, 4, 8):
        for gap in (0.0, 0.02):
            got = {m: ([], [], []) for m in MODES}
            for _ in range(groups):
                batch, start = reqs[start : start + b], start + b
                assert len(batch) == b, "not enough calls in the file"
                off = [replace(r, options=replace(r.options, prefix_cache="off")) for r in batch]
                for mode, sent in zip(MODES, (off, batch, batch, batch, batch), strict=True):
                    engine.min_cache_read, engine.min_cache_read_rows = RULE if mode == "rule" else (0, 0)
                    for acc, v in zip(got[mode], timed(sent, gap), strict=True):
                        acc.append(v)
            for mode in MODES:
                launch, whole, cached = got[mode]
                row = dict(
                    calls=calls,
                    batch=b,
                    gap_ms=gap * 1e3,
                    mode=mode,
                    launch_ms=round(statistics.median(launch), 3),
                    total_ms=round(statistics.median(whole), 3),
                    cached_tokens=statistics.median(cached),
                )
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


rows = []
for path in files:
    reqs = [request_from_proto(r, str(i)) for i, r in enumerate(read_jsonl(Path(path)))]
    rows += probe(Path(path).stem, reqs)
print(
    f"{'calls':>14} {'b':>2} {'gap':>4} "
    + " ".join(f"{m + ' ms':>14}" for m in MODES)
    + "   (launch / whole)"
)
for i in range(0, len(rows), len(MODES)):
    r = rows[i : i + len(MODES)]
    print(
        f"{r[0]['calls']:>14} {r[0]['batch']:>2} {r[0]['gap_ms']:>4.0f} "
        + " ".join(f"{x['launch_ms']:>6.2f}/{x['total_ms']:>6.2f}" for x in r)
        + f"   read {r[1]['cached_tokens']:.0f} / {r[3]['cached_tokens']:.0f} / {r[4]['cached_tokens']:.0f}"
        " tokens (first / hit / rule)"
    )
Path(out).write_text(json.dumps(rows, indent=1))
