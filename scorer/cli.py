"""``scorer score`` (score a JSONL file of docs against a prompt) and ``scorer serve`` (gRPC)."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from .attention import BACKENDS
from .planning import SCHEMES
from .request import (
    DOC_SPECIAL_TOKENS,
    SCORE_MODES,
    TEMPLATES,
    TRUNCATE_MODES,
    Doc,
    InvalidInput,
    ScoreOptions,
    ScoreRequest,
)

CHUNK_DOCS = 256  # docs per request when a file is large, so the progress bar moves


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scorer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    score = sub.add_parser("score", help="score a JSONL file of docs ({'text': ..., 'id': ...} per line)")
    score.add_argument("--prompt", required=True)
    score.add_argument("--docs", required=True, type=Path, help="JSONL file, one object per line")
    score.add_argument("--instruction", default="")
    score.add_argument("--scheme", default="auto", choices=SCHEMES)
    score.add_argument("--template", default=ScoreOptions.template, choices=sorted(TEMPLATES))
    score.add_argument("--score-mode", default="softmax", choices=SCORE_MODES)
    score.add_argument("--truncate", default="error", choices=TRUNCATE_MODES)
    score.add_argument("--group-size", type=int, default=0)
    score.add_argument(
        "--doc-special-tokens",
        default="parse",
        choices=DOC_SPECIAL_TOKENS,
        help="text: special-token strings in docs stay plain text (no control tokens from documents)",
    )
    _add_model_arguments(score)
    serve = sub.add_parser("serve", help="run the gRPC ScoreDocs service")
    try:
        from .server import app
    except ImportError:  # the gRPC server is not part of this build
        app = None
    if app is not None:
        app.add_arguments(serve)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        if app is None:
            parser.error("the gRPC server is not available in this build")
        return app.run(args)
    return _score(args)


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="local Hugging Face checkpoint directory (default: tiny embedded)"
    )
    p.add_argument("--attention-backend", default="auto", choices=BACKENDS)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def _score(args: argparse.Namespace) -> int:
    from .runtime import build_engine

    try:
        docs = list(read_docs(args.docs))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = build_engine(args.model, args.attention_backend, args.device)
    options = ScoreOptions(
        scheme=args.scheme,
        template=args.template,
        score_mode=args.score_mode,
        truncate=args.truncate,
        group_size=args.group_size,
        doc_special_tokens=args.doc_special_tokens,
    )
    schemes: set[str] = set()
    with tqdm(total=len(docs), unit="doc", file=sys.stderr, disable=len(docs) < CHUNK_DOCS) as bar:
        for start in range(0, max(len(docs), 1), CHUNK_DOCS):
            chunk = docs[start : start + CHUNK_DOCS]
            req = ScoreRequest(args.prompt, chunk, instruction=args.instruction, options=options)
            try:
                result = engine.score(req)
            except InvalidInput as e:
                where = re.sub(r"^docs\[(\d+)\]", lambda m, s=start: f"docs[{s + int(m[1])}]", e.field)
                print(f"error: {where}: {str(e).split(': ', 1)[1]}", file=sys.stderr)
                return 2
            schemes.add(result.scheme)
            for d in result.results:
                line = {"index": start + d.index, "id": d.id, "score": d.score, "scheme": result.scheme}
                if d.truncated_tokens:
                    line["truncated_tokens"] = d.truncated_tokens
                print(json.dumps(line))
            bar.update(len(chunk))
    print(f"scheme: {', '.join(sorted(schemes))}", file=sys.stderr)
    return 0


def read_docs(path: Path) -> Iterator[Doc]:
    with path.open() as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f'{path}:{n}: expected an object with a "text" string')
            yield Doc(text=obj["text"], id=str(obj.get("id", n - 1)))


if __name__ == "__main__":
    sys.exit(main())
