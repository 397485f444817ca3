"""Is FP8 good enough for this checkpoint? Its ranking on labelled calls, against bf16 and fp32.

Random weights cannot say how FP8 ranks (bench/RESULTS.md, FP8 linears): this runs the check on
a real checkpoint and labelled query-document pairs. Each line of ``--pairs`` is one call:

    {"query": "...", "documents": ["...", ...], "relevance": [2, 0, 1, ...]}

(graded labels, 0 = not relevant; an optional "instruction"), scored as the server scores text calls
(``--template``, default the Qwen3-Reranker one). Three engines, one at a time: ``fp32`` (the
checkpoint in fp32 on the torch reference, the yardstick), ``bf16`` and ``fp8``
(``--quantization fp8``), the latter two as ``scorer serve`` builds them on the device. Per system:
NDCG@10 against the labels (mean over calls), and against fp32's scores the mean label log-prob
error, Spearman correlation and top-3 agreement (``bench.fp8``'s metrics). FP8 is fit to serve where
its NDCG@10 is within the noise of bf16's and fp32's.

    python -m bench.fp8_check --model DIR --pairs pairs.jsonl --out out/
    (a BEIR or MS MARCO dev slice as such lines: a few hundred calls of 20-100 docs)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from scorer.options import ScoreOptions
from scorer.request import Doc, ScoreRequest
from scorer.runtime import build_engine

from .fp8 import _free, ranking
from .timing import environment, write_json

SYSTEMS = ("fp32", "bf16", "fp8")


def ndcg(scores: list[float], relevance: list[float], k: int = 10) -> float:
    """NDCG@k of the docs ranked by ``scores`` (ties in input order) against graded ``relevance``
    (gain 2^rel - 1); 1.0 for a call without a relevant doc."""
    gain = lambda rel: 2.0**rel - 1.0  # noqa: E731
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:k]
    dcg = sum(gain(relevance[i]) / math.log2(r + 2) for r, i in enumerate(order))
    ideal = sum(gain(rel) / math.log2(r + 2) for r, rel in enumerate(sorted(relevance, reverse=True)[:k]))
    return dcg / ideal if ideal else 1.0


def read_pairs(path: Path, limit: int = 0) -> list[dict]:
    """The calls of ``path`` (see the module); a line that is not one names its number and field."""
    calls = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        docs, rel = rec.get("documents"), rec.get("relevance")
        if not isinstance(rec.get("query"), str) or not isinstance(docs, list) or not docs:
            raise ValueError(f"{path}:{n}: needs a query (string) and documents (a list of strings)")
        if not isinstance(rel, list) or len(rel) != len(docs):
            raise ValueError(f"{path}:{n}: relevance needs one number per document ({len(docs)})")
        calls.append(rec)
        if limit and len(calls) == limit:
            break
    return calls


def engine(system: str, model: str | None, device: str):
    if system == "fp32":
        return build_engine(model, "torch", device, torch.float32, kernels="torch")
    quantization = "fp8" if system == "fp8" else "none"
    return build_engine(model, "auto", device, torch.bfloat16, quantization=quantization)


def score(e, calls: list[dict], template: str) -> list[list[tuple[float, tuple[float, ...]]]]:
    """Per call, (score, label log-probs) of each doc in input order."""
    options = ScoreOptions(template=template, return_label_logprobs=True)
    out = []
    for c in calls:
        docs = [Doc(text=d) for d in c["documents"]]
        r = e.score(ScoreRequest(c["query"], docs, instruction=c.get("instruction", ""), options=options))
        out.append([(d.score, tuple(d.label_logprobs)) for d in sorted(r.results, key=lambda d: d.index)])
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="the checkpoint's directory (default: the tiny test model)")
    ap.add_argument("--pairs", type=Path, required=True, help="JSONL of labelled calls (see above)")
    ap.add_argument("--template", default="qwen3_reranker")
    ap.add_argument("--limit", type=int, default=0, help="the first N calls only")
    ap.add_argument("--device", default=None, help="default: cuda where there is one")
    ap.add_argument("--out", type=Path, default=Path("out"))
    a = ap.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    calls = read_pairs(a.pairs, a.limit)
    got = {}
    for system in SYSTEMS:
        e = engine(system, a.model, device)
        with torch.inference_mode():
            got[system] = score(e, calls, a.template)
        del e
        _free()
    rows = {}
    for system in SYSTEMS:
        per_call = [
            ndcg([s for s, _ in docs], c["relevance"]) for docs, c in zip(got[system], calls, strict=True)
        ]
        rows[system] = {"ndcg10_mean": statistics.fmean(per_call)}
        if system != "fp32":
            rows[system] |= ranking(got[system], got["fp32"])
    result = {
        **environment(torch.device(device)),
        "model": a.model,
        "pairs": str(a.pairs),
        "calls": len(calls),
        "rows": rows,
    }
    write_json(a.out / "fp8_check.json", result)
    print(f"{len(calls)} calls of {a.pairs}, model {a.model or 'the tiny test model'}, on {device}\n")
    print("| system | NDCG@10 | log-prob err mean vs fp32 | Spearman vs fp32 | top-3 vs fp32 |")
    print("|---|---:|---:|---:|---:|")
    for system, r in rows.items():
        vs = (
            f"{r['logprob_err_mean']:.2e} | {r['spearman_mean']:.4f} | {r['top3_mean']:.3f}"
            if system != "fp32"
            else "- | - | -"
        )
        print(f"| {system} | {r['ndcg10_mean']:.4f} | {vs} |")
    return result


if __name__ == "__main__":
    main()
