"""Before/after comparison of two ``scripts/gpu/speedcheck.sh`` archives: the pipelined batch time
(``bench.batch_breakdown``) and every held-out model-level cell and scheme (``bench.e2e``), each the
median of its three runs; prints a table and the geometric mean of after / before.

    python -m bench.speedcheck bench/data/speedcheck/before.tgz bench/data/speedcheck/after.tgz
    python -m bench.speedcheck --within E2E_JSON results_flashinfer results   # two configurations of one run
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tarfile
from pathlib import Path


def load(path: Path) -> tuple[list[float], dict[tuple, list[float]]]:
    """(pipelined ms of each run, {(P, S, M, scheme): [forward ms of each run]})."""
    pipelined, cells = [], {}
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            if not m.name.endswith(".json"):
                continue
            data = json.load(io.TextIOWrapper(tar.extractfile(m)))
            if m.name.endswith("batch_breakdown.json"):
                pipelined.append(data["pipelined_ms_per_batch"])
                continue
            for c in data["cells"]:
                for scheme, r in c.get("results", {}).items():
                    if "forward_ms" in r:
                        cells.setdefault((c["P"], c["S"], c["M"], scheme), []).append(r["forward_ms"])
    return pipelined, cells


def within(path: Path, a: str, b: str) -> tuple[dict, dict]:
    """{(P, S, M, scheme): [ms]} of configurations ``a`` and ``b`` of one e2e run (held-out cells)."""
    data = json.loads(path.read_text())
    out: tuple[dict, dict] = ({}, {})
    for c in data["cells"]:
        for side, key in zip(out, (a, b), strict=True):
            for scheme, r in c.get(key, {}).items():
                if "forward_ms" in r:
                    side[(c["P"], c["S"], c["M"], scheme)] = [r["forward_ms"]]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path, nargs="?", help="speedcheck archive")
    ap.add_argument("after", type=Path, nargs="?")
    ap.add_argument("--within", nargs=3, metavar=("E2E_JSON", "BEFORE_KEY", "AFTER_KEY"))
    a = ap.parse_args(argv)
    if a.within:
        cb, ca = within(Path(a.within[0]), a.within[1], a.within[2])
        pb = pa = [1.0]
    else:
        (pb, cb), (pa, ca) = load(a.before), load(a.after)
    if not a.within:
        before, after = statistics.median(pb), statistics.median(pa)
        print(
            f"pipelined batch (bench.batch_breakdown), ms: runs before {[round(x, 2) for x in pb]}, after "
            f"{[round(x, 2) for x in pa]}; median {before:.2f} -> {after:.2f} ({after / before - 1:+.1%})\n"
        )
    print("| P | S | M | scheme | before ms | after ms | after / before |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    ratios, best = [], {}
    for key in sorted(cb.keys() & ca.keys()):
        b, x = statistics.median(cb[key]), statistics.median(ca[key])
        ratios.append(x / b)
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {b:.3f} | {x:.3f} | {x / b:.3f} |")
        cell = key[:3]
        best[cell] = (min(best.get(cell, (b, x))[0], b), min(best.get(cell, (b, x))[1], x))
    geo = statistics.geometric_mean(ratios)
    fastest = statistics.geometric_mean([x / b for b, x in best.values()])
    print(
        f"\n{len(ratios)} cell x scheme pairs: geometric mean after / before {geo:.3f}; "
        f"of each cell's fastest scheme {fastest:.3f} ({len(best)} cells)"
    )


if __name__ == "__main__":
    main()
