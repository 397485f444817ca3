"""``scorer score`` (score a JSONL file of docs against a prompt) and ``scorer serve`` (gRPC)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .settings import SCORE, SERVE, add_arguments, add_request_arguments, from_args, request_options

# torch, transformers and the engine are imported after the arguments are parsed: --help and a
# bad flag answer at once.
if TYPE_CHECKING:
    from .engine import Engine
    from .request import Doc, Job, ScoreOptions

CHUNK_DOCS = 256  # docs per request when a file is large, so the progress bar moves
DESCRIPTION = "Score documents against a prompt: scorer score (a JSONL file) or scorer serve (gRPC and HTTP)."
SCORE_HELP = 'score a JSONL file of docs ({"text": ..., "id": ...} per line) and print one JSON line per doc'
SERVE_HELP = (
    "serve gRPC ScoreDocs and, with --http-port, the HTTP rerank routes (Cohere, Jina, TEI), with"
    " Prometheus /metrics"
)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        if args.http_port and importlib.util.find_spec("fastapi") is None:
            parser.error("--http-port needs the HTTP extra: pip install 'scorer[http]'")
        from .server import run

        return run(args)
    return _score(args)


def build_parser() -> argparse.ArgumentParser:
    """``scorer score`` and ``scorer serve``, their flags from ``scorer.settings``."""
    parser = argparse.ArgumentParser(prog="scorer", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    score = sub.add_parser("score", help=SCORE_HELP, description=SCORE_HELP)
    score.add_argument(
        "--prompt", required=True, metavar="TEXT", help="the query the docs are scored against"
    )
    score.add_argument(
        "--docs",
        required=True,
        type=Path,
        metavar="FILE",
        help='JSONL, one {"text": ..., "id": ...} object per line; blank lines are skipped, and a doc'
        " without an id (or a null one) gets its index among the docs",
    )
    score.add_argument(
        "--instruction", default="", metavar="TEXT", help="the task instruction (default: the template's)"
    )
    add_request_arguments(score)
    add_arguments(score, SCORE)
    serve = sub.add_parser("serve", help=SERVE_HELP, description=SERVE_HELP)
    add_arguments(serve, SERVE)
    return parser


def _score(args: argparse.Namespace) -> int:
    """Read and check every doc and setting, then score, then print: an error prints no result."""
    from tqdm import tqdm

    from .attention import BackendUnavailable
    from .request import InvalidInput

    try:
        settings = from_args(args, SCORE)
        docs = read_docs(args.docs)
    except (OSError, ValueError) as e:
        return _fail(e)
    try:
        engine = settings.build_engine()
    except BackendUnavailable as e:
        return _fail(f"{e} (or pass --attention-fallback torch)")
    options = request_options(args)
    try:
        jobs = _tokenize(engine, args, docs, dataclasses.replace(options, top_n=0))  # top_n: below
    except InvalidInput as e:
        return _fail(e)
    schemes: set[str] = set()
    scored = []
    with tqdm(total=len(docs), unit="doc", file=sys.stderr, disable=len(docs) < CHUNK_DOCS) as bar:
        for start, job in jobs:
            (result,) = engine.score_batch([job])
            schemes.add(result.scheme)
            scored += [(start + d.index, d, result.scheme) for d in result.results]
            bar.update(len(result.results))
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


def _fail(error) -> int:
    print(f"error: {error}", file=sys.stderr)
    return 2


def _tokenize(
    engine: Engine, args: argparse.Namespace, docs: list[Doc], options: ScoreOptions
) -> list[tuple[int, Job]]:
    """(start, job) per chunk of CHUNK_DOCS docs, every chunk checked before any is scored; an
    InvalidInput names the doc by its index in the file (``docs[299].text``)."""
    from .request import InvalidInput, ScoreRequest

    jobs = []
    for start in range(0, max(len(docs), 1), CHUNK_DOCS):
        chunk = docs[start : start + CHUNK_DOCS]
        req = ScoreRequest(args.prompt, chunk, instruction=args.instruction, options=options)
        try:
            jobs.append((start, engine.tokenize(req)))
        except InvalidInput as e:
            where = re.sub(r"^docs\[(\d+)\]", lambda m, s=start: f"docs[{s + int(m[1])}]", e.field)
            raise InvalidInput(where, str(e).removeprefix(f"{e.field}: ")) from None
    return jobs


def read_docs(path: Path) -> list[Doc]:
    """The docs of a JSONL file. Blank lines are skipped; a doc's id is its "id" (a string as is,
    a number or other JSON value as its JSON text) or, missing or null, its index among the docs.
    A bad line raises ValueError naming ``path:line``."""
    from .request import Doc

    docs = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{n}: not UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f'{path}:{n}: expected an object with a "text" string')
            doc_id = obj.get("id")
            if doc_id is None:
                doc_id = str(len(docs))
            elif not isinstance(doc_id, str):
                doc_id = json.dumps(doc_id)
            docs.append(Doc(text=obj["text"], id=doc_id))
    return docs


if __name__ == "__main__":
    sys.exit(main())
