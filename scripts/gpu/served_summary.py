"""The served prefix cache's numbers (``scripts/gpu/prefix_cache.sh served``): of two sweeps of the
load tool, with the cache and without, the best docs/s at p99 <= ``--p99-ms`` each, and their ratio.

    python scripts/gpu/served_summary.py CACHE_SWEEP_DIR NOCACHE_SWEEP_DIR OUT_JSON [--p99-ms 100]

A run counts where every call succeeded and its p99 is within the bound; each sweep's highest
achieved docs/s at all (its saturation) is beside it. Prints one line per configuration and the
ratio; writes them to OUT_JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def best(sweep: Path, p99_ms: float) -> dict:
    """The sweep's best run within the p99 bound (None where no run is) and its saturation."""
    runs = json.loads((sweep / "report.json").read_text())["runs"]
    within = [
        r
        for r in runs
        if not r["failed"]
        and r["latency_seconds"]["p99"] is not None
        and r["latency_seconds"]["p99"] * 1e3 <= p99_ms
    ]
    top = max(within, key=lambda r: r["achieved_docs_per_s"], default=None)
    return {
        "docs_s": round(top["achieved_docs_per_s"], 1) if top else None,
        "calls_s": round(top["achieved_rps"], 1) if top else None,
        "offered_calls_s": top["offered_rps"] if top else None,
        "p99_ms": round(top["latency_seconds"]["p99"] * 1e3, 1) if top else None,
        "most_docs_s": round(max(r["achieved_docs_per_s"] for r in runs), 1),
        "runs": [
            {
                "offered_calls_s": r["offered_rps"],
                "docs_s": round(r["achieved_docs_per_s"], 1),
                "p99_ms": None
                if r["latency_seconds"]["p99"] is None
                else round(r["latency_seconds"]["p99"] * 1e3, 1),
                "failed": r["failed"],
            }
            for r in runs
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cache", type=Path)
    ap.add_argument("nocache", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--p99-ms", type=float, default=100.0)
    a = ap.parse_args(argv)
    result = {
        "p99_ms_bound": a.p99_ms,
        "cache": best(a.cache, a.p99_ms),
        "nocache": best(a.nocache, a.p99_ms),
    }
    on, off = result["cache"]["docs_s"], result["nocache"]["docs_s"]
    result["ratio"] = round(on / off, 2) if on and off else None
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    for name in ("cache", "nocache"):
        r = result[name]
        print(
            f"{name}: {r['docs_s']} docs/s ({r['calls_s']} calls/s at {r['offered_calls_s']} offered, p99"
            f" {r['p99_ms']} ms) within p99 <= {a.p99_ms:g} ms; {r['most_docs_s']} docs/s at most"
        )
    print(f"cache / no cache within the bound: {result['ratio']}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
