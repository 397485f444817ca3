"""What one full (generation 2) collection of the cyclic garbage collector costs in a process
that holds a ready engine, with its heap as ``ready_engine`` leaves it (frozen by
``server.scoring.freeze_heap``) and with the freeze undone: a collection stops every thread of the
process, and under load Python runs one whenever enough objects survived the younger generations.

    python -m bench.gc_pause [--model DIR] [--device cpu] [--calls 200] [--out DIR]
    # prints a table, writes gc_pause.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from scorer.request import Doc, ScoreRequest
from scorer.server.scoring import ready_engine
from scorer.settings import Settings


def collection_ms(repeat: int = 7) -> tuple[float, float]:
    """Min and median milliseconds of ``gc.collect(2)``."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        gc.collect(2)
        times.append((time.perf_counter() - start) * 1e3)
    return min(times), statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint (default: the tiny embedded one)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--calls", type=int, default=200, help="calls scored first, as a server would")
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args(argv)
    engine = ready_engine(Settings(model=a.model, device=a.device))  # frozen at its end
    docs = [Doc(f"document {i} about bread and ovens") for i in range(10)]
    for i in range(a.calls):
        engine.score(ScoreRequest(f"query {i} on baking", docs))
    rows = {}
    frozen = gc.get_freeze_count()
    rows["frozen (as served)"] = (len(gc.get_objects()), frozen, *collection_ms())
    gc.unfreeze()
    rows["unfrozen"] = (len(gc.get_objects()), 0, *collection_ms())
    gc.freeze()
    print(
        "| heap | objects tracked | frozen | gen-2 collection min ms | median ms |\n|---|---:|---:|---:|---:|"
    )
    for name, (objects, fro, lo, med) in rows.items():
        print(f"| {name} | {objects:,} | {fro:,} | {lo:.2f} | {med:.2f} |")
    a.out.mkdir(parents=True, exist_ok=True)
    record = {
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(engine.device),
        "model": engine.model_name,
        "calls_before": a.calls,
        "rows": {
            k: {"objects": o, "frozen": f, "min_ms": round(lo, 3), "median_ms": round(m, 3)}
            for k, (o, f, lo, m) in rows.items()
        },
    }
    (a.out / "gc_pause.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
