"""``scorer score`` (score a JSONL file of docs against a prompt) and ``scorer serve`` (gRPC)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from .readout import DocScore
from .request import Doc, InvalidInput, ScoreRequest
from .settings import SCORE, SERVE, add_arguments, add_request_arguments, from_args, request_options

CHUNK_DOCS = 256  # docs per request when a file is large, so the progress bar moves


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        try:
            from .server import app
        except ImportError as e:  # the gRPC server is not part of this build
            parser.error(f"the gRPC server is not available in this build ({e})")
        return app.run(args)
    return _score(args)


def build_parser() -> argparse.ArgumentParser:
    """``scorer score`` and ``scorer serve``, their flags from ``scorer.settings``."""
    parser = argparse.ArgumentParser(prog="scorer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    score = sub.add_parser("score", help="score a JSONL file of docs ({'text': ..., 'id': ...} per line)")
    score.add_argument("--prompt", required=True)
    score.add_argument("--docs", required=True, type=Path, help="JSONL file, one object per line")
    score.add_argument("--instruction", default="")
    add_request_arguments(score)
    add_arguments(score, SCORE)
    serve = sub.add_parser("serve", help="run the gRPC ScoreDocs service")
    add_arguments(serve, SERVE)
    return parser


def _score(args: argparse.Namespace) -> int:
    from .attention import BackendUnavailable

    try:
        settings = from_args(args, SCORE)
        docs = list(read_docs(args.docs))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        engine = settings.build_engine()
    except BackendUnavailable as e:
        print(f"error: {e} (or pass --attention-fallback torch)", file=sys.stderr)
        return 2
    options = request_options(args)
    chunk_options = dataclasses.replace(options, top_n=0)  # top_n ranks the whole file, below
    schemes: set[str] = set()
    scored: list[tuple[int, DocScore, str]] = []
    with tqdm(total=len(docs), unit="doc", file=sys.stderr, disable=len(docs) < CHUNK_DOCS) as bar:
        for start in range(0, max(len(docs), 1), CHUNK_DOCS):
            chunk = docs[start : start + CHUNK_DOCS]
            req = ScoreRequest(args.prompt, chunk, instruction=args.instruction, options=chunk_options)
            try:
                result = engine.score(req)
            except InvalidInput as e:
                where = re.sub(r"^docs\[(\d+)\]", lambda m, s=start: f"docs[{s + int(m[1])}]", e.field)
                print(f"error: {where}: {str(e).split(': ', 1)[1]}", file=sys.stderr)
                return 2
            schemes.add(result.scheme)
            scored += [(start + d.index, d, result.scheme) for d in result.results]
            bar.update(len(chunk))
    if options.top_n:
        scored = sorted(scored, key=lambda x: -x[1].score)[: options.top_n]
    for index, d, scheme in scored:
        line = {"index": index, "id": d.id, "score": d.score, "scheme": scheme}
        if d.truncated_tokens:
            line["truncated_tokens"] = d.truncated_tokens
        if options.return_label_logprobs:
            line["label_logprobs"] = list(d.label_logprobs)
        print(json.dumps(line))
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
