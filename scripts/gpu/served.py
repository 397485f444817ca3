"""The numbers of scripts/gpu/served.sh.

    python scripts/gpu/served.py share SWEEP_DIR SHARE     # SHARE x a sweep's saturation, calls/s
    python scripts/gpu/served.py p50 RUN_DIR     # one run's p50 and p99
    python scripts/gpu/served.py summary OUT CONFIG...  # OUT/served.json, a table (CONFIG: feN, feN-LABEL)
    python scripts/gpu/served.py merge OUT THROUGHPUT_JSON FRONTENDS [RUN]  # into its records (served_run)

Saturation is a sweep's highest achieved docs/s (it stops at its first saturated rate); served /
engine is that against the engine's docs/s on the same workload (OUT/engine.json, the same run).
The records: ``served_docs_s``, ``served_p50_ms_10`` (p50 at 10% of saturation) and
``served_p99_ms_80`` (p99 at 80%), one per workload and front-end count.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from http_vs_grpc import load_report, top_run  # beside this file: the same reports


def _first_run(path: Path) -> dict:
    return load_report(path)["runs"][0]


def share(path: Path, part: float) -> float:
    return round(part * top_run(load_report(path))["achieved_rps"], 1)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def _r(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f}"


def summary(out: Path, configs: list[str]) -> int:
    engine = {r["workload"]: r for r in json.loads((out / "engine.json").read_text())["records"]}
    records, lines = [], []
    lines.append(
        "| workload | server | engine docs/s | served docs/s | served / engine | p50 @10% ms |"
        " p99 @80% ms | engine idle p50 ms (20 ms apart) | lag p99 ms @80% |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for config in configs:
        fe = config.removeprefix("fe").split("-")[0]
        for d in sorted((out / config).iterdir()):
            w = d.name
            light = not (d / "sweep").exists()  # served.sh LIGHT=RATE: the light-load run only
            sweep = None if light else load_report(d / "sweep")
            low = _first_run(d / "at-0.1")
            top, high = (None, None) if light else (top_run(sweep), _first_run(d / "at-0.8"))
            ref = engine.get(w, {})
            rec = {
                "workload": w,
                "system": f"served-{config}",
                "frontends": int(fe),
                "engine_docs_s": ref.get("docs_s") and round(ref["docs_s"], 1),
                "engine_idle_p50_ms": ref.get("idle_p50_ms"),
                "engine_idle_spaced_p50_ms": ref.get("idle_spaced_p50_ms"),
                "served_docs_s": None if light else round(top["achieved_docs_per_s"], 1),
                "served_saturated": not light and any(r["saturation"]["saturated"] for r in sweep["runs"]),
                "served_p50_ms_10": _ms(low["latency_seconds"]["p50"]),
                "served_p99_ms_80": None if light else _ms(high["latency_seconds"]["p99"]),
                "lag_p99_ms_80": None if light else _ms(high["generator"]["lag_seconds"]["p99"]),
                "failed_80": None if light else high["failed"],
            }
            rec["served_over_engine"] = (
                round(rec["served_docs_s"] / rec["engine_docs_s"], 3)
                if rec["engine_docs_s"] and rec["served_docs_s"]
                else None
            )
            records.append(rec)
            lines.append(
                f"| {w} | {config} | {rec['engine_docs_s']} | {rec['served_docs_s']}"
                f"{'' if rec['served_saturated'] else ' (not saturated)'} | {rec['served_over_engine']} |"
                f" {rec['served_p50_ms_10']} | {rec['served_p99_ms_80']} | {_r(rec['engine_idle_p50_ms'])}"
                f" ({_r(rec['engine_idle_spaced_p50_ms'])}) |"
                f" {rec['lag_p99_ms_80']} |"
            )
    by = {(r["system"], r["workload"]): r for r in records}
    for config in configs:
        http, grpc = by.get((f"served-{config}", "A-text-cohere")), by.get((f"served-{config}", "A-text"))
        if http and grpc:
            ratio = http["served_docs_s"] / grpc["served_docs_s"]
            added = http["served_p50_ms_10"] - grpc["served_p50_ms_10"]
            lines.append(
                f"\n{config}: Cohere HTTP / gRPC docs/s on A-text {ratio:.3f}, p50 at 10% {added:+.2f} ms"
            )
    (out / "served.json").write_text(json.dumps({"records": records}, indent=1))
    print("\n".join(lines))
    return 0


def merge(out: Path, throughput: Path, frontends: int, run: str = "") -> int:
    """The served records of ``frontends`` into the qwen3-0.6b ``auto`` records of the engine's
    throughput.json (``served_*`` fields, with the engine's docs/s of the same run beside them and
    ``run``, the command, as ``served_run``; a workload it has no record of gets the run's engine
    record)."""
    doc = json.loads(throughput.read_text())
    auto = lambda r: r["model"] == "qwen3-0.6b" and r["system"] == "auto"  # noqa: E731
    engine = {r["workload"]: r for r in doc["records"] if auto(r)}
    for r in json.loads((out / "engine.json").read_text())["records"]:
        if auto(r) and r["workload"] not in engine:
            doc["records"].append(r)
            engine[r["workload"]] = r
    for rec in json.loads((out / "served.json").read_text())["records"]:
        if rec["system"] != f"served-fe{frontends}" or rec["workload"] not in engine:
            continue
        engine[rec["workload"]].update(
            served_docs_s=rec["served_docs_s"],
            served_p50_ms_10=rec["served_p50_ms_10"],
            served_p99_ms_80=rec["served_p99_ms_80"],
            served_frontends=frontends,
            served_engine_docs_s=rec["engine_docs_s"],
            served_over_engine=rec["served_over_engine"],
            **({"served_run": run} if run else {}),
        )
    throughput.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "p50":  # one run's p50 and p99, printed in the log (the reports may not come back)
        lat = _first_run(Path(rest[0]))["latency_seconds"]
        print(f"{rest[0]}: p50 {_ms(lat['p50'])} ms, p99 {_ms(lat['p99'])} ms")
    elif cmd == "share":
        print(share(Path(rest[0]), float(rest[1])))
    elif cmd == "merge":
        sys.exit(merge(Path(rest[0]), Path(rest[1]), int(rest[2]), *rest[3:4]))
    else:
        sys.exit(summary(Path(rest[0]), rest[1:]))
