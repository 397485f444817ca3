"""What the prefix cache costs a batch that barely uses it (the served E ran at 0.88 of
its engine with the cache on, 0.98 with it off). The serving engine (Settings as `scorer serve`
builds it, cache on) runs batches of E's calls (11 of 200 + 20 x 60 tokens, 15,400 tokens, as a
saturated batcher cuts them), pipelined as the batcher runs them, in states of the cache:

  off        every call with prefix_cache="off"
  new        prompts never seen (the cache looks and keeps nothing: off the pool)
  insert     prompts seen once before (admitted now: writing them, off the pool)
  hit        prompts cached whole (on the pool, reading them)
  mixed      `hit` for 3 calls of the 11 (E's served hit rate was ~22%), `new` for the rest
  insert-scattered, mixed-scattered: the same with the pool's free pages shuffled first (a
             served pool some 40 GB full hands a batch's scratch rows pages all over it)

and prints docs/s, and each state's plan: passes, attention calls a pass, rows, the calls' kinds.
    CALLS=3,11 STATES=off,insert python3 scripts/gpu/cache_probe.py CKPT OUT.json [BATCHES] [ROUNDS]
CALLS: calls a batch, each in turn (default 11; the served E's batches below saturation held ~3);
STATES: the states to run (default all); CACHE_MIB: the pool's size (default auto; 0: no cache, the
state "off" then runs the engine `--prefix-cache-mib 0` serves with, its CUDA graphs writing no pool)."""

import json
import os
import random
import sys
import time
from dataclasses import replace

import torch

from scorer.request import Doc, ScoreOptions, ScoreRequest
from scorer.server.scoring import ready_engine
from scorer.settings import Settings

ckpt, out = sys.argv[1:3]
batches = int(sys.argv[3]) if len(sys.argv) > 3 else 30
# admit 2: the states below are those of a prompt's first, second and later sightings under it
engine = ready_engine(
    Settings(model=ckpt or None, prefix_cache_mib=os.environ.get("CACHE_MIB", "auto"), prefix_cache_admit=2)
)
vocab = engine.runner.model.config.vocab_size
rng = random.Random(1)
PROMPT, DOCS, DOC = 200, 20, 60
CALLS = 11


def call(off: bool = False) -> ScoreRequest:
    ids = lambda n: tuple(rng.randrange(1000, vocab - 1000) for _ in range(n))  # noqa: E731
    return ScoreRequest(
        prompt="",
        prompt_token_ids=ids(PROMPT),
        docs=[Doc(token_ids=ids(DOC), id=str(i)) for i in range(DOCS)],
        options=ScoreOptions(template="plain", prefix_cache="off" if off else ""),
    )


def describe(jobs) -> dict:
    plan, lease, cached = engine._plan_on_cache(jobs)
    if lease is not None:
        lease.abort()
    return {
        "on_pool": lease is not None,
        "passes": len(plan.passes),
        "rows": [p.num_rows for p in plan.passes],
        "calls_per_pass": [len(p.calls) for p in plan.passes],
        "call_kinds": [
            sorted(
                {
                    ("mi" if c.multi_item else "mask" if c.custom_mask else "causal" if c.causal else "full")
                    for c in p.calls
                }
            )
            for p in plan.passes
        ],
        "schemes": sorted({j.scheme.name if hasattr(j.scheme, "name") else str(j.scheme) for j in jobs}),
        "cached_tokens": sum(cached) if cached else 0,
    }


def state_batches(state: str) -> list[list[ScoreRequest]]:
    """``batches`` + 1 batches in ``state``: the first one is for ``describe`` (whose look-up
    counts as a sighting), the rest are timed."""
    if state.endswith("-scattered"):
        state = state.removesuffix("-scattered")
        rng.shuffle(engine.cache._free)
    elif engine.cache is not None:  # as a new pool hands them out: lowest first
        engine.cache._free.sort(reverse=True)
    out = []
    for _ in range(batches + 1):
        b = [call(off=state == "off") for _ in range(CALLS)]
        if state == "insert":
            engine.score_batch([engine.tokenize(r) for r in b])  # first sighting: remembered
            b = [
                replace(r, docs=[Doc(token_ids=tuple(reversed(d.token_ids)), id=d.id) for d in r.docs])
                for r in b
            ]
        elif state in ("hit", "mixed"):
            k = CALLS if state == "hit" else 3
            for _ in range(2):  # seen twice: cached
                engine.score_batch([engine.tokenize(r) for r in b[:k]])
        out.append(b)
    return out


def run(reqs: list[list[ScoreRequest]]) -> tuple[float, dict]:
    """Each batch tokenized just before its launch (the cache hint as the server sees it), the
    next launched before the last is collected, as the batcher does."""
    plan = describe([engine.tokenize(r) for r in reqs[0]])
    torch.cuda.is_available() and torch.cuda.synchronize()
    t0, waiting, docs = time.perf_counter(), None, 0
    for b in reqs[1:]:
        jobs = [engine.tokenize(r) for r in b]
        launched = engine.launch(jobs)
        if waiting is not None:
            docs += sum(len(r.results) for r in waiting())
        waiting = launched
    docs += sum(len(r.results) for r in waiting())
    return docs / (time.perf_counter() - t0), plan


ALL = ("off", "new", "insert", "hit", "mixed", "insert-scattered", "mixed-scattered")
rows = []
for CALLS in map(int, os.environ.get("CALLS", "11").split(",")):  # noqa: N816 (read by state_batches)
    for rnd in range(int(sys.argv[4]) if len(sys.argv) > 4 else 2):
        for state in os.environ.get("STATES", ",".join(ALL)).split(","):
            reqs = state_batches(state)
            rate, plan = run(reqs)
            row = {"calls": CALLS, "round": rnd, "state": state, "docs_s": round(rate, 1), **plan}
            print(
                json.dumps({k: row[k] for k in ("calls", "round", "state", "docs_s", "on_pool", "rows")}),
                flush=True,
            )
            rows.append(row)
with open(out, "w") as f:
    json.dump({"rows": rows, "stats": dict(engine.cache.stats) if engine.cache else None}, f, indent=1)
