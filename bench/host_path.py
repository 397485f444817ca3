"""Host work of one call on the serving path, stage by stage, without the forward pass.

What a replica's CPU does per call besides the model (planning with torch's intra-op threads and
with one: its small ops lose to the threads' fork and join, and on a loaded host to waiting for
them): parse the protobuf, convert it, tokenize
and validate (with the ``auto`` choice), plan the batch it lands in, build and serialise the
answer; with ``--frontends`` the first three and the last run in a front-end process, and the
engine process adds the link: the Job and its result pickled and unpickled (``link``: both, both
ways). Calls like the GPU sweep's (20 docs of ~60 tokens on a 200-token prompt), as token ids
and as text, on the embedded model's tokenizer; ``auto`` uses the H200-calibrated cost model as
on a GPU. Median milliseconds per call (plan: per batch of ``--batch`` calls).

    python -m bench.host_path [--calls 120] [--batch 6] [--out out/]
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time
from pathlib import Path

import torch

from scorer import readout
from scorer.engine import EngineConfig
from scorer.runtime import build_engine
from scorer.server.batcher import Scored
from scorer.server.convert import request_from_proto, response_to_proto
from scorer.v1 import scorer_pb2 as pb

from .timing import environment, write_json

QWEN3_VOCAB = 151_669
STAGES = ("parse", "convert", "tokenize", "respond", "link", "plan", "plan_1_thread")
WORDS = ("search", "ranking", "model", "document", "query", "prefix", "shared", "attention", "page")


def tokens_per_word(tokenizer) -> float:
    """What a word of ``WORDS`` costs on the engine's tokenizer, so that the text calls have about
    the token counts of the token-id calls."""
    return len(tokenizer.encode(" " + " ".join(WORDS), add_special_tokens=False)) / len(WORDS)


def make_call(rng: random.Random, i: int, docs: int, text: bool, per_word: float) -> bytes:
    """A 200-token prompt of text and docs of token ids or text, at ``per_word`` tokens a word."""
    out = []
    for d in range(docs):
        n = max(8, int(rng.lognormvariate(4.1, 0.5)))
        if text:
            words = max(1, round(n / per_word))
            out.append(pb.Doc(id=f"d{d}", text=" ".join(rng.choice(WORDS) for _ in range(words))))
        else:
            out.append(pb.Doc(id=f"d{d}", token_ids=[rng.randrange(4, 250) for _ in range(n)]))
    prompt = " ".join(rng.choice(WORDS) for _ in range(round(200 / per_word)))
    return pb.ScoreDocsRequest(prompt=prompt, docs=out, request_id=f"call-{i}").SerializeToString()


def label_lookup(vocab_size: int) -> dict[str, float]:
    """The default labels' ids on a vocabulary of Qwen3's size: the dict that ``get_vocab()``
    builds on every call (what scored every call before) against ``request.label_ids``."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from scorer.request import ScoreOptions, label_ids

    vocab = {f"w{i}": i for i in range(vocab_size - 2)} | {"yes": vocab_size - 2, "no": vocab_size - 1}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token=None)))
    out = {}
    for name, fn in (
        ("get_vocab", lambda: [tok.get_vocab()[w] for w in ("yes", "no")]),
        ("lookup", lambda: label_ids(ScoreOptions(), tok, vocab_size)),
    ):
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1e3)
        out[name] = statistics.median(runs)
    return out


def measure(engine, calls: list[bytes], batch: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in STAGES}
    tokenized = []

    def timed(stage: str, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        times[stage].append((time.perf_counter() - t0) * 1e3)
        return out

    for i, raw in enumerate(calls):
        msg = timed("parse", pb.ScoreDocsRequest.FromString, raw)
        req = timed("convert", request_from_proto, msg, str(i))
        t = timed("tokenize", engine.tokenize, req)
        tokenized.append(t)
        result = readout.result(t, [(-0.1, -2.0)] * len(t.items))

        def respond(t=t, result=result, i=i):
            return response_to_proto(t, str(i), "m", Scored(result, 0.0, 0.0, batch), 0.0, 0.0)

        timed("respond", lambda: respond().SerializeToString())
        timed("link", _round_trip, t, Scored(result, 0.0, 0.0, batch))
    threads = torch.get_num_threads()
    for stage, n in (("plan", threads), ("plan_1_thread", 1)):
        torch.set_num_threads(n)
        for j in range(0, len(tokenized) - batch + 1, batch):
            timed(stage, engine.plan, tokenized[j : j + batch])
    torch.set_num_threads(threads)
    return {k: statistics.median(v) for k, v in times.items()}


def _round_trip(*values) -> list:
    return [pickle.loads(pickle.dumps(v, pickle.HIGHEST_PROTOCOL)) for v in values]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=120)
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=6, help="calls per planned batch")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    engine = build_engine(None, "torch", "cpu", None, config=EngineConfig(auto_policy="calibrated"))
    result = {"env": environment(engine.device), "docs": a.docs, "batch": a.batch, "ms": {}}
    print(
        "| input | parse | convert | tokenize (+auto) | respond | link"
        f" | plan ({torch.get_num_threads()} threads) | plan (1) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in ("token_ids", "text"):
        rng = random.Random(0)
        per_word = tokens_per_word(engine.tokenizer)
        calls = [make_call(rng, i, a.docs, kind == "text", per_word) for i in range(a.calls)]
        measure(engine, calls[: a.batch], a.batch)  # first-use costs
        ms = result["ms"][kind] = measure(engine, calls, a.batch)
        cols = " | ".join(f"{ms[k]:.3f}" for k in STAGES)
        print(f"| {kind} | {cols} |")
    result["label_lookup_ms"] = label_lookup(QWEN3_VOCAB)
    print(
        f"\nlabel ids on a {QWEN3_VOCAB:,}-entry vocabulary: get_vocab() dict (the old way) "
        f"{result['label_lookup_ms']['get_vocab']:.1f} ms, per-token lookup (now) "
        f"{result['label_lookup_ms']['lookup']:.4f} ms"
    )
    if a.out:
        write_json(a.out / "host_path.json", result)


if __name__ == "__main__":
    main()
