"""How long a front-end process takes before it can tokenize (a restarted one serves no call until
then), and its memory: a fresh interpreter imports ``scorer.server.frontend_process`` and builds
the engine's tokenizer from its EngineInfo, either from the fast backend the engine sends
(``backend``, what front ends do) or through transformers' AutoTokenizer from the model's files
(``transformers``, what a slow tokenizer's front ends do). Rounds alternate the two.

    python -m bench.frontend_start --rounds 5 [--model DIR] [--out bench/data/cpu]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from .timing import environment, write_json

CHILD = """
import pickle, sys
info = pickle.load(open(sys.argv[1], "rb"))
from scorer.server.frontend_process import front_tokenizer
front_tokenizer(info).encode("a front end is ready")
status = open("/proc/self/status").read()  # VmHWM: this program's peak (ru_maxrss keeps the parent's)
print(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
"""
MODES = ("backend", "transformers")


def start(info_path: Path) -> tuple[float, float]:
    """(seconds from the interpreter's launch to a tokenized text, its peak RSS in MB)."""
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(info_path)], capture_output=True, text=True, check=True
    )
    return time.perf_counter() - started, int(out.stdout.split()[-1]) / 1024


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded toy model)")
    p.add_argument("--out", type=Path, default=Path("bench/data/cpu"))
    args = p.parse_args(argv)

    from scorer.runtime import build_engine

    info = build_engine(args.model, attention_backend="torch", device="cpu").info
    runs: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {mode: Path(tmp, f"{mode}.pkl") for mode in MODES}
        paths["backend"].write_bytes(pickle.dumps(info))
        paths["transformers"].write_bytes(pickle.dumps(replace(info, tokenizer=None)))
        for _ in range(args.rounds):
            for mode in MODES:
                runs[mode].append(start(paths[mode]))
    rows = {
        mode: {
            "seconds": [round(s, 3) for s, _ in r],
            "median_s": round(statistics.median(s for s, _ in r), 3),
            "rss_mb": round(statistics.median(m for _, m in r), 1),
        }
        for mode, r in runs.items()
    }
    print(f"{'tokenizer':<14} {'median s':>9} {'min s':>7} {'max s':>7} {'RSS MB':>7}")
    for mode, row in rows.items():
        print(
            f"{mode:<14} {row['median_s']:>9.2f} {min(row['seconds']):>7.2f} {max(row['seconds']):>7.2f}"
            f" {row['rss_mb']:>7.0f}"
        )
    result = {
        "model": info.model_name,
        "rounds": args.rounds,
        "modes": rows,
        "env": environment(torch.device("cpu")),
    }
    write_json(args.out / "frontend_start.json", result)
    return result


if __name__ == "__main__":
    main()
