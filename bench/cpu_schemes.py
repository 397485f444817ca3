"""End-to-end scoring time per scheme on the CPU (torch reference backend, embedded tiny model):
the measurement behind ``auto`` picking ``ragged`` on the CPU.

    python -m bench.cpu_schemes [--docs 1,2,4,20] [--iters 10]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from scorer.planning import REGISTRY as _REG
from scorer.request import Doc, ScoreOptions, ScoreRequest
from scorer.runtime import build_engine

CONCRETE = tuple(_REG)

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", default="1,2,4,20")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    engine = build_engine(attention_backend="torch", device="cpu")
    rng = random.Random(0)
    table = {}
    for n in map(int, args.docs.split(",")):
        docs = [Doc(" ".join(rng.choice(WORDS) for _ in range(10))) for _ in range(n)]
        row = {}
        for scheme in CONCRETE:
            req = ScoreRequest(
                "what is the shared prefix of these letters", docs, options=ScoreOptions(scheme=scheme)
            )
            engine.score(req)
            start = time.process_time()
            for _ in range(args.iters):
                engine.score(req)
            row[scheme] = (time.process_time() - start) / args.iters * 1e3
        table[n] = row
        best = min(row, key=row.get)
        print(f"{n:>3} docs: " + "  ".join(f"{s} {ms:.1f}" for s, ms in row.items()) + f"  (fastest: {best})")
    print(json.dumps({"unit": "CPU ms per request (process time)", "docs": table}))


if __name__ == "__main__":
    main()
