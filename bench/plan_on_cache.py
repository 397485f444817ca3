"""Host time to plan workload A on the prefix cache, without the model: ``Engine.plan`` alone and
``Engine._plan_on_cache`` (the cache's reservation and ``on_pool``; its lease then aborted, so
each call's prompt is new to the cache, as at light load), for one call and for batches of 19
(a serving batch of A), on one torch thread (``--host-threads``' default), median ms.

    python -m bench.plan_on_cache [--out DIR]      # prints a table, writes plan_on_cache.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from scorer.request import Doc, ScoreOptions, ScoreRequest
from scorer.settings import Settings

BATCH = 19


def calls(n: int, vocab: int) -> list[ScoreRequest]:
    rng = random.Random(0)
    ids = lambda k: tuple(rng.randrange(vocab) for _ in range(k))  # noqa: E731
    opts = ScoreOptions(template="plain", label_token_ids=(1, 2))
    docs = lambda: [Doc(token_ids=ids(50)) for _ in range(10)]  # noqa: E731
    return [ScoreRequest("", docs(), prompt_token_ids=ids(300), options=opts) for _ in range(n)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    engine = Settings().build_engine()
    jobs = [engine.tokenize(r) for r in calls(400, engine.runner.model.config.vocab_size)]

    def on_cache(batch):
        _, lease, _ = engine._plan_on_cache(batch)
        lease.abort()

    rows = {}
    for name, fn in (("plan", engine.plan), ("plan on the cache", on_cache)):
        for size in (1, BATCH):
            batches = [jobs[i : i + size] for i in range(0, len(jobs) - size + 1, size)][:60]
            for b in batches[:5]:
                fn(b)
            times = []
            for b in batches:
                t0 = time.perf_counter()
                fn(b)
                times.append((time.perf_counter() - t0) * 1e3)
            rows[f"{name}, {size} call{'s' if size > 1 else ''}"] = statistics.median(times)
    print(
        f"| {args.label or 'this tree'} | " + " | ".join(f"{k}: {v:.3f} ms" for k, v in rows.items()) + " |"
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "plan_on_cache.json"
        old = json.loads(path.read_text())["records"] if path.exists() else []
        path.write_text(json.dumps({"records": [*old, {"label": args.label, **rows}]}, indent=1))


if __name__ == "__main__":
    main()
