"""Host time to plan workload A (or A': log-normal doc lengths, so no two plans share a shape) on
the prefix cache, without the model: ``Engine.plan`` alone and
``Engine._plan_on_cache`` for prompts seen once (the default admission keeps them off the pool)
and for prompts written to the pool (the cache's reservation and ``on_pool``; the lease then
aborted, so each use writes again), and every call's peek at the cache on its way in
(``Engine.peeked``) for prompts it has not seen and for prompts it holds, for one call and for
batches of 19 (a serving batch of A), on one torch thread (``--host-threads``' default), median ms.

    python -m bench.plan_on_cache [--workload "A'"] [--out DIR]   # a table; plan_on_cache.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from scorer.settings import Settings

from .throughput import calls
from .timing import append_records

BATCH = 19


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--label", default="")
    ap.add_argument("--workload", default="A", choices=("A", "A'"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    engine = Settings().build_engine()
    jobs = [engine.tokenize(r) for r in calls(args.workload, 1600, engine.runner.model.config.vocab_size)]
    fresh = iter(jobs[600:])  # prompts the cache has never seen: one use each

    def on_cache(batch):
        _, lease, _ = engine._plan_on_cache(batch)
        if lease is not None:
            lease.abort()  # its blocks dropped: the next use writes them again

    def peek(batch):  # each call's way in (the engine process's, with front ends)
        for job in batch:
            engine.peeked(job)

    def hold_all():  # the prompts of the timed batches written to the pool and kept there
        for i in range(0, 600, BATCH):
            _, lease, _ = engine._plan_on_cache(jobs[i : i + BATCH])
            if lease is not None:
                lease.release()

    rows = {}
    cases = (  # name, what is timed, the cache's admit, prompts the cache has never seen, set-up
        ("plan", engine.plan, 2, False, None),
        # admit 2, the default: a prompt seen once neither reads nor writes the pool
        ("plan on the cache, prompts seen once", on_cache, 2, True, None),
        # every prompt written (admit 1, or a prompt seen before): the pool's reservation, on_pool
        ("plan on the cache, prompts written", on_cache, 1, False, None),
        # every call's peek at the cache on its way in: prompts unknown, then held (the last case:
        # it leaves them on the pool)
        ("peek, prompts not cached", peek, 2, True, None),
        ("peek, prompts cached", peek, 1, False, hold_all),
    )
    for name, fn, admit, new, setup in cases:
        engine.cache.admit = admit
        if setup is not None:
            setup()
        for size in (1, BATCH):
            if new:
                batches = [[next(fresh) for _ in range(size)] for _ in range(20 if size > 1 else 60)]
            else:
                batches = [jobs[i : i + size] for i in range(0, 600 - size + 1, size)][:60]
            for b in batches[:5] if not new else [jobs[:size]] * 5:
                fn(b)
            times = []
            for b in batches:
                t0 = time.perf_counter()
                fn(b)
                times.append((time.perf_counter() - t0) * 1e3)
            rows[f"{name}, {size} call{'s' if size > 1 else ''}"] = statistics.median(times)
    engine.cache.admit = 2
    print(
        f"| {args.label or 'this tree'} | {args.workload} | "
        + " | ".join(f"{k}: {v:.3f} ms" for k, v in rows.items())
        + " |"
    )
    if args.out:
        append_records(
            args.out / "plan_on_cache.json", [{"label": args.label, "workload": args.workload, **rows}]
        )


if __name__ == "__main__":
    main()
