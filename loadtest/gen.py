"""Synthetic ScoreDocs request sets, seeded and reproducible, written as JSONL (one request per line).

Each line is the JSON form of a scorer.v1.ScoreDocsRequest with the proto's field names, so a file
can be replayed by ``loadtest.run``, sent with grpcurl, or edited by hand.

Lengths are in tokens. With ``--tokenizer`` (a checkpoint directory or a tokenizer.json) the text is
cut to the exact token count; without it, words are counted at ``--tokens-per-word``. With
``--token-ids`` docs carry token ids and the prompt is sent as ``prompt_token_ids`` (verbatim: no
template around it); lengths are then exact whatever the tokenizer.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from google.protobuf import json_format

from scorer.v1 import scorer_pb2

from . import schemes
from .words import WORDS

DEFAULT_ID_RANGE = (32, 256)  # byte-level tokens: ordinary, never special, in any vocabulary >= 256


@dataclass(frozen=True)
class Dist:
    """An integer distribution: fixed:N, uniform:A:B, lognormal:MEDIAN:SIGMA[:MAX], or an empirical sample."""

    kind: str
    params: tuple[float, ...] = ()
    values: tuple[int, ...] = ()

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        if self.kind == "fixed":
            out = np.full(size, self.params[0])
        elif self.kind == "uniform":
            out = rng.integers(int(self.params[0]), int(self.params[1]) + 1, size)
        elif self.kind == "lognormal":
            median, sigma, cap = self.params
            out = np.minimum(np.rint(rng.lognormal(math.log(median), sigma, size)), cap)
        else:
            out = rng.choice(np.asarray(self.values), size)
        return np.maximum(out.astype(np.int64), 1)

    def describe(self) -> str:
        if self.kind == "empirical":
            return f"empirical(n={len(self.values)}, median={int(np.median(self.values))})"
        return f"{self.kind}:" + ":".join(f"{p:g}" for p in self.params)


def parse_dist(spec: str, measure: TextSource | None = None) -> Dist:
    """``file:PATH`` holds one integer per line, or text whose lines' token lengths are sampled."""
    kind, _, rest = spec.partition(":")
    args = rest.split(":") if rest else []
    try:
        if kind.isdigit() and not rest:
            return Dist("fixed", (float(kind),))
        if kind == "fixed" and len(args) == 1:
            return Dist("fixed", (float(args[0]),))
        if kind == "uniform" and len(args) == 2 and 1 <= float(args[0]) <= float(args[1]):
            return Dist("uniform", (float(args[0]), float(args[1])))
        if kind == "lognormal" and len(args) in (2, 3) and float(args[0]) > 0 and float(args[1]) >= 0:
            cap = float(args[2]) if len(args) == 3 else math.inf
            return Dist("lognormal", (float(args[0]), float(args[1]), cap))
        if kind == "file" and rest:
            return Dist("empirical", values=_read_lengths(Path(rest), measure))
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"bad distribution {spec!r}: use N, fixed:N, uniform:A:B, lognormal:MEDIAN:SIGMA[:MAX] or file:PATH"
    )


def _read_lengths(path: Path, measure: TextSource | None) -> tuple[int, ...]:
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    if not lines:
        raise ValueError(f"{path} is empty")
    if all(ln.isdigit() for ln in lines):
        return tuple(int(ln) for ln in lines)
    counter = measure or TextSource(WORDS)
    return tuple(max(1, counter.count(ln)) for ln in lines)


class TextSource:
    """Text of a given token length: random words from a list, or windows of a corpus."""

    def __init__(
        self,
        words: Sequence[str],
        contiguous: bool = False,
        tokenizer: object | None = None,
        tokens_per_word: float = 1.3,
    ) -> None:
        if not words:
            raise ValueError("no words to draw text from")
        self.words = list(words)
        self.contiguous = contiguous
        self.tokenizer = tokenizer
        self.tokens_per_word = tokens_per_word
        if tokenizer is not None:
            sample = " ".join(self.words[:2000])
            self.tokens_per_word = max(0.5, self.count(sample) / len(sample.split()))

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return round(len(text.split()) * self.tokens_per_word)
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _words(self, rng: np.random.Generator, n: int) -> list[str]:
        if self.contiguous:
            start = int(rng.integers(len(self.words)))
            return [self.words[(start + k) % len(self.words)] for k in range(n)]
        return [self.words[k] for k in rng.integers(len(self.words), size=n)]

    def text(self, rng: np.random.Generator, n_tokens: int) -> str:
        n_words = max(1, round(n_tokens / self.tokens_per_word))
        if self.tokenizer is None:
            return " ".join(self._words(rng, n_words))
        ids = self._ids(rng, n_tokens, n_words)
        return self.tokenizer.decode(ids[:n_tokens])

    def _ids(self, rng: np.random.Generator, n_tokens: int, n_words: int) -> list[int]:
        words = self._words(rng, n_words + 8)
        ids = self.tokenizer.encode(" ".join(words), add_special_tokens=False).ids
        while len(ids) < n_tokens:
            words += self._words(rng, n_words + 8)
            ids = self.tokenizer.encode(" ".join(words), add_special_tokens=False).ids
        return ids[:n_tokens]

    def token_ids(self, rng: np.random.Generator, n_tokens: int, id_range: tuple[int, int]) -> list[int]:
        if self.tokenizer is None:
            return rng.integers(id_range[0], id_range[1], size=n_tokens).tolist()
        return self._ids(rng, n_tokens, max(1, round(n_tokens / self.tokens_per_word)))


def load_tokenizer(path: str) -> object:
    from tokenizers import Tokenizer

    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def parse_scheme_mix(spec: str) -> dict[str, float]:
    """``naive`` | ``naive,cascade`` (equal shares) | ``naive=3,cascade=1`` | ``all``."""
    if spec == "all":
        return dict.fromkeys(schemes(), 1.0)
    mix: dict[str, float] = {}
    for part in spec.split(","):
        name, _, weight = part.strip().partition("=")
        if name not in schemes():
            raise argparse.ArgumentTypeError(f"unknown scheme {name!r}; known: {', '.join(schemes())}")
        mix[name] = float(weight) if weight else 1.0
    if not mix or min(mix.values()) < 0 or sum(mix.values()) <= 0:
        raise argparse.ArgumentTypeError(f"bad scheme mix {spec!r}")
    return mix


@dataclass
class GenConfig:
    requests: int
    docs: Dist
    prompt_tokens: Dist
    doc_tokens: Dist
    schemes: dict[str, float]
    seed: int = 0
    distinct_prompts: int = 0
    prompt_reuse: int = 0  # each prompt serves this many consecutive calls (0: distinct_prompts')
    token_ids: bool = False
    id_range: tuple[int, int] = DEFAULT_ID_RANGE
    template: str = ""
    instruction: str = ""
    top_n: int = 0
    truncate: str = ""
    group_size: int = 0


def generate(cfg: GenConfig, source: TextSource) -> list[scorer_pb2.ScoreDocsRequest]:
    rng = np.random.default_rng(cfg.seed)
    names = list(cfg.schemes)
    weights = np.array([cfg.schemes[n] for n in names], dtype=float)
    scheme_idx = rng.choice(len(names), size=cfg.requests, p=weights / weights.sum())
    n_docs = cfg.docs.sample(rng, cfg.requests)
    reuse = cfg.prompt_reuse
    n_prompts = -(-cfg.requests // reuse) if reuse else cfg.distinct_prompts or cfg.requests
    prompt_lens = cfg.prompt_tokens.sample(rng, n_prompts)
    prompts = [_prompt(cfg, source, rng, int(n)) for n in prompt_lens]
    out = []
    for i in range(cfg.requests):
        req = scorer_pb2.ScoreDocsRequest(request_id=f"lt{cfg.seed}-{i:06d}", instruction=cfg.instruction)
        prompt = prompts[i // reuse if reuse else i % n_prompts]
        if cfg.token_ids:
            req.prompt_token_ids.extend(prompt)
        else:
            req.prompt = prompt
        for j, n in enumerate(cfg.doc_tokens.sample(rng, int(n_docs[i]))):
            doc = req.docs.add(id=f"d{j}")
            if cfg.token_ids:
                doc.token_ids.extend(source.token_ids(rng, int(n), cfg.id_range))
            else:
                doc.text = source.text(rng, int(n))
        o = req.options
        o.scheme, o.template, o.top_n = names[scheme_idx[i]], cfg.template, cfg.top_n
        o.truncate, o.group_size = cfg.truncate, cfg.group_size
        out.append(req)
    return out


def _prompt(cfg: GenConfig, source: TextSource, rng: np.random.Generator, n: int) -> str | list[int]:
    return source.token_ids(rng, n, cfg.id_range) if cfg.token_ids else source.text(rng, n)


def write_jsonl(requests: Sequence[scorer_pb2.ScoreDocsRequest], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)  # out/requests.jsonl in a fresh clone
    with path.open("w") as f:
        for req in requests:
            f.write(json_format.MessageToJson(req, preserving_proto_field_name=True, indent=None) + "\n")


def read_jsonl(path: Path) -> list[scorer_pb2.ScoreDocsRequest]:
    out = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json_format.Parse(line, scorer_pb2.ScoreDocsRequest()))
            except json_format.ParseError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    if not out:
        raise ValueError(f"{path} holds no requests")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.gen", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--docs", default="20", help="docs per request: N or a distribution (default 20)")
    p.add_argument("--prompt-tokens", default="30", help="query length: N or a distribution (default 30)")
    p.add_argument("--doc-tokens", default="lognormal:50:0.5", help="doc length distribution")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheme", default="auto", help="options.scheme: NAME, a mix a,b or a=3,b=1, or 'all'")
    p.add_argument(
        "--distinct-prompts", type=int, default=0, help="reuse K prompts in turn (0: all distinct)"
    )
    p.add_argument(
        "--prompt-reuse",
        type=int,
        default=0,
        help="each prompt serves K consecutive calls, then the next (one user's context over several"
        " queries: what the prefix cache keeps); 0: --distinct-prompts decides",
    )
    text = p.add_mutually_exclusive_group()
    text.add_argument("--words", type=Path, help="word list file (default: built-in list)")
    text.add_argument("--corpus", type=Path, help="text file; docs are windows of its words")
    p.add_argument("--tokenizer", help="checkpoint dir or tokenizer.json, for exact token counts")
    p.add_argument("--tokens-per-word", type=float, default=1.3, help="without --tokenizer (default 1.3)")
    p.add_argument("--token-ids", action="store_true", help="send token ids instead of text")
    p.add_argument("--id-range", default="{}:{}".format(*DEFAULT_ID_RANGE), help="LO:HI for random token ids")
    p.add_argument("--template", default="")
    p.add_argument("--instruction", default="")
    p.add_argument("--top-n", type=int, default=0)
    p.add_argument("--truncate", default="", choices=("", "error", "doc_end"))
    p.add_argument("--group-size", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be >= 1")
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    text_file = args.corpus or args.words
    words = text_file.read_text().split() if text_file else WORDS
    source = TextSource(words, args.corpus is not None, tokenizer, args.tokens_per_word)
    try:
        lo, hi = (int(x) for x in args.id_range.split(":"))
        cfg = GenConfig(
            requests=args.requests,
            docs=parse_dist(args.docs),
            prompt_tokens=parse_dist(args.prompt_tokens, source),
            doc_tokens=parse_dist(args.doc_tokens, source),
            schemes=parse_scheme_mix(args.scheme),
            seed=args.seed,
            distinct_prompts=args.distinct_prompts,
            prompt_reuse=args.prompt_reuse,
            token_ids=args.token_ids,
            id_range=(lo, hi),
            template=args.template,
            instruction=args.instruction,
            top_n=args.top_n,
            truncate=args.truncate,
            group_size=args.group_size,
        )
    except (argparse.ArgumentTypeError, ValueError, OSError) as e:
        parser.error(str(e))
    requests = generate(cfg, source)
    write_jsonl(requests, args.out)
    docs = [len(r.docs) for r in requests]
    schemes = Counter(r.options.scheme for r in requests)
    print(
        f"wrote {len(requests)} requests to {args.out}: docs/request mean {np.mean(docs):.1f} "
        f"(min {min(docs)}, max {max(docs)}), doc tokens {cfg.doc_tokens.describe()}, "
        f"schemes {dict(schemes)}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
