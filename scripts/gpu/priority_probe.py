"""Would a batch of short calls on a high-priority CUDA stream skip the wait behind a long prompt's
forward? On the served long repeated prompt (D-repeat) a call that reads its prompt from the cache
computes ~130 rows, yet waits for the ~30 ms forward of a new 8,000-token prompt launched ahead of
it on the engine's one stream: that wait is the tail that bounds the replica's rate at p99 100 ms
(bench/RESULTS.md, the cut-before-heavy runs).

Two engines of one checkpoint (each its own weights, attention backend, CUDA graphs and buffers,
as a second lane of an engine would need): HEAVY (one call of 8,000 prompt ids + 32 docs of 4) on
one, LIGHT (LIGHT_CALLS calls of 200 + 32 x 4, a read's size without a cache) on the other. Each
round times, launch to scores (medians of ROUNDS):

  alone        each batch by itself
  one stream   the light batch launched just after the heavy one on the same stream (the engine
               today: it waits for the heavy one)
  two streams  the heavy one on a stream of normal priority, the light one on a second stream of
               normal priority, launched just after
  priority     the same, the light one's stream of high priority (CUDA runs its blocks first as
               SMs free; nothing running is preempted)

    python3 scripts/gpu/priority_probe.py CKPT OUT.json [ROUNDS]"""

import json
import os
import random
import statistics
import sys
import time

import torch

from scorer.request import Doc, ScoreOptions, ScoreRequest
from scorer.runtime import build_engine

ckpt, out = sys.argv[1:3]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 20
LIGHT_CALLS = int(os.environ.get("LIGHT_CALLS", "3"))
heavy_engine, light_engine = build_engine(ckpt), build_engine(ckpt)
for e in (heavy_engine, light_engine):
    e.runner.capture_graphs()
vocab = heavy_engine.runner.model.config.vocab_size
rng = random.Random(1)


def call(engine, prompt: int):
    ids = lambda n: tuple(rng.randrange(1000, vocab - 1000) for _ in range(n))  # noqa: E731
    req = ScoreRequest(
        prompt="",
        prompt_token_ids=ids(prompt),
        docs=[Doc(token_ids=ids(4), id=str(i)) for i in range(32)],
        options=ScoreOptions(template="plain"),
    )
    return engine.tokenize(req)


def batches():
    return [call(heavy_engine, 8000)], [call(light_engine, 200) for _ in range(LIGHT_CALLS)]


def timed(engine, jobs, stream):
    """Launch ``jobs`` on ``stream``; returns (collect, launch time)."""
    with torch.cuda.stream(stream):
        t0 = time.perf_counter()
        collect = engine.launch(jobs)
    return collect, t0


def finish(collect, t0) -> float:
    collect()
    return (time.perf_counter() - t0) * 1e3


default = torch.cuda.current_stream()
normal, second = torch.cuda.Stream(), torch.cuda.Stream()
urgent = torch.cuda.Stream(priority=-1)  # torch's high priority (0: the default, low)
modes = {
    "alone": None,
    "one stream": (default, default),
    "two streams": (normal, second),
    "priority": (normal, urgent),
}
times = {m: {"heavy": [], "light": []} for m in modes}
for r in range(rounds + 2):  # two warm-up rounds
    for mode, streams in modes.items():
        heavy, light = batches()
        torch.cuda.synchronize()
        if streams is None:
            h = finish(*timed(heavy_engine, heavy, default))
            torch.cuda.synchronize()
            lt = finish(*timed(light_engine, light, default))
        else:
            ch = timed(heavy_engine, heavy, streams[0])
            cl = timed(light_engine, light, streams[1])
            lt = finish(*cl)
            h = finish(*ch)
        torch.cuda.synchronize()
        if r >= 2:
            times[mode]["heavy"].append(h)
            times[mode]["light"].append(lt)

summary = {mode: {k: round(statistics.median(v), 2) for k, v in t.items()} for mode, t in times.items()}
print(f"{'mode':<12} {'heavy ms':>9} {'light ms':>9}   (medians of {rounds}; light = {LIGHT_CALLS} calls)")
for mode, s in summary.items():
    print(f"{mode:<12} {s['heavy']:>9} {s['light']:>9}")
device = torch.cuda.get_device_name()
with open(out, "w") as f:
    json.dump({"device": device, "torch": torch.__version__, "rounds": rounds, "light_calls": LIGHT_CALLS,
               "medians_ms": summary, "samples_ms": times}, f, indent=1)  # fmt: skip
