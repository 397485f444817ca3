"""The prefix cache on the CPU: with it on, every scheme scores as with it off (fp32, 1e-4) whatever
was cached and evicted before; usage counts what it saved; leases keep what batches in flight read;
salts and ``prefix_cache=off`` keep calls apart."""

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scorer import metrics
from scorer.engine import Engine, EngineConfig
from scorer.planning import REGISTRY
from scorer.prefix_cache import (
    BLOCK,
    MIN_REUSE,
    RECENT,
    SPARE_SLOTS,
    PrefixCache,
    block_digests,
    prompt_key,
)
from scorer.request import Doc, ScoreOptions, ScoreRequest
from scorer.token_ids import TokenIds

SCHEMES = list(REGISTRY)
VOCAB = 256
TOL = 1e-4


@pytest.fixture(scope="module")
def off(engine):
    """The module's engine, its prefix cache off."""
    return engine


def cached_engine(off: Engine, capacity: int, admit: int = 1, **config) -> Engine:
    """``off``'s model and runner with a pool of ``capacity`` slots; ``admit``: the pool's sightings
    before it keeps a block (1 here: most tests are of what a cached prompt does)."""
    mc = off.runner.model.config
    cache = PrefixCache(
        capacity, mc.num_layers, mc.num_kv_heads, mc.head_dim, off.runner.dtype, off.device, admit=admit
    )
    cfg = EngineConfig(max_docs=64, max_doc_tokens=512, **config)
    return Engine(off.runner, off.tokenizer, cfg, cache=cache)


def request(prompt, docs, scheme="auto", **options) -> ScoreRequest:
    return ScoreRequest(
        prompt="",
        prompt_token_ids=tuple(prompt),
        docs=[Doc(token_ids=tuple(d), id=f"d{i}") for i, d in enumerate(docs)],
        options=ScoreOptions(scheme=scheme, template="plain", **options),
    )


def scores(result) -> list[float]:
    return [d.score for d in sorted(result.results, key=lambda d: d.index)]


def assert_close(a, b):
    assert len(a.results) == len(b.results)
    torch.testing.assert_close(
        torch.tensor(scores(a), dtype=torch.float64),
        torch.tensor(scores(b), dtype=torch.float64),
        atol=TOL,
        rtol=0,
    )


call_st = st.tuples(
    st.integers(0, 3),  # which of four contexts the prompt starts with
    st.integers(0, 40),  # tokens of its own after the context
    st.lists(st.integers(1, 30), min_size=1, max_size=6),  # doc lengths
    st.sampled_from(SCHEMES),
    st.integers(0, 2**16),  # seed of its tokens
)


@settings(max_examples=25)
@given(
    calls=st.lists(call_st, min_size=2, max_size=8),
    capacity=st.sampled_from([300, 700, 4000]),
    batch=st.integers(1, 3),
)
def test_every_scheme_scores_as_without_the_cache_whatever_it_holds(off, calls, capacity, batch):
    """Random calls over four shared contexts, batched, on a pool small enough to evict: each scores
    as alone without the cache."""
    on = cached_engine(off, capacity)
    rng = random.Random(len(calls))
    contexts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 120))] for _ in range(4)]
    reqs = []
    for ctx, own, doc_lens, scheme, seed in calls:
        r = random.Random(seed)
        prompt = contexts[ctx] + [r.randrange(VOCAB) for _ in range(own)]
        reqs.append(request(prompt, [[r.randrange(VOCAB) for _ in range(n)] for n in doc_lens], scheme))
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        got = on.score_batch([on.tokenize(r) for r in chunk])
        for r, result in zip(chunk, got, strict=True):
            assert_close(result, off.score(r))
    assert on.cache.free_slots + on.cache.cached_blocks * BLOCK == on.cache.capacity  # nothing leaked


def test_a_repeated_prompt_is_computed_once_and_usage_says_so(off):
    on = cached_engine(off, 4000)
    rng = random.Random(1)
    prompt = [rng.randrange(VOCAB) for _ in range(100)]
    docs = [[rng.randrange(VOCAB) for _ in range(10)] for _ in range(5)]
    first = on.score(request(prompt, docs, "ragged"))
    second = on.score(request(prompt, docs, "ragged"))
    assert first.usage.cached_prompt_tokens == 0
    assert first.usage.tokens_computed == 100 + 50
    assert second.usage.cached_prompt_tokens == 96  # whole blocks of 16
    assert second.usage.tokens_computed == 4 + 50
    assert second.usage.tokens_saved == 5 * 100 + 50 - (4 + 50)  # every doc alone, minus computed
    assert_close(first, second)


def test_calls_of_one_batch_with_the_same_new_prompt_compute_it_once(off):
    on = cached_engine(off, 4000)
    rng = random.Random(2)
    prompt = [rng.randrange(VOCAB) for _ in range(64)]
    docs = [[rng.randrange(VOCAB) for _ in range(8)] for _ in range(3)]
    before = off.runner.stats["tokens_computed"]
    a, b = on.score_batch([on.tokenize(request(prompt, docs, "multi_item")) for _ in range(2)])
    assert (a.usage.cached_prompt_tokens, b.usage.cached_prompt_tokens) == (
        0,
        48,
    )  # the last token is computed
    assert off.runner.stats["tokens_computed"] - before == 64 + 16 + 2 * 24
    assert_close(a, off.score(request(prompt, docs, "multi_item")))
    assert_close(b, a)


def test_by_default_a_prompt_seen_once_runs_off_the_pool_and_is_kept_when_seen_again(off, monkeypatch):
    """admit=2: a unique prompt writes nothing to the pool (its batch plans as with no cache); its
    second sighting writes the blocks seen before (off the pool, copying those rows alone); its
    third reads them (on the pool). A new query on a shared head keeps the head (seen twice) and
    not its own tail (seen once). Scores as without the cache."""
    from scorer.attention import kvpool

    on = cached_engine(off, 4000, admit=2)
    writes, write = [], kvpool.CachePool.write
    monkeypatch.setattr(kvpool.CachePool, "write", lambda pool, *a: writes.append(1) or write(pool, *a))
    rng = random.Random(11)
    prompt = [rng.randrange(VOCAB) for _ in range(40)]  # two whole blocks before its last token
    docs = [[rng.randrange(VOCAB) for _ in range(6)] for _ in range(3)]
    want = off.score(request(prompt, docs))
    first = on.score(request(prompt, docs))
    copied = on.runner.stats["pool_copy_passes"]  # the runner is ``off``'s, used by other tests
    assert first.usage.cached_prompt_tokens == 0 and on.cache.cached_blocks == 0
    assert not writes and on.runner.stats["pool_copy_passes"] == copied
    second = on.score(request(prompt, docs))
    assert second.usage.cached_prompt_tokens == 0 and on.cache.cached_blocks == 2
    assert not writes and on.runner.stats["pool_copy_passes"] == copied + 1
    third = on.score(request(prompt, docs))
    assert third.usage.cached_prompt_tokens == 32 and writes
    for r in (first, second, third):
        assert_close(r, want)
    head = [rng.randrange(VOCAB) for _ in range(32)]
    queries = [head + [rng.randrange(VOCAB) for _ in range(20)] for _ in range(3)]
    got = [on.score(request(q, docs)) for q in queries]
    assert [r.usage.cached_prompt_tokens for r in got] == [0, 0, 32]
    assert on.cache.cached_blocks == 2 + 2  # the head's two blocks; no query's own third block
    for q, r in zip(queries, got, strict=True):
        assert_close(r, off.score(request(q, docs)))
    on.cache.clear()  # forgets the sightings too: the prompt is new again
    other = [rng.randrange(VOCAB) for _ in range(40)]
    on.score(request(other, docs))
    on.cache.clear()
    assert on.score(request(other, docs)).usage.cached_prompt_tokens == 0 and on.cache.cached_blocks == 0


def test_admission_remembers_as_many_blocks_as_the_pool_holds():
    """A prompt set larger than the pool, cycled, would be written and evicted on every call
    without ever being read (least recently used first): its blocks are forgotten before they come
    back and nothing is written. A set the pool holds is written on its second round and read on
    its third."""

    def rounds(cache: PrefixCache, prompts, n: int) -> list[tuple[int, int]]:
        out = []
        for _ in range(n):
            hit = written = 0
            for p in prompts:
                hits, lease = cache.reserve([(p, "", ())])
                hit += hits[0].num_cached
                written += len(lease.written) * BLOCK
                lease.release()
            out.append((hit, written))
        return out

    rng = random.Random(5)
    big = [tuple(rng.randrange(VOCAB) for _ in range(5 * BLOCK + 1)) for _ in range(8)]  # 40 blocks
    cache = PrefixCache(32 * BLOCK, 1, 1, 8, torch.float32, torch.device("cpu"), admit=2)
    assert cache.seen_limit == 32
    assert rounds(cache, big, 4) == [(0, 0)] * 4
    small = big[:6]  # 30 blocks
    cache = PrefixCache(32 * BLOCK, 1, 1, 8, torch.float32, torch.device("cpu"), admit=2)
    assert rounds(cache, small, 3) == [(0, 0), (0, 30 * BLOCK), (30 * BLOCK, 0)]


def test_block_digests_are_equal_exactly_where_the_salt_and_every_id_up_to_the_block_end_are():
    """A block's digest stands for what the index's key held per block before (its parent's, the
    salt and its ids: so the salt and every id up to its end): on random prompt pairs that share a
    prefix of random length, under equal or different salts, digests are equal for exactly the
    blocks whose salt and ids up to their end are; and the same whatever the ids are held in."""
    rng = random.Random(11)
    for _ in range(300):
        n = rng.randrange(1, 10) * BLOCK + rng.randrange(BLOCK)
        a = [rng.randrange(VOCAB) for _ in range(n)]
        b = list(a)
        if rng.random() < 0.8:  # differ from a random id on (or be the same prompt)
            at = rng.randrange(n)
            b[at] = (b[at] + 1 + rng.randrange(VOCAB - 1)) % VOCAB
            b[at + 1 :] = [rng.randrange(VOCAB) for _ in b[at + 1 :]]
        salt_a, salt_b = rng.choice(("", "s", "t")), rng.choice(("", "s", "t"))
        blocks = n // BLOCK
        da = block_digests(TokenIds(a).data, salt_a, BLOCK, blocks)
        db = block_digests(TokenIds(tuple(b)).data, salt_b, BLOCK, blocks)
        for i in range(blocks):
            same = salt_a == salt_b and a[: (i + 1) * BLOCK] == b[: (i + 1) * BLOCK]
            assert (da[i] == db[i]) == same, (i, salt_a, salt_b)
        assert len(set(da)) == blocks  # no two blocks of a chain alike, even of equal ids
    same = [7] * (3 * BLOCK)
    assert len(set(block_digests(TokenIds(same).data, "", BLOCK, 3))) == 3


def test_the_salt_changes_every_digest_and_the_prompt_key():
    ids = TokenIds(range(1, 5 * BLOCK + 1))
    plain, salted = (block_digests(ids.data, s, BLOCK, 5) for s in ("", "tenant-a"))
    assert not set(plain) & set(salted)
    assert len({prompt_key(ids, s) for s in ("", "tenant-a", "tenant-b")}) == 3
    assert prompt_key(ids, "a") == prompt_key(TokenIds(list(ids)), "a")
    assert prompt_key(TokenIds(range(1, 5 * BLOCK + 2)), "a") != prompt_key(ids, "a")


def test_a_prompt_matched_lately_is_found_by_all_of_its_ids_and_its_salt():
    """The prompts matched lately are remembered (their digests, their blocks) under the digest of
    their salt and every id: a prompt that differs in one id, or in its salt, or that goes on
    longer, is matched block by block, never as the one remembered."""
    cache = PrefixCache(64 * BLOCK, 1, 1, 8, torch.float32, torch.device("cpu"), admit=1)
    rng = random.Random(4)
    prompt = [rng.randrange(VOCAB) for _ in range(10 * BLOCK + 1)]
    _, lease = cache.reserve([(TokenIds(prompt), "", ())])
    lease.release()
    assert cache.peek(TokenIds(prompt))[0] == 10 * BLOCK
    changed = list(prompt)
    changed[5 * BLOCK + 3] = (changed[5 * BLOCK + 3] + 1) % VOCAB
    assert cache.peek(TokenIds(changed))[0] == 5 * BLOCK
    assert cache.peek(tuple(prompt), "other")[0] == 0
    assert cache.peek(prompt + [1] * BLOCK)[0] == 10 * BLOCK  # its own 11th block is not cached
    cache._recent.clear()  # matched afresh, block by block: the same
    assert [cache.peek(p)[0] for p in (prompt, changed)] == [10 * BLOCK, 5 * BLOCK]


def test_a_prompt_s_digests_are_made_as_far_as_its_match_needs_and_all_when_it_is_seen():
    """A peek at a prompt whose first block is not cached hashes that block alone (a unique query
    on its way in); its reservation makes every digest (admission remembers them all), the same
    as ``block_digests``."""
    cache = PrefixCache(64 * BLOCK, 1, 1, 8, torch.float32, torch.device("cpu"), admit=2)
    prompt = TokenIds(range(1, 10 * BLOCK + 2))
    assert cache.peek(prompt)[0] == 0
    [(chain, _, _)] = cache._recent.values()
    assert len(chain.digests) == 1
    _, lease = cache.reserve([(prompt, "", ())])
    lease.release()
    assert chain.digests == block_digests(prompt.data, "", BLOCK, 10) and len(cache._seen) == 10


def test_a_hint_from_a_peek_holds_when_its_prompt_has_left_the_recent_ones():
    """A call's peek (its hint) and its batch's reservation may have other prompts between them,
    more than the cache remembers: the reservation matches past the hint as well."""
    cache = PrefixCache(64 * BLOCK, 1, 1, 8, torch.float32, torch.device("cpu"), admit=1)
    prompt = TokenIds(range(1, 10 * BLOCK + 2))
    _, lease = cache.reserve([(TokenIds(range(1, 4 * BLOCK + 2)), "", ())])  # its first 4 blocks
    lease.release()
    cached, hint = cache.peek(prompt)
    assert cached == 4 * BLOCK
    for i in range(RECENT):
        cache.peek(TokenIds([VOCAB + i] * 3))
    hits, lease = cache.reserve([(prompt, "", hint)])
    assert hits[0].num_cached == 4 * BLOCK and len(lease.written) == 6
    lease.release()
    assert cache.peek(prompt)[0] == 10 * BLOCK


def test_admit_is_auto_one_or_two(off):
    mc = off.runner.model.config
    with pytest.raises(ValueError, match="admit is auto, 1"):
        PrefixCache(400, mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.float32, off.device, admit=3)
    for admit, want in (("auto", "auto"), ("1", 1), (2, 2)):
        cache = PrefixCache(400, 1, 1, 8, torch.float32, torch.device("cpu"), admit=admit)
        assert cache.admit == want


def replay(cache: PrefixCache, prompts) -> tuple[int, int]:
    """Prompt tokens read from and written to ``cache`` by ``prompts``, one call a batch."""
    hit = written = 0
    for p in prompts:
        hits, lease = cache.reserve([(TokenIds(p), "", ())])
        hit += hits[0].num_cached
        written += len(lease.written) * BLOCK
        lease.release()
    return hit, written


def test_auto_admission_writes_a_repeated_prompt_on_its_first_sighting():
    """Each prompt reused by 10 calls in a row (the long repeated prompt's traffic): ``auto``
    writes a prompt's blocks on their first sighting, as admit=1 does, so 9 of each 10 calls read
    it; admit=2 reads it in 8."""
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(10 * BLOCK + 1)] for _ in range(40)]
    calls = [p for p in prompts for _ in range(10)]
    got = {}
    for admit in ("auto", 1, 2):
        cache = PrefixCache(64 * BLOCK, 1, 1, 8, torch.float32, torch.device("cpu"), admit=admit)
        got[admit] = replay(cache, calls)
        assert cache.stats["evictions"] > 0  # 400 blocks through a pool of 64
    assert got["auto"] == got[1] == (40 * 9 * 10 * BLOCK, 40 * 10 * BLOCK)
    assert got[2] == (40 * 8 * 10 * BLOCK, 40 * 10 * BLOCK)


def test_auto_admission_stops_writing_what_does_not_come_back():
    """Unique prompts on a shared head (A's traffic) and a set larger than the pool, cycled:
    ``auto`` writes on first sighting until the pool is full and the blocks it writes are evicted
    unread; then it writes nothing (as admit=2), while admit=1 writes every call. The cycled set
    keeps what the pool held when writing stopped: its blocks that come back are read (admit=2
    never wrote them). Blocks read only after more blocks than the pool holds arrived count as not
    come back: they lived because nothing was written."""
    rng = random.Random(2)
    head = [rng.randrange(VOCAB) for _ in range(3 * BLOCK)]
    unique = [head + [rng.randrange(VOCAB) for _ in range(16 * BLOCK + 1)] for _ in range(600)]
    cycled = [[rng.randrange(VOCAB) for _ in range(5 * BLOCK + 1)] for _ in range(30)]  # 150 blocks
    for admit in ("auto", 1, 2):
        a = PrefixCache(64 * BLOCK, 1, 1, 8, torch.float32, torch.device("cpu"), admit=admit)
        replay(a, unique[:300])
        hit, written = replay(a, unique[300:])
        assert hit == 300 * 3 * BLOCK  # the head
        assert written == (300 * 16 * BLOCK if admit == 1 else 0)
        b = PrefixCache(64 * BLOCK, 1, 1, 8, torch.float32, torch.device("cpu"), admit=admit)
        for _ in range(20):
            replay(b, cycled)
        hit, written = replay(b, cycled)
        assert written == (150 * BLOCK if admit == 1 else 0)
        assert hit == {"auto": 64 * BLOCK, 1: 0, 2: 0}[admit]
        if admit == "auto":
            assert not a.first_sight and not b.first_sight and a.reuse < MIN_REUSE and b.reuse < MIN_REUSE


def test_auto_admission_follows_the_traffic_back_to_first_sightings():
    """After unique traffic has turned first-sighting writes off, prompts that repeat again come
    back on their second sighting (the seen ones), and within a pool's worth of blocks ``auto``
    writes on first sighting again; ``clear`` starts it over."""
    rng = random.Random(3)
    cache = PrefixCache(64 * BLOCK, 1, 1, 8, torch.float32, torch.device("cpu"))
    replay(cache, [[rng.randrange(VOCAB) for _ in range(8 * BLOCK + 1)] for _ in range(100)])
    assert not cache.first_sight
    repeated = [[rng.randrange(VOCAB) for _ in range(8 * BLOCK + 1)] for _ in range(60)]
    flips = []
    for p in repeated:
        before = cache.first_sight
        replay(cache, [p] * 5)
        flips.append(before)
    assert not flips[0] and flips[-1]
    assert cache.reuse > MIN_REUSE
    assert metrics.REGISTRY.get_sample_value("scorer_prefix_cache_reuse") == cache.reuse
    cache.clear()
    assert cache.first_sight and cache.reuse == 1.0


def test_a_new_query_on_the_same_template_reuses_the_template_head(off):
    on = cached_engine(off, 4000)
    calls = [
        ScoreRequest(prompt=q, docs=[Doc(text="a shared prefix is computed once")])
        for q in ("first query", "another")
    ]
    first, second = (on.score(r) for r in calls)
    head = on.tokenize(calls[0]).prefix_ids
    other = on.tokenize(calls[1]).prefix_ids
    common = next(i for i, (x, y) in enumerate(zip(head, other, strict=False)) if x != y)
    assert first.usage.cached_prompt_tokens == 0
    assert second.usage.cached_prompt_tokens == common // BLOCK * BLOCK > 0
    assert_close(second, off.score(calls[1]))


def test_salts_never_share_and_off_neither_reads_nor_writes(off):
    on = cached_engine(off, 4000)
    prompt = list(range(1, 65))
    docs = [[5, 6, 7]]
    on.score(request(prompt, docs, cache_salt="tenant-a"))
    assert on.score(request(prompt, docs, cache_salt="tenant-b")).usage.cached_prompt_tokens == 0
    assert on.score(request(prompt, docs, cache_salt="tenant-a")).usage.cached_prompt_tokens == 48
    blocks, stats = on.cache.cached_blocks, dict(on.cache.stats)
    other = list(range(100, 164))
    assert on.score(request(other, docs, prefix_cache="off")).usage.cached_prompt_tokens == 0
    assert (
        on.score(request(prompt, docs, prefix_cache="off", cache_salt="tenant-a")).usage.cached_prompt_tokens
        == 0
    )
    assert (on.cache.cached_blocks, on.cache.stats) == (blocks, stats)  # nothing read, nothing written


def test_a_call_split_over_the_token_budget_reads_the_cache_too(off):
    on = cached_engine(off, 4000, max_tokens_per_pass=120)
    rng = random.Random(3)
    prompt = [rng.randrange(VOCAB) for _ in range(80)]
    docs = [[rng.randrange(VOCAB) for _ in range(20)] for _ in range(8)]
    for scheme in SCHEMES:
        if REGISTRY[scheme].explicit_mask:
            continue
        for _ in range(2):
            got = on.score(request(prompt, docs, scheme))
            assert_close(got, off.score(request(prompt, docs, scheme)))
        assert got.usage.cached_prompt_tokens == 64


def test_batches_in_flight_keep_what_they_read_and_a_full_pool_runs_off_it(off):
    """Batches launched before any is collected, on a pool of nine pages: the first writes its
    prompt's five blocks; the second (another prompt) gets the four pages left and evicts nothing
    the first holds; a third that reads the second's blocks needs scratch pages beside them, finds
    none it may take and runs on its own K/V. All score as without the cache, and once they are
    collected their blocks can go."""
    on = cached_engine(off, 144)
    rng = random.Random(4)
    p1, p2 = ([rng.randrange(VOCAB) for _ in range(96)] for _ in range(2))
    docs = [[rng.randrange(VOCAB) for _ in range(10)] for _ in range(2)]
    collect1 = on.launch([on.tokenize(request(p1, docs, "ragged"))])
    assert on.cache.cached_blocks == 95 // BLOCK == 5
    collect2 = on.launch([on.tokenize(request(p2, docs, "ragged"))])
    assert on.cache.cached_blocks == 9 and on.cache.stats["evictions"] == 0  # nothing of the first
    collect3 = on.launch([on.tokenize(request(p2, docs, "ragged"))])
    assert on.cache.stats["off_pool_batches"] == 1
    (r1,), (r2,), (r3,) = collect1(), collect2(), collect3()
    assert_close(r1, off.score(request(p1, docs, "ragged")))
    assert_close(r2, off.score(request(p2, docs, "ragged")))
    assert_close(r3, r2)
    assert r3.usage.cached_prompt_tokens == 0
    r4 = on.score(request(p2, docs, "ragged"))  # its scratch and last block evict the first's blocks
    assert r4.usage.cached_prompt_tokens == 64 and on.cache.stats["evictions"] > 0
    assert_close(r4, r2)


def test_a_batch_that_fails_to_launch_leaves_nothing_behind(off, monkeypatch):
    on = cached_engine(off, 4000)
    prompt = list(range(10, 74))

    def boom(*args, **kwargs):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(on.runner, "forward", boom)
    with pytest.raises(RuntimeError):
        on.score(request(prompt, [[1, 2]]))
    monkeypatch.undo()
    assert on.cache.cached_blocks == 0 and on.cache.free_slots == on.cache.capacity == 4000
    assert on.score(request(prompt, [[1, 2]])).usage.cached_prompt_tokens == 0  # its blocks were dropped


def test_the_rows_a_read_must_save_grow_with_the_batch(off):
    """The GPU's rule (``Engine.min_cache_read_rows``): a hit must save ``min_cache_read`` rows plus
    one per ``min_cache_read_rows`` rows of the batch computed whole, so the same 96-row hit is
    read by a call of 5 docs and computed by one of 30. Settings' ``auto`` sets the rule on a GPU
    only; a number is the threshold alone."""
    on = cached_engine(off, 4000, min_cache_read_tokens=80)
    assert on.min_cache_read_rows == 0  # a number given: no growth
    on.min_cache_read_rows = 10
    rng = random.Random(11)
    prompt = [rng.randrange(VOCAB) for _ in range(100)]
    docs = [[rng.randrange(VOCAB) for _ in range(10)] for _ in range(30)]
    on.score(request(prompt, docs[:5], "ragged"))  # writes 96 tokens' blocks
    few = on.score(request(prompt, docs[:5], "ragged"))  # 150 rows: 96 >= 80 + 15, read
    assert few.usage.cached_prompt_tokens == 96
    many = on.score(request(prompt, docs, "ragged"))  # 400 rows: 96 < 80 + 40, computed
    assert many.usage.cached_prompt_tokens == 0 and on.cache.stats["declined_tokens"] == 96
    assert_close(many, off.score(request(prompt, docs, "ragged")))
    auto = Engine(off.runner, off.tokenizer, replace(on.config, min_cache_read_tokens=None), cache=on.cache)
    assert (auto.min_cache_read, auto.min_cache_read_rows) == (0, 0)  # auto on the CPU: every hit read


def test_a_batch_whose_hits_save_too_few_rows_computes_its_prompts_and_still_writes(off):
    """``min_cache_read_tokens``: a batch whose hits would save fewer rows computes its prompts off
    the pool (usage: nothing cached) and still writes the blocks it was to write, after the cached
    ones, where a reader finds them; a batch whose hits save enough reads them."""

    def declined():
        return metrics.REGISTRY.get_sample_value("scorer_prefix_cache_declined_tokens_total") or 0.0

    on = cached_engine(off, 4000, min_cache_read_tokens=200)
    reader = Engine(
        off.runner, off.tokenizer, on.config.__class__(max_docs=64, max_doc_tokens=512), cache=on.cache
    )
    assert (on.min_cache_read, reader.min_cache_read) == (200, 0)  # the CPU's default: every hit read
    rng = random.Random(7)
    prompt = [rng.randrange(VOCAB) for _ in range(100)]
    docs = [[rng.randrange(VOCAB) for _ in range(10)] for _ in range(5)]
    on.score(request(prompt, docs, "ragged"))  # writes 96 tokens' blocks
    before = declined()
    again = on.score(request(prompt, docs, "ragged"))  # 96 rows saved < 200: computed
    assert again.usage.cached_prompt_tokens == 0 and again.usage.tokens_computed == 100 + 50
    assert on.cache.stats["declined_tokens"] == 96 and declined() - before == 96
    assert_close(again, off.score(request(prompt, docs, "ragged")))

    longer = prompt + [rng.randrange(VOCAB) for _ in range(60)]
    for scheme in ("multi_item", "cascade"):  # declined, it writes blocks 96-143 after the cached
        assert on.score(request(longer, docs, scheme)).usage.cached_prompt_tokens == 0
    read = reader.score(request(longer, docs, "ragged"))
    assert read.usage.cached_prompt_tokens == 144
    assert_close(read, off.score(request(longer, docs, "ragged")))

    three = on.score_batch([on.tokenize(request(prompt, docs, s)) for s in ("ragged", "naive", "grouped")])
    assert [r.usage.cached_prompt_tokens for r in three] == [96] * 3  # 96 + 5 * 96 + 96 rows saved
    for r, s in zip(three, ("ragged", "naive", "grouped"), strict=True):
        assert_close(r, off.score(request(prompt, docs, s)))
    assert on.cache.free_slots + on.cache.cached_blocks * BLOCK == on.cache.capacity  # nothing leaked

    # the batcher fills a pass by the rows left to compute: a read that keeps it in one is taken
    budget = Engine(off.runner, off.tokenizer, replace(on.config, max_tokens_per_pass=120), cache=on.cache)
    assert budget.score(request(prompt, docs, "ragged")).usage.cached_prompt_tokens == 96  # 150 rows > 120


def test_the_metrics_count_hits_lookups_evictions_and_bytes(off):
    def value(name, **labels):
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    before = {
        n: value(n)
        for n in ("scorer_prefix_cache_hit_tokens_total", "scorer_prefix_cache_lookup_tokens_total")
    }
    on = cached_engine(off, 150)
    prompt = list(range(1, 97))
    for _ in range(2):
        on.score(request(prompt, [[3, 4]]))
    assert (
        value("scorer_prefix_cache_hit_tokens_total") - before["scorer_prefix_cache_hit_tokens_total"] == 80
    )
    assert (
        value("scorer_prefix_cache_lookup_tokens_total") - before["scorer_prefix_cache_lookup_tokens_total"]
        == 192
    )
    assert value("scorer_prefix_cache_bytes", kind="capacity") == 144 * on.cache.slot_bytes  # whole pages
    assert value("scorer_prefix_cache_bytes", kind="used") == 80 * on.cache.slot_bytes
    evictions = value("scorer_prefix_cache_evictions_total")
    on.score(request(list(range(100, 196)), [[3, 4]]))
    assert value("scorer_prefix_cache_evictions_total") > evictions


def test_auto_costs_a_call_by_its_uncached_part(off):
    on = cached_engine(off, 4000)
    prompt = list(range(1, 130))
    docs = [[1, 2, 3]] * 4
    assert on.tokenize(request(prompt, docs)).shape.cached == 0
    on.score(request(prompt, docs))
    job = on.tokenize(request(prompt, docs))
    assert job.shape.cached == 128
    assert job.tokens == 1 + 4 * 3


def test_the_pool_is_sized_in_mib_and_zero_turns_it_off(off):
    mc = off.runner.model.config
    assert PrefixCache.for_model(0, mc, torch.float32, off.device) is None
    cache = PrefixCache.for_model(1, mc, torch.float32, off.device)
    assert cache.capacity == 2**20 // cache.slot_bytes
    spare = min(SPARE_SLOTS, cache.capacity)
    assert cache.k.shape == (mc.num_layers, cache.capacity + spare, mc.num_kv_heads, mc.head_dim)


def test_min_read_is_auto_or_a_count_of_tokens():
    from scorer.settings import Settings

    assert Settings().engine_config().min_cache_read_tokens is None  # the device's default
    assert Settings(prefix_cache_min_read="300").engine_config().min_cache_read_tokens == 300
    with pytest.raises(ValueError, match="prefix_cache_min_read.*not a number of tokens or auto"):
        Settings(prefix_cache_min_read="many")
    with pytest.raises(ValueError, match="prefix_cache_min_read.*less than 0"):
        Settings(prefix_cache_min_read="-1")


def test_graph_segments_write_the_pool_themselves(off, monkeypatch):
    """With the pool attached to the piecewise graphs (their segments run eagerly here, over the
    same buffers), a pass on the pool launches no K/V copy of its own, and every scheme still
    scores as without the cache, hits on what the segments wrote included; a pass over the
    largest bucket runs eagerly and copies as before."""
    from scorer.attention import kvpool
    from scorer.models.graphs import GraphedDecoder
    from scorer.runner import ModelRunner

    runner = ModelRunner(off.runner.model, off.runner.backend)
    runner.graphs = GraphedDecoder(off.runner.model, 128, capture=False)
    mc = off.runner.model.config
    cache = PrefixCache(
        700, mc.num_layers, mc.num_kv_heads, mc.head_dim, off.runner.dtype, off.device, admit=1
    )
    runner.capture_graphs(cache)
    on = Engine(runner, off.tokenizer, EngineConfig(max_docs=64, max_doc_tokens=512), cache=cache)
    copies, write = [], kvpool.CachePool.write
    monkeypatch.setattr(kvpool.CachePool, "write", lambda pool, *a: copies.append(1) or write(pool, *a))
    rng = random.Random(7)
    context = [rng.randrange(VOCAB) for _ in range(20)]
    # a pass off the pool writes nothing to it (its graphs used to send its K/V to the spare slots)
    cache.k.zero_(), cache.v.zero_()
    r = request(context, [[rng.randrange(VOCAB) for _ in range(4)]] * 3, "ragged", prefix_cache="off")
    assert_close(on.score(r), off.score(r))
    assert runner.graphs.stats["graphed_forwards"] == 1
    assert not cache.k.any() and not cache.v.any()
    assert not runner.graphs.stats["pool_written_forwards"]
    for scheme in SCHEMES:
        for own in (2, 8):
            prompt = context + [rng.randrange(VOCAB) for _ in range(own)]
            r = request(prompt, [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 5, 7)], scheme)
            assert_close(on.score(r), off.score(r))
    assert cache.stats["hit_tokens"] > 0 and not copies and runner.graphs.stats["pool_written_forwards"] > 0
    big = request(context, [[rng.randrange(VOCAB) for _ in range(60)] for _ in range(3)], "ragged")
    assert_close(on.score(big), off.score(big))
    assert copies and runner.graphs.stats["eager_forwards"] > 0


def test_a_call_queued_behind_its_prompts_first_call_is_counted_as_a_hit_once_that_one_is_planned(off):
    """Calls tokenized while their prompt's first call is still queued find nothing cached and
    count their whole prompt. ``repeeked`` (asked by the batcher as it cuts a batch) finds the
    blocks that call's planned batch indexed: the call then counts only its uncached rows, keeps
    its scores, and a call off the cache or already counted as cached is the same job."""
    engine = cached_engine(off, 4096)
    prompt = [5 + i % 90 for i in range(10 * BLOCK + 3)]
    first, later = (engine.tokenize(request(prompt, [[7, 8], [9]])) for _ in range(2))
    unused = engine.tokenize(request(prompt, [[7, 8]], prefix_cache="off"))
    assert later.shape.cached == 0 and later.tokens == len(prompt) + 3
    assert engine.repeeked(later) is later  # nothing cached yet
    collect = engine.launch([first])  # plans: indexes the prompt's blocks
    again = engine.repeeked(later)
    assert again.shape.cached == 10 * BLOCK and again.tokens == 3 + 3
    assert engine.repeeked(again) is again and engine.repeeked(unused) is unused
    collect()
    assert_close(engine.score_batch([again])[0], off.score(later.request))
