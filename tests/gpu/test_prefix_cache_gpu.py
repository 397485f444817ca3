"""The prefix cache on the GPU (bf16, FlashInfer, CUDA graphs): every scheme reading cached K/V
scores as the same engine without the cache, within the bf16 bounds and in the same order.
Skipped without CUDA and flashinfer."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from scorer.engine import (  # noqa: E402
    GPU_MIN_CACHE_READ_ROWS_PER_TOKEN,
    GPU_MIN_CACHE_READ_TOKENS,
    Engine,
    EngineConfig,
)
from scorer.planning import REGISTRY  # noqa: E402
from scorer.prefix_cache import PrefixCache  # noqa: E402
from scorer.request import Doc, ScoreOptions, ScoreRequest  # noqa: E402
from scorer.runtime import build_engine  # noqa: E402

TOL = 0.05


@pytest.fixture(scope="module")
def engines(checkpoint):
    off = build_engine(checkpoint, "flashinfer", "cuda", torch.bfloat16, EngineConfig())
    assert off.runner.capture_graphs() > 0 and off.cache is None
    mc = off.runner.model.config
    cache = PrefixCache(
        3000, mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.bfloat16, off.device, admit=1
    )
    reads = replace(off.config, min_cache_read_tokens=0)  # every hit read, however small
    copies = Engine(off.runner, off.tokenizer, reads, cache=cache)  # graphs without the pool
    graphs = build_engine(
        checkpoint,
        "flashinfer",
        "cuda",
        torch.bfloat16,
        reads,
        prefix_cache_mib=64,
        prefix_cache_admit=1,
    )
    assert graphs.runner.capture_graphs(graphs.cache) > 0  # the graphs write the pool themselves
    again = PrefixCache(
        3000, mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.bfloat16, off.device, admit=2
    )
    declines = PrefixCache(
        3000, mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.bfloat16, off.device, admit=1
    )
    default = replace(graphs.config, min_cache_read_tokens=None)  # the GPU's: small hits declined
    return off, {
        "copies": copies,
        "graphs": graphs,
        "seen-twice": Engine(off.runner, off.tokenizer, reads, cache=again),
        # as served: the graphs write the pool, so a declined batch's kept rows go through their
        # pool-write step (passes of up to GRAPH_COPY_ROWS rows, as every batch here)
        "declined": Engine(graphs.runner, graphs.tokenizer, default, cache=graphs.cache),
        # graphs without the pool: a declined batch copies its kept rows eagerly (index_copy_)
        "declined-eager": Engine(off.runner, off.tokenizer, off.config, cache=declines),
    }


def calls(scheme: str, seed: int, vocab: int) -> list[ScoreRequest]:
    """Three calls on one 200-token context with a query of their own, and one on another."""
    rng = random.Random(seed)
    contexts = [[rng.randrange(vocab) for _ in range(200)] for _ in range(2)]
    out = []
    for ctx in (0, 0, 1, 0):
        prompt = contexts[ctx] + [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        docs = [
            Doc(token_ids=tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 40)))) for _ in range(6)
        ]
        out.append(
            ScoreRequest(
                "",
                docs,
                prompt_token_ids=tuple(prompt),
                options=ScoreOptions(scheme=scheme, template="plain", score_mode="logprob"),
            )
        )
    return out


SENTINEL = 7.0
"""What the pool holds before a declined variant runs: a slot still holding it was never written."""


@pytest.mark.parametrize("writes", ["copies", "graphs", "seen-twice", "declined", "declined-eager"])
@pytest.mark.parametrize("scheme", [*REGISTRY, "auto"])
def test_every_scheme_on_cached_kv_scores_as_without_the_cache(engines, scheme, writes, monkeypatch):
    """A batch on the pool writes it through ``CachePool.write`` (eager passes) or its graphs
    (``CachePool.read`` of what they wrote). A declined batch (its hits save fewer rows than
    ``min_cache_read``) plans off the pool, never touches it through ``CachePool``, and writes the
    rows the cache keeps from its own K/V (``Pass.copies``): through the graphs' pool-write step
    where the graphs write the pool, else eagerly. Either way the kept blocks hold the right K/V:
    a later call reads them and scores as without the cache."""
    from scorer.attention import kvpool

    off, on = engines[0], engines[1][writes]
    on.cache.clear()
    declining = writes.startswith("declined")
    if declining:
        on.cache.k.fill_(SENTINEL)
        on.cache.v.fill_(SENTINEL)
    pool_io, write, read = [], kvpool.CachePool.write, kvpool.CachePool.read
    monkeypatch.setattr(
        kvpool.CachePool, "write", lambda pool, *a: pool_io.append("write") or write(pool, *a)
    )
    monkeypatch.setattr(kvpool.CachePool, "read", lambda pool, *a: pool_io.append("read") or read(pool, *a))
    copy_passes = on.runner.stats["pool_copy_passes"]
    graph_writes = on.runner.graphs.stats["pool_written_forwards"]
    reqs = calls(scheme, len(scheme), off.runner.model.config.vocab_size)
    want = [d.score for r in reqs for d in off.score(r).results]
    got, cached = [], 0
    for batch in (reqs[:2], reqs[2:]):  # the second call of the first batch reads the first's blocks
        for r in on.score_batch([on.tokenize(q) for q in batch]):
            got += [d.score for d in r.results]
            cached += r.usage.cached_prompt_tokens
    if writes == "seen-twice":  # blocks kept on their second sighting (call 2), read by call 4
        assert cached == 192
    elif declining:  # a batch's hit saves 192 rows (naive's, 6 * 192) of its forward
        declined = on.cache.stats["declined_tokens"]
        assert (on.min_cache_read, on.min_cache_read_rows) == (
            GPU_MIN_CACHE_READ_TOKENS,
            GPU_MIN_CACHE_READ_ROWS_PER_TOKEN,
        )
        assert cached + declined == 2 * 192
        if scheme != "auto":
            assert cached == (2 * 192 if REGISTRY[scheme].recomputes_prompt else 0)
    else:
        assert cached == 2 * 192  # calls 2 and 4 read context 0; call 3 is the first of context 1
    if not declining:
        assert ("write" in pool_io) == (writes != "graphs")
    else:
        graphed = on.runner.graphs.stats["pool_written_forwards"] - graph_writes
        layers = on.cache.k[:, : on.cache.capacity]
        written = (layers != SENTINEL).flatten(2).any(-1).sum(1).tolist()  # slots written, per layer
        kept = on.cache.cached_blocks * on.cache.block
        assert kept >= 2 * 192  # both contexts' blocks, at least
        if not cached:  # every hit declined: both batches computed their prompts off the pool
            assert not pool_io
            assert on.runner.stats["pool_copy_passes"] - copy_passes >= 2  # each batch kept rows
            assert written == [kept] * len(written)  # the kept blocks' slots, every layer, no other
            assert (graphed >= 2) if writes == "declined" else (graphed == 0)
        else:  # the hits were read on the pool (scratch slots for the batch's own rows too)
            assert pool_io
            assert min(written) >= kept
        reader = Engine(on.runner, on.tokenizer, replace(on.config, min_cache_read_tokens=0), cache=on.cache)
        again = reader.score(reqs[3])  # call 4 again: context 0's blocks and those after its hit
        assert again.usage.cached_prompt_tokens >= 192
        reread = [d.score for d in again.results]
        assert all(abs(a - b) < TOL for a, b in zip(reread, want[-len(reread) :], strict=True)), reread
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst < TOL, f"{scheme}: max |cache on - cache off| = {worst:.4f}"
    pairs = [(i, j) for i in range(len(want)) for j in range(i) if abs(want[i] - want[j]) > TOL]
    assert all((want[i] > want[j]) == (got[i] > got[j]) for i, j in pairs)
