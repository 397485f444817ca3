"""The numbers of scripts/gpu/http_vs_grpc.sh from the load tool's reports.

    python scripts/gpu/http_vs_grpc.py light-rate OUT/grpc-ids     # 10% of a sweep's saturation, calls/s
    python scripts/gpu/http_vs_grpc.py summary OUT IDS.jsonl TEXT.jsonl [CHECKPOINT]

``summary`` writes OUT/http_vs_grpc.json and prints a table: per series the sweep's saturation (its
highest achieved docs/s; the sweep stops at its first saturated rate), the load tool's capacity
(its best unsaturated rate), and p50 / p99 at light load; the calls' token counts as the server
counts them (the checkpoint's tokenizer, the default's without one); the two targets on the
same calls (cohere-text against grpc-text). Exit 2 when the run cannot answer them: a sweep that
never saturated (raise the rates), a light-load call that failed, counts that do not match /metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SERIES = ("grpc-ids", "grpc-text", "cohere-text")
MIN_DOCS_RATIO = 0.9
MAX_P50_ADDED_MS = 1.0


def load_report(path: Path) -> dict:
    """A load tool report (its ``report.json``); SystemExit when it has no runs."""
    rep = json.loads((path / "report.json").read_text())
    if not rep["runs"]:
        raise SystemExit(f"{path}: no runs")
    return rep


def top_run(rep: dict) -> dict:
    """The report's run with the highest achieved docs/s (a sweep's saturation)."""
    return max(rep["runs"], key=lambda r: r["achieved_docs_per_s"])


def light_rate(path: Path) -> float:
    rps = top_run(load_report(path))["achieved_rps"]
    if not rps:
        raise SystemExit(f"{path}: no call succeeded")
    return round(0.1 * rps, 1)


def token_counts(requests: Path, checkpoint: str) -> dict:
    """Mean prefix, doc and item tokens of the first 100 requests, tokenized as the server does."""
    from google.protobuf import json_format
    from transformers import AutoTokenizer

    from scorer.models.tiny import ensure_tiny_model
    from scorer.planning import get
    from scorer.request import Limits, tokenize
    from scorer.server.convert import request_from_proto
    from scorer.v1 import scorer_pb2 as pb

    tokenizer = AutoTokenizer.from_pretrained(checkpoint or str(ensure_tiny_model()))
    limits = Limits(max_docs=1 << 10, max_doc_tokens=1 << 16, max_positions=1 << 20, vocab_size=1 << 30)
    prefix, docs, items = [], [], []
    for line in requests.read_text().splitlines()[:100]:
        req = request_from_proto(json_format.Parse(line, pb.ScoreDocsRequest()), "count")
        job = tokenize(req, tokenizer, limits, lambda *_: (get("ragged"), 0))
        prefix.append(len(job.prefix_ids))
        docs += job.doc_tokens
        items += [len(i) for i in job.items]
    mean = lambda xs: round(sum(xs) / len(xs), 1)  # noqa: E731
    return {"prefix": mean(prefix), "doc": mean(docs), "item": mean(items)}


def series(out: Path, name: str, problems: list[str]) -> dict:
    sweep, light = load_report(out / name), load_report(out / f"light-{name}")
    top, low = top_run(sweep), light["runs"][0]
    if not any(r["saturation"]["saturated"] for r in sweep["runs"]):
        problems.append(f"{name}: the sweep never saturated; its top is a lower bound (raise the rates)")
    if low["failed"] or low["saturation"]["saturated"]:
        problems.append(f"{name}: light load failed {low['failed']} calls or saturated: {low['saturation']}")
    for r in [*sweep["runs"], low]:
        if r.get("server", {}).get("verdict") == "do not match":
            problems.append(f"{name}: {r['label']}: the client's counts do not match /metrics")
    ms = lambda s: None if s is None else round(s * 1e3, 2)  # noqa: E731
    return {
        "saturation": {
            "docs_s": round(top["achieved_docs_per_s"], 1),
            "calls_s": round(top["achieved_rps"], 1),
            "offered_calls_s": top["offered_rps"],
            "p50_ms": ms(top["latency_seconds"]["p50"]),
            "saturated": top["saturation"]["saturated"],
            "lag_p99_ms": ms(top["generator"]["lag_seconds"]["p99"]),
        },
        "capacity": sweep["capacity"],
        "sweep": [
            {
                "offered": r["offered_rps"],
                "docs_s": round(r["achieved_docs_per_s"], 1),
                "p50_ms": ms(r["latency_seconds"]["p50"]),
                "p99_ms": ms(r["latency_seconds"]["p99"]),
                "failed": r["failed"],
                "saturated": r["saturation"]["saturated"],
            }
            for r in sweep["runs"]
        ],
        "light": {
            "calls_s": low["offered_rps"],
            "p50_ms": ms(low["latency_seconds"]["p50"]),
            "p99_ms": ms(low["latency_seconds"]["p99"]),
            "lag_p99_ms": ms(low["generator"]["lag_seconds"]["p99"]),
        },
    }


def summary(out: Path, ids: Path, text: Path, checkpoint: str) -> int:
    problems: list[str] = []
    result = {name: series(out, name, problems) for name in SERIES}
    http, grpc_text = result["cohere-text"], result["grpc-text"]
    ratio = http["saturation"]["docs_s"] / grpc_text["saturation"]["docs_s"]
    added = http["light"]["p50_ms"] - grpc_text["light"]["p50_ms"]
    doc = {
        "workload": "A: 300-token prompt + 10 x 50-token docs; 2 s deadlines, 4 connections, open loop",
        "checkpoint": checkpoint or "the embedded default",
        "tokens": {"grpc-ids": token_counts(ids, checkpoint), "text": token_counts(text, checkpoint)},
        "series": result,
        "targets": {
            "http_docs_s_over_grpc": round(ratio, 3),
            "http_docs_s_over_grpc_ok": ratio >= MIN_DOCS_RATIO,
            "http_p50_added_ms": round(added, 2),
            "http_p50_added_ms_ok": added <= MAX_P50_ADDED_MS,
            "http_docs_s_over_grpc_ids": round(
                http["saturation"]["docs_s"] / result["grpc-ids"]["saturation"]["docs_s"], 3
            ),
        },
        "problems": problems,
    }
    (out / "http_vs_grpc.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"tokens (prefix / doc / item): {doc['tokens']}\n")
    print(
        "| series | saturation docs/s | calls/s | generator lag p99 ms | capacity calls/s "
        "| light calls/s | p50 ms | p99 ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in result.items():
        cap = next(iter(r["capacity"].values()))["achieved_rps"]
        sat, low = r["saturation"], r["light"]
        print(
            f"| {name} | {sat['docs_s']:.0f} | {sat['calls_s']:.0f} | {sat['lag_p99_ms']} | {cap or 0:.0f} "
            f"| {low['calls_s']:g} "
            f"| {low['p50_ms']} | {low['p99_ms']} |"
        )
    t = doc["targets"]
    print(
        f"\nHTTP / gRPC docs/s at saturation, same calls: {t['http_docs_s_over_grpc']:.3f} "
        f"({'ok' if t['http_docs_s_over_grpc_ok'] else 'MISSED'}: >= {MIN_DOCS_RATIO}); "
        f"against A as token ids {t['http_docs_s_over_grpc_ids']:.3f}\n"
        f"HTTP p50 - gRPC p50 at light load: {t['http_p50_added_ms']:+.2f} ms "
        f"({'ok' if t['http_p50_added_ms_ok'] else 'MISSED'}: <= {MAX_P50_ADDED_MS} ms)"
    )
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    return 2 if problems else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["light-rate"] and len(argv) == 2:
        print(light_rate(Path(argv[1])))
        return 0
    if argv[:1] == ["summary"] and len(argv) in (4, 5):
        return summary(Path(argv[1]), Path(argv[2]), Path(argv[3]), argv[4] if len(argv) == 5 else "")
    raise SystemExit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
