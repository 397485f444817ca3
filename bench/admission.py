"""The prefix cache's admission rules on traffic shapes: what each reads and writes.

Replays calls' prompts through the cache's index alone (``PrefixCache.reserve`` and ``release``,
one call a batch; a pool of ``--pool-blocks`` blocks of 16 tokens, no model) under
``--prefix-cache-admit`` 2, 1 and auto, and reports per traffic shape and rule the share of prompt
tokens read from the cache, the share written to it, the share of blocks that came back (what
auto weighs, under every rule) and whether auto writes on first sighting at the end. Shapes
(random ids, seeded):

  repeat10   8,000-token prompts, each used by 10 calls in a row (the served long repeated prompt)
  unique     300-token prompts on a shared 48-token template head, 4,000 of them cycled three
             times (A's served sweeps: more prompts than the pool holds)
  mixed      repeat10's calls interleaved with as many unique 8,000-token prompts
  hot        2,000-token prompts: half the calls from 20 hot ones, half unique

The pool's 16,384 blocks (262,144 tokens) are about what ``--prefix-cache-mib auto`` gives
Qwen3-0.6B on an 80 GB GPU. A read saves a prompt's compute and a write costs a copy of its rows
(bench/RESULTS.md, The prefix cache), so the rule to want reads most and writes least.

    python -m bench.admission --out out/
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from scorer.prefix_cache import BLOCK, PrefixCache
from scorer.token_ids import TokenIds

from .timing import write_json

ADMITS = (2, 1, "auto")
SHAPES = ("repeat10", "unique", "mixed", "hot")


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 150_000) for _ in range(n)]


def traffic(shape: str, scale: float, seed: int = 0) -> list[list[int]]:
    """The prompts of ``shape``'s calls, in order; ``scale``: the share of its calls (tests)."""
    rng = random.Random(seed)
    n = lambda k: max(2, int(k * scale))  # noqa: E731
    if shape == "repeat10":
        return [p for p in (_ids(rng, 8000) for _ in range(n(100))) for _ in range(10)]
    if shape == "unique":
        head = _ids(rng, 48)
        prompts = [head + _ids(rng, 252) for _ in range(n(4000))]
        return prompts * 3
    if shape == "mixed":
        out = []
        for p in (_ids(rng, 8000) for _ in range(n(50))):
            for _ in range(10):
                out += [p, _ids(rng, 8000)]
        return out
    if shape == "hot":
        hot = [_ids(rng, 2000) for _ in range(20)]
        return [rng.choice(hot) if rng.random() < 0.5 else _ids(rng, 2000) for _ in range(n(2000))]
    raise ValueError(f"shape is one of {', '.join(SHAPES)}, not {shape!r}")


def replay(cache: PrefixCache, prompts: list[list[int]]) -> dict:
    """The prompt tokens ``prompts`` read from and wrote to ``cache``, as shares of those looked up."""
    looked = read = written = 0
    for p in prompts:
        hits, lease = cache.reserve([(TokenIds(p), "", ())])
        looked += len(p)
        read += hits[0].num_cached
        written += len(lease.written) * BLOCK
        lease.release()
    return {
        "calls": len(prompts),
        "read_share": round(read / looked, 4),
        "written_share": round(written / looked, 4),
        "evicted_blocks": cache.stats["evictions"],
        "reuse": round(cache.reuse, 4),
        "first_sight_at_end": cache.first_sight,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--pool-blocks", type=int, default=16384)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--scale", type=float, default=1.0, help="the share of each shape's calls to replay")
    a = ap.parse_args(argv)
    rows, cpu = [], torch.device("cpu")
    for shape in a.shapes.split(","):
        prompts = traffic(shape, a.scale)
        for admit in ADMITS:
            cache = PrefixCache(a.pool_blocks * BLOCK, 1, 1, 8, torch.float32, cpu, admit=admit)
            rows.append({"shape": shape, "admit": str(admit), **replay(cache, prompts)})
    print(f"pool of {a.pool_blocks} blocks ({a.pool_blocks * BLOCK} tokens)\n")
    print(
        "| traffic | calls | admit | prompt read | prompt written | blocks evicted | came back"
        " | auto: first sighting at end |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for r in rows:
        reuse = f"{r['reuse']:.3f}"
        first = ("yes" if r["first_sight_at_end"] else "no") if r["admit"] == "auto" else ""
        print(
            f"| {r['shape']} | {r['calls']} | {r['admit']} | {r['read_share']:.1%} "
            f"| {r['written_share']:.1%} | {r['evicted_blocks']} | {reuse} | {first} |"
        )
    result = {"pool_blocks": a.pool_blocks, "scale": a.scale, "rows": rows}
    write_json(a.out / "admission.json", result)
    return result


if __name__ == "__main__":
    main()
