"""The served prefix cache's numbers (``scripts/gpu/prefix_cache.sh served``): of two sweeps of the
load tool, with the cache and without, the best docs/s at p99 <= ``--p99-ms`` each, and their ratio.

    python scripts/gpu/served_summary.py CACHE_SWEEP_DIR NOCACHE_SWEEP_DIR OUT_JSON [--p99-ms 100]

A run counts where every call succeeded and its p99 is within the bound; each sweep's highest
achieved docs/s at all (its saturation) is beside it. Prints one line per configuration and the
ratio (and the cached one's against cache-off's most, for when cache-off keeps no rate within the
bound); writes them to OUT_JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loadtest.report import load, rate_rows


def best(sweep: Path, p99_ms: float) -> dict:
    """The sweep's best run within the p99 bound (None where no run is) and its saturation."""
    rows = rate_rows(load(sweep))
    within = [r for r in rows if not r["failed"] and r["p99_ms"] is not None and r["p99_ms"] <= p99_ms]
    top = max(within, key=lambda r: r["docs_s"], default=None)
    one = lambda v: None if v is None else round(v, 1)  # noqa: E731
    return {
        "docs_s": one(top["docs_s"]) if top else None,
        "calls_s": one(top["calls_s"]) if top else None,
        "offered_calls_s": top["offered_calls_s"] if top else None,
        "p99_ms": one(top["p99_ms"]) if top else None,
        "most_docs_s": one(max(r["docs_s"] for r in rows)),
        "runs": [
            {"offered_calls_s": r["offered_calls_s"], "docs_s": one(r["docs_s"]), "p99_ms": one(r["p99_ms"])}
            | {"failed": r["failed"]}
            for r in rows
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
    # where cache-off keeps no rate within the bound: against the most it served at all
    result["ratio_to_nocache_most"] = round(on / result["nocache"]["most_docs_s"], 2) if on else None
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    for name in ("cache", "nocache"):
        r = result[name]
        print(
            f"{name}: {r['docs_s']} docs/s ({r['calls_s']} calls/s at {r['offered_calls_s']} offered, p99"
            f" {r['p99_ms']} ms) within p99 <= {a.p99_ms:g} ms; {r['most_docs_s']} docs/s at most"
        )
    print(
        f"cache / no cache within the bound: {result['ratio']}x; against no cache's most:"
        f" {result['ratio_to_nocache_most']}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
