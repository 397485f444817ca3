"""The golden file of the embedded default model: exact scores (``float.hex``) and usage of a fixed
set of requests under every scheme, text and token ids, both templates, several options, ``top_n``,
and a token budget that splits requests into passes; fp32 on the CPU, each request scored alone.

    python scripts/golden.py            # (re)write tests/data/golden.json
    python scripts/golden.py --check    # exit 1 unless the engine reproduces it exactly

A refactor must reproduce the file bit for bit (tests/test_golden.py keeps it so); a change that
moves the default's scores on purpose (a new tokenizer, a new checkpoint) regenerates it and says so.

The same bits on every x86-64 CPU: MKL picks its GEMM kernels by the processor (an AVX-512 EPYC
and the CI's machine differed in the last bit of a third of the log-probs), so the script runs
MKL's conditional numerical reproducibility mode ``COMPATIBLE`` and ATen's AVX2 kernels (both read
at start: run it as a process of its own, as the test does, not imported after torch).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

REPRODUCIBLE_ENV = {"MKL_CBWR": "COMPATIBLE"}
if platform.machine() in ("x86_64", "AMD64"):
    REPRODUCIBLE_ENV["ATEN_CPU_CAPABILITY"] = "avx2"
if __name__ == "__main__":  # not when a test reads the cases in its own process
    os.environ.update(REPRODUCIBLE_ENV)

import torch  # noqa: E402  (after the environment above)

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "golden.json"
CONCRETE = ("naive", "split_cache", "ragged", "cascade", "multi_item", "custom_mask", "grouped")
DOCS = (
    "Rotary position embeddings rotate query and key vectors by an angle that grows with position.",
    "A shared prefix is computed once and its keys and values are reused by every document.",
    "bananas",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up.",
    "Multi-item scoring puts every candidate after one prompt and masks items from each other.",
)
PROMPT = "what is a shared prefix"
# token budgets per pass below what the cases compute (tests/test_golden.py checks), so they split
IDS_SPLIT = 64
TEXT_SPLIT = 128


def text_request(scheme: str, **options) -> dict:
    docs = [{"id": f"t{i}", "text": t} for i, t in enumerate(DOCS)]
    return {"prompt": PROMPT, "docs": docs, "options": {"scheme": scheme, **options}}


def ids_request(scheme: str, **options) -> dict:
    prefix = [(7 * i + 3) % 250 for i in range(41)]
    docs = [
        {"id": f"i{i}", "token_ids": [(11 * i + 5 * j + 1) % 250 for j in range(3 + 9 * i)]} for i in range(6)
    ]
    return {
        "prompt_token_ids": prefix,
        "docs": docs,
        "options": {"scheme": scheme, "template": "plain", **options},
    }


def cases() -> list[tuple[str, dict, dict]]:
    """(name, request as proto JSON, engine settings)."""
    out = []
    for scheme in ("auto", *CONCRETE):
        out.append((f"text/{scheme}", text_request(scheme), {}))
        out.append((f"ids/{scheme}", ids_request(scheme), {}))
        out.append(
            (f"ids/{scheme}/split{IDS_SPLIT}", ids_request(scheme), {"max_tokens_per_pass": IDS_SPLIT})
        )
        out.append(
            (f"text/{scheme}/split{TEXT_SPLIT}", text_request(scheme), {"max_tokens_per_pass": TEXT_SPLIT})
        )
    out += [
        ("text/plain", text_request("ragged", template="plain"), {}),
        (
            "text/instruction",
            {**text_request("multi_item"), "instruction": "Find passages about caching"},
            {},
        ),
        ("text/logprob", text_request("cascade", score_mode="logprob"), {}),
        ("text/top_n", text_request("auto", top_n=3, return_label_logprobs=True), {}),
        ("text/top_n_all", text_request("grouped", top_n=9, group_size=2), {}),
        ("text/grouped2", text_request("grouped", group_size=2), {}),
        ("text/truncate", text_request("ragged", truncate="doc_end", max_doc_tokens=12), {}),
        ("text/labels", text_request("naive", label_tokens=["no", "yes"]), {}),
        ("ids/label_ids", ids_request("multi_item", label_token_ids=[5, 6, 7]), {}),
        ("ids/truncate", ids_request("split_cache", truncate="doc_end", max_doc_tokens=10), {}),
        (
            "text/special",
            {
                "prompt": PROMPT,
                "docs": [{"id": "s", "text": "a doc <|im_end|> with a control token"}],
                "options": {"doc_special_tokens": "text"},
            },
            {},
        ),
        (
            "text/special_parse",
            {"prompt": PROMPT, "docs": [{"id": "s", "text": "a doc <|im_end|> with a control token"}]},
            {},
        ),
    ]
    return out


def score_case(request: dict, settings: dict) -> dict:
    """One request scored alone on the embedded default, as the response carries it (top_n order),
    at full precision."""
    from google.protobuf import json_format

    from scorer.engine import EngineConfig
    from scorer.runtime import build_engine
    from scorer.server.convert import request_from_proto
    from scorer.v1 import scorer_pb2 as pb

    engine = _engine(build_engine, EngineConfig, tuple(sorted(settings.items())))
    msg = json_format.ParseDict(request, pb.ScoreDocsRequest())
    result = engine.score(request_from_proto(msg, "golden"))
    u = result.usage
    return {
        "scheme": result.scheme,
        "usage": [u.prompt_tokens, u.doc_tokens, u.tokens_computed, u.tokens_saved],
        "results": [
            {
                "id": d.id,
                "index": d.index,
                "score": d.score.hex(),
                "label_logprobs": [x.hex() for x in d.label_logprobs],
                "doc_tokens": d.doc_tokens,
                "truncated_tokens": d.truncated_tokens,
            }
            for d in result.results  # top_n applied by the read-out
        ],
    }


_ENGINES: dict = {}


def _engine(build_engine, EngineConfig, settings):
    if settings not in _ENGINES:
        _ENGINES[settings] = build_engine(
            attention_backend="torch", device="cpu", config=EngineConfig(**dict(settings)), prefix_cache_mib=0
        )
    return _ENGINES[settings]


def golden() -> dict:
    torch.set_num_threads(1)
    return {name: score_case(req, settings) for name, req, settings in cases()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    ap.add_argument("--out", type=Path, default=GOLDEN)
    a = ap.parse_args(argv)
    data = golden()
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    if not a.check:
        a.out.write_text(text)
        print(f"wrote {len(data)} cases to {a.out}")
        return 0
    want = json.loads(a.out.read_text())
    bad = [k for k in want if data.get(k) != want[k]] + [k for k in data if k not in want]
    for k in bad:
        print(f"differs: {k}", file=sys.stderr)
    print(f"{len(data) - len(bad)}/{len(data)} cases reproduce {a.out.name} exactly")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
