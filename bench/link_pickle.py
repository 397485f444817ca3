"""What the front-end link pickles per call: a Job whole against ``frontends.for_engine``'s (the
docs' text and token ids left in the front end), bytes and the median dumps (front end) and loads
(the engine process's event loop) time, for calls of token ids of a few sizes.

    python -m bench.link_pickle [--out DIR]
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time
from pathlib import Path

from scorer.engine import EngineConfig
from scorer.request import Doc, ScoreOptions, ScoreRequest
from scorer.runtime import build_engine
from scorer.server.frontends import for_engine

from .timing import environment, write_json

SIZES = ((10, 50), (100, 500), (1000, 500))  # docs x tokens, on a 300-token prompt


def median_ms(fn, runs: int = 7) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    engine = build_engine(None, "torch", "cpu", None, config=EngineConfig(max_docs=1024, max_doc_tokens=8192))
    rng = random.Random(0)
    rows = []
    print("| call | sent | MB | dumps ms | loads ms |\n|---|---|---:|---:|---:|")
    for docs, n in SIZES:
        req = ScoreRequest(
            "",
            [Doc(id=f"d{i}", token_ids=tuple(rng.randrange(8000) for _ in range(n))) for i in range(docs)],
            prompt_token_ids=tuple(rng.randrange(8000) for _ in range(300)),
            options=ScoreOptions(template="plain"),
        )
        job = engine.tokenize(req)
        for sent, j in (("whole Job", job), ("for_engine", for_engine(job))):
            raw = pickle.dumps(j, pickle.HIGHEST_PROTOCOL)
            row = dict(
                docs=docs,
                doc_tokens=n,
                sent=sent,
                mb=len(raw) / 1e6,
                dumps_ms=median_ms(lambda j=j: pickle.dumps(j, pickle.HIGHEST_PROTOCOL)),
                loads_ms=median_ms(lambda raw=raw: pickle.loads(raw)),
            )
            rows.append(row)
            cols = f"{row['mb']:.2f} | {row['dumps_ms']:.2f} | {row['loads_ms']:.2f}"
            print(f"| {docs} x {n} | {sent} | {cols} |")
    if a.out:
        write_json(a.out / "link_pickle.json", {"env": environment(engine.device), "rows": rows})


if __name__ == "__main__":
    main()
