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

from scorer.engine import GPU_MIN_CACHE_READ_TOKENS, Engine, EngineConfig  # noqa: E402
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
    return off, {
        "copies": copies,
        "graphs": graphs,
        "seen-twice": Engine(off.runner, off.tokenizer, reads, cache=again),
        "declined": Engine(off.runner, off.tokenizer, off.config, cache=declines),  # the GPU's default
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


@pytest.mark.parametrize("writes", ["copies", "graphs", "seen-twice", "declined"])
@pytest.mark.parametrize("scheme", [*REGISTRY, "auto"])
def test_every_scheme_on_cached_kv_scores_as_without_the_cache(engines, scheme, writes, monkeypatch):
    from scorer.attention import kvpool

    off, on = engines[0], engines[1][writes]
    on.cache.clear()
    copies, write = [], kvpool.CachePool.write
    monkeypatch.setattr(kvpool.CachePool, "write", lambda pool, *a: copies.append(1) or write(pool, *a))
    reqs = calls(scheme, len(scheme), off.runner.model.config.vocab_size)
    want = [d.score for r in reqs for d in off.score(r).results]
    got, cached = [], 0
    for batch in (reqs[:2], reqs[2:]):  # the second call of the first batch reads the first's blocks
        for r in on.score_batch([on.tokenize(q) for q in batch]):
            got += [d.score for d in r.results]
            cached += r.usage.cached_prompt_tokens
    if writes == "seen-twice":  # blocks kept on their second sighting (call 2), read by call 4
        assert cached == 192
    elif writes == "declined":  # a batch's hit saves 192 rows (naive's, 6 * 192) of its forward
        assert on.min_cache_read == GPU_MIN_CACHE_READ_TOKENS
        assert cached + on.cache.stats["declined_tokens"] == 2 * 192
        if scheme != "auto":
            assert cached == (2 * 192 if REGISTRY[scheme].recomputes_prompt else 0)
    else:
        assert cached == 2 * 192  # calls 2 and 4 read context 0; call 3 is the first of context 1
    assert bool(copies) == (writes != "graphs")
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst < TOL, f"{scheme}: max |cache on - cache off| = {worst:.4f}"
    pairs = [(i, j) for i in range(len(want)) for j in range(i) if abs(want[i] - want[j]) > TOL]
    assert all((want[i] > want[j]) == (got[i] > got[j]) for i, j in pairs)
