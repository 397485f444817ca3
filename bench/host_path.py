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

``--workload long``: the long repeated prompt (an 8,000-id prompt and 32 docs of 4 ids, token ids,
each prompt reused by 10 calls in a row; ``LONG_GEN``) on a tiny model of 40,960 positions with
a prefix cache, each call as the split server handles it: parsed, converted and tokenized in a
front end (no cache there), its Job through the link (``for_engine``, pickled and unpickled, and
its answer back), then in the engine process peeked at the cache (``peek``), its batch reserved
on the cache (``reserve``) and planned on the pool (``plan``: the rest of ``_plan_on_cache``)
and its token ids laid out (``logical_tokens``), and the answer built (``respond``). Mean
milliseconds per call over the reuse pattern (a prompt's first call misses, its second writes
the cache, the rest read it), for prompts of each ``--prompt-tokens`` length, their calls
interleaved (a busy host slows them alike), and the host cost per 1,000 prompt ids between the
shortest and the longest; records appended to ``host_path_long.json`` under ``--label``.

    python -m bench.host_path [--calls 120] [--batch 6] [--out out/]
    python -m bench.host_path --workload long [--calls 200] [--prompt-tokens 2000,8000] [--label L] [--out D]
"""

from __future__ import annotations

import argparse
import gc
import pickle
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from scorer import readout
from scorer.engine import EngineConfig, Tokenizing, logical_tokens
from scorer.models.tiny import CONFIG, write_random_checkpoint
from scorer.runtime import build_engine
from scorer.server.batcher import Scored
from scorer.server.convert import request_from_proto, response_to_proto
from scorer.server.link import for_engine
from scorer.v1 import scorer_pb2 as pb

from .timing import append_records, environment, write_json

QWEN3_VOCAB = 151_669
STAGES = ("parse", "convert", "tokenize", "respond", "link", "plan", "plan_1_thread")
LONG_STAGES = ("parse", "convert", "tokenize", "link", "peek", "reserve", "plan", "logical_tokens", "respond")
LONG_GEN = (
    "--docs 32 --prompt-tokens 8000 --doc-tokens fixed:4 --token-ids --prompt-reuse 10 --template plain"
    " --seed 3"
)
"""The long repeated prompt, as ``loadtest.gen`` arguments (``scripts/gpu/prefix_cache.sh served``'s)."""
LONG_POSITIONS = 40_960  # Qwen3's
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


def long_checkpoint(root: Path) -> Path:
    """The embedded tiny model with Qwen3's 40,960 positions (an 8,000-id prompt fits), written
    under ``root`` once."""
    path = root / f"tiny-qwen3-{LONG_POSITIONS}"
    if not (path / "model.safetensors").is_file():
        tmp = Path(tempfile.mkdtemp(dir=root))
        write_random_checkpoint(tmp, CONFIG | {"max_position_embeddings": LONG_POSITIONS})
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    return path


def long_calls(n: int, seed: int = 3, prompt_tokens: int = 8000) -> list[bytes]:
    """``n`` calls of ``LONG_GEN`` (its prompts and docs drawn from ``seed``; prompts of
    ``prompt_tokens`` ids), serialized."""
    from loadtest.gen import main as gen_main
    from loadtest.gen import read_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "long.jsonl"
        args = [*LONG_GEN.split(), "--seed", str(seed), "--prompt-tokens", str(prompt_tokens)]
        gen_main(["--out", str(out), "--requests", str(n), *args])
        return [r.SerializeToString() for r in read_jsonl(out)]


def measure_long(engine, streams: dict[int, list[bytes]]) -> dict[int, tuple[dict[str, float], float]]:
    """Per stream (its prompt length: its calls), the mean ms per call of each stage of
    ``LONG_STAGES`` (see the module's doc) and the share of its prompt ids read from the cache. The
    streams' calls are interleaved, one of each in turn, so that each sees the host as the others."""
    front = Tokenizing(engine.tokenizer, engine.info)  # a front end's: no cache
    times = {n: {k: [] for k in LONG_STAGES} for n in streams}
    hits = dict.fromkeys(streams, 0)
    reserve = engine.cache.reserve
    now: dict[str, list[float]] = {}

    def timed(stage: str, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        now[stage].append((time.perf_counter() - t0) * 1e3)
        return out

    def timed_reserve(prompts):
        return timed("reserve", reserve, prompts)

    engine.cache.reserve = timed_reserve
    try:
        for i in range(max(map(len, streams.values()))):
            for n, calls in streams.items():
                if i >= len(calls):
                    continue
                now = times[n]
                msg = timed("parse", pb.ScoreDocsRequest.FromString, calls[i])
                req = timed("convert", request_from_proto, msg, str(i))
                job = timed("tokenize", front.tokenize, req)
                t0 = time.perf_counter()
                sent = _round_trip(for_engine(job))[0]
                link = time.perf_counter() - t0
                sent = timed("peek", engine.peeked, sent)
                t0 = time.perf_counter()
                plan, lease, cached = engine._plan_on_cache([sent])
                now["plan"].append((time.perf_counter() - t0) * 1e3 - now["reserve"][-1])
                timed("logical_tokens", logical_tokens, [sent], engine.device, cached)
                if lease is not None:
                    lease.release()
                hits[n] += cached[0] if cached else 0
                result = readout.result(job, [(-0.1, -2.0)] * len(job.items), cached[0] if cached else 0)
                scored = Scored(result, 0.0, 0.0, 1)
                t0 = time.perf_counter()
                _round_trip(scored)
                now["link"].append((link + time.perf_counter() - t0) * 1e3)
                timed("respond", _respond, job, scored)
    finally:
        del engine.cache.reserve
    return {
        n: ({k: statistics.fmean(v) for k, v in times[n].items()}, hits[n] / (n * len(streams[n])))
        for n in streams
    }


def main_long(a: argparse.Namespace) -> None:
    root = Path(tempfile.gettempdir()) / "scorer-bench"
    root.mkdir(exist_ok=True)
    config = EngineConfig(auto_policy="calibrated")
    engine = build_engine(long_checkpoint(root), "torch", "cpu", None, config=config, prefix_cache_mib=64)
    sizes = sorted(int(n) for n in a.prompt_tokens.split(","))
    # prompts of their own for each length (one seed's would share their heads) and for the warm-up
    seeds = {n: 3 + k for k, n in enumerate(reversed(sizes))}  # the longest: LONG_GEN's
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a GPU server's engine process (--host-threads 1)
    try:
        measure_long(engine, {n: long_calls(20, 100 + seeds[n], n) for n in sizes})  # first-use costs
        engine.cache.clear()
        # the heap frozen, as the serving processes freeze theirs once loaded (scoring.freeze_heap):
        # else a full collection of the engine's heap (~165 ms on the 2-core VM) lands in some
        # stage's mean, a different one run to run (0.16 or 0.95 ms of `reserve` a call)
        gc.collect()
        gc.freeze()
        measured = measure_long(engine, {n: long_calls(a.calls, seeds[n], n) for n in sizes})
    finally:
        torch.set_num_threads(threads)
    totals = {n: sum(ms.values()) for n, (ms, _) in measured.items()}
    per_1k = (totals[sizes[-1]] - totals[sizes[0]]) / (sizes[-1] - sizes[0]) * 1e3 if len(sizes) > 1 else None
    print(f"| code | prompt ids | {' | '.join(LONG_STAGES)} | total | prompt read from the cache |")
    print("|---|---:|" + "---:|" * (len(LONG_STAGES) + 2))
    for n, (ms, hit) in measured.items():
        cols = " | ".join(f"{ms[k]:.3f}" for k in LONG_STAGES)
        print(f"| {a.label} | {n} | {cols} | {totals[n]:.3f} | {hit:.1%} |")
    print(f"\nmean ms per call over {a.calls} calls of each prompt length, interleaved; torch on 1 thread")
    if per_1k is not None:
        print(f"host ms per 1,000 prompt ids ({sizes[0]} -> {sizes[-1]}): {per_1k:.3f}")
    if a.out:
        env = environment(engine.device)
        records = [
            {"label": a.label, "env": env, "calls": a.calls, "gen": LONG_GEN, "prompt_tokens": n, "ms": ms}
            | {"total_ms": totals[n], "cache_hit_share": hit, "ms_per_1k_prompt_ids": per_1k}
            for n, (ms, hit) in measured.items()
        ]
        append_records(a.out / "host_path_long.json", records)


def _respond(job, scored: Scored) -> bytes:
    return response_to_proto(job, "c", "m", scored, 0.0, 0.0).SerializeToString()


def _round_trip(*values) -> list:
    return [pickle.loads(pickle.dumps(v, pickle.HIGHEST_PROTOCOL)) for v in values]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=120)
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=6, help="calls per planned batch")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--workload", choices=("short", "long"), default="short")
    ap.add_argument("--label", default="", help="--workload long: the code measured, in its record")
    ap.add_argument(
        "--prompt-tokens",
        default="2000,8000",
        help="--workload long: the prompts' ids, comma-separated (interleaved; the host cost per 1,000"
        " ids from the shortest to the longest)",
    )
    a = ap.parse_args(argv)
    if a.workload == "long":
        return main_long(a)
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
