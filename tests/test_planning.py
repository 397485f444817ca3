"""Planner metadata on the article's worked example, invariants, and every scheme's attention
rows against the naive oracle on random shapes (torch reference backend)."""

import dataclasses
from itertools import chain

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from replay import replay_attention

from scorer.attention.base import HeadSpec
from scorer.attention.kvpool import KVPool
from scorer.attention.torch_ref import TorchBackend, request_mask
from scorer.planning import REGISTRY, PlanError, Shape, base, check_plan, combine, get
from scorer.planning.base import ItemLoc, MultiItem, call, multi_item_meta, with_score_rows
from scorer.planning.packbits import multi_item_mask, pack_segments, unpack_segment
from scorer.planning.split import chunk_items, split_to_budget

EXAMPLE = [Shape(96, (4, 4))]
CONCRETE = [s for s in REGISTRY if s != "naive"] + ["grouped:1", "grouped:3"]


def _plan(name: str, shapes):
    scheme, _, g = name.partition(":")
    return get(scheme).planner(int(g or 8))(shapes)


def ints(t: torch.Tensor) -> list[int]:
    return t.tolist()


def test_ragged_worked_example_matches_article():
    (p,) = REGISTRY["ragged"].plan(EXAMPLE).passes
    (c,) = p.calls
    assert ints(c.qo_indptr) == [0, 100, 104]
    assert ints(c.kv_indptr) == [0, 100, 200]
    assert ints(c.kv_indices) == list(range(100)) + list(range(96)) + list(range(100, 104))
    assert c.causal and c.multi_item is None


def test_multi_item_worked_example_matches_article():
    (p,) = REGISTRY["multi_item"].plan(EXAMPLE).passes
    (c,) = p.calls
    assert ints(c.qo_indptr) == [0, 104] and ints(c.kv_indptr) == [0, 104]
    assert ints(c.kv_indices) == list(range(104))
    assert ints(c.multi_item.token_pos_in_items) == [1, 2, 3, 4, 1, 2, 3, 4]
    assert c.multi_item.token_pos_in_items_len == 8
    assert ints(c.multi_item.max_item_len) == [4]
    assert ints(c.multi_item.prefix_len) == [96]


def test_cascade_worked_example_has_three_levels():
    (p,) = REGISTRY["cascade"].plan(EXAMPLE).passes
    prefix, shared, unique = p.calls
    assert prefix.rows == (0, 96) and prefix.causal and ints(prefix.qo_indptr) == [0, 96]
    assert ints(prefix.kv_indices) == list(range(96))
    assert shared.rows == (96, 104) and not shared.causal
    assert ints(shared.qo_indptr) == [0, 8] and ints(shared.kv_indices) == list(range(96))
    assert unique.rows == (96, 104) and unique.causal
    assert ints(unique.qo_indptr) == [0, 4, 8] and ints(unique.kv_indices) == list(range(96, 104))
    assert p.merge_groups() == [[0], [1, 2]]


def test_naive_worked_example_recomputes_prefix():
    (p,) = REGISTRY["naive"].plan(EXAMPLE).passes
    (c,) = p.calls
    assert ints(c.qo_indptr) == [0, 100, 200] and ints(c.kv_indices) == list(range(200))
    assert ints(p.logical[:96]) == ints(p.logical[100:196]) == list(range(96))


def test_split_cache_worked_example_is_two_passes():
    first, second = REGISTRY["split_cache"].plan(EXAMPLE).passes
    assert ints(first.calls[0].qo_indptr) == [0, 100] and first.slot_offset == 0
    assert second.slot_offset == 100 and ints(second.logical) == list(range(100, 104))
    (c,) = second.calls
    assert ints(c.qo_indptr) == [0, 4] and ints(c.kv_indices) == list(range(96)) + list(range(100, 104))


def test_custom_mask_worked_example_packs_the_multi_item_mask():
    (p,) = REGISTRY["custom_mask"].plan(EXAMPLE).passes
    (c,) = p.calls
    assert ints(c.custom_mask.indptr) == [0, (104 * 104 + 7) // 8]
    mask = unpack_segment(c.custom_mask, 0, 104, 104)
    assert torch.equal(mask, multi_item_mask(96, [4, 4]))
    assert mask[100, 99].item() is False and mask[100, 95].item() is True and mask[99, 96].item() is True


def test_grouped_spans_ragged_and_multi_item():
    shapes = [Shape(5, (2, 3, 1, 4))]
    g1, rag = (
        get("grouped").planner(1)(shapes).passes[0].calls[0],
        REGISTRY["ragged"].plan(shapes).passes[0].calls[0],
    )
    assert ints(g1.qo_indptr) == ints(rag.qo_indptr) and ints(g1.kv_indices) == ints(rag.kv_indices)
    g4, mi = (
        get("grouped").planner(4)(shapes).passes[0].calls[0],
        REGISTRY["multi_item"].plan(shapes).passes[0].calls[0],
    )
    assert ints(g4.qo_indptr) == ints(mi.qo_indptr)
    assert ints(g4.multi_item.token_pos_in_items) == ints(mi.multi_item.token_pos_in_items)
    g2 = get("grouped").planner(2)(shapes).passes[0].calls[0]
    assert ints(g2.qo_indptr) == [0, 10, 15]
    assert ints(g2.kv_indices) == list(range(10)) + list(range(5)) + list(range(10, 15))
    assert ints(g2.multi_item.token_pos_in_items) == [1, 2, 1, 2, 3, 1, 1, 2, 3, 4]
    assert ints(g2.multi_item.max_item_len) == [3, 4]


def test_packbits_little_bit_order_per_segment():
    a = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)  # 9 bits -> 2 bytes
    b = torch.tensor([[0, 1]], dtype=torch.bool)  # 2 bits -> 1 byte
    m = pack_segments([a, b])
    assert ints(m.indptr) == [0, 2, 3]
    assert ints(m.packed) == [0b11011001, 0b1, 0b10]
    assert torch.equal(unpack_segment(m, 0, 3, 3), a) and torch.equal(unpack_segment(m, 1, 1, 2), b)


def test_multi_item_mask_from_metadata_hides_other_items():
    c = REGISTRY["multi_item"].plan([Shape(2, (2, 2))]).passes[0].calls[0]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 1, 0],
         [1, 1, 0, 0, 1, 1]], dtype=torch.bool)  # fmt: skip
    assert torch.equal(request_mask(c, 0, 6, 6), expected)


def test_check_rejects_max_item_len_below_longest_item():
    plan = REGISTRY["multi_item"].plan([Shape(3, (4, 2))])
    c = plan.passes[0].calls[0]
    bad = MultiItem(
        c.multi_item.prefix_len, c.multi_item.token_pos_in_items, 6, torch.tensor([3], dtype=torch.int32)
    )
    from dataclasses import replace

    plan = replace(plan, passes=(replace(plan.passes[0], calls=(replace(c, multi_item=bad),)),))
    with pytest.raises(PlanError, match="max_item_len"):
        check_plan(plan, 32768)


def test_check_caps_custom_mask_size():
    plan = REGISTRY["custom_mask"].plan([Shape(40, (30, 30))])
    check_plan(plan, 100)
    with pytest.raises(PlanError, match="custom mask over 99"):
        check_plan(plan, 99)


def test_check_rejects_items_over_uint16_positions():
    with pytest.raises(PlanError, match="65535"):
        check_plan(REGISTRY["ragged"].plan([Shape(1, (65536,))]), 32768)
    meta = multi_item_meta([1], [[65536]])
    assert int(meta.max_item_len[0]) == 65536


@given(st.lists(st.lists(st.integers(1, 70), max_size=6), min_size=1, max_size=5))
def test_multi_item_meta_gives_each_token_its_place_in_its_item_padded_per_request(items):
    """Each request's row: 1..n for each item in turn, zeros to the widest request's tokens; the
    longest item per request (0 for a request without items)."""
    meta = multi_item_meta(list(range(len(items))), items)
    width = max(1, *(sum(r) for r in items))
    rows = [[k for n in r for k in range(1, n + 1)] for r in items]
    assert meta.token_pos_in_items_len == width and meta.token_pos_in_items.dtype == torch.uint16
    assert ints(meta.token_pos_in_items) == [k for row in rows for k in row + [0] * (width - len(row))]
    assert ints(meta.max_item_len) == [max(r, default=0) for r in items]
    assert ints(meta.prefix_len) == list(range(len(items)))


def test_check_names_the_request_whose_item_is_over_uint16_positions():
    with pytest.raises(PlanError, match="request 1: item of 65536 tokens"):
        check_plan(REGISTRY["ragged"].plan([Shape(4, (3,)), Shape(1, (2, 65536))]), 32768)


def test_check_rejects_rows_no_call_covers_and_calls_that_overlap_partly():
    """Cascade's pass: the prompts' call over rows [0, 10), the shared and unique levels over [10, 18)."""
    from dataclasses import replace

    plan = _plan("cascade", [Shape(10, (5, 3))])
    check_plan(plan, 32768)
    (p,) = plan.passes
    prompt_call, *levels = p.calls
    assert prompt_call.rows == (0, 10) and {c.rows for c in levels} == {(10, 18)}
    without = replace(plan, passes=(replace(p, calls=tuple(levels)),))
    with pytest.raises(PlanError, match="rows without an attention call"):
        check_plan(without, 32768)
    overlapping = replace(plan, passes=(replace(p, calls=(replace(prompt_call, q_end=11), *levels)),))
    with pytest.raises(PlanError, match="overlap partly"):
        check_plan(overlapping, 32768)


def _broken(scheme: str, shapes, **change):
    from dataclasses import replace

    plan = _plan(scheme, shapes)
    (p,) = plan.passes
    c = p.calls[-1]
    return replace(plan, passes=(replace(p, calls=(*p.calls[:-1], replace(c, **change))),))


def _i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


@pytest.mark.parametrize(
    "scheme, change, message",
    [
        ("ragged", {"qo_indptr": _i32([0, 60, 50, 58])}, "empty or negative request"),  # 2nd: -10
        ("ragged", {"kv_indptr": _i32([0, 58, 108, 108])}, "indptr does not match"),
        ("ragged", {"kv_indptr": _i32([0, 54, 54, 158])}, "empty or negative request"),
        ("ragged", {"qo_indptr": _i32([0, 2, 56, 58])}, "more queries than keys"),  # 2nd: 54 > 52
        ("ragged", {"kv_indices": torch.full((158,), 58, dtype=torch.int32)}, "outside the slots"),
        ("multi_item", {"q_end": 57}, "indptr does not match"),
    ],
)
def test_check_names_what_is_wrong_with_a_call(scheme, change, message):
    """Every per-request check of a call fires where only one request breaks it."""
    shapes = [Shape(50, (4, 2, 2))]  # ragged: 54, 2 and 2 queries on 54, 52 and 52 of 58 slots
    check_plan(_plan(scheme, shapes), 32768)
    with pytest.raises(PlanError, match=message):
        check_plan(_broken(scheme, shapes, **change), 32768)


def test_check_names_a_multi_item_call_whose_positions_are_too_short():
    from dataclasses import replace

    plan = _plan("multi_item", [Shape(3, (4, 2))])
    m = plan.passes[0].calls[0].multi_item  # 9 keys: a prefix of 3, and 6 item positions
    check_plan(plan, 32768)
    too_short = replace(m, prefix_len=_i32([2]))  # 7 keys after the prefix, 6 positions
    with pytest.raises(PlanError, match="token_pos_in_items shorter"):
        check_plan(_broken("multi_item", [Shape(3, (4, 2))], multi_item=too_short), 32768)


shape_st = st.builds(
    Shape,
    st.integers(1, 300),
    st.lists(st.integers(1, 80), min_size=1, max_size=40).map(tuple),
)


def _random_qkv(shapes, heads=4, kv_heads=2, dim=8, seed=0):
    n = sum(s.num_tokens for s in shapes)
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads)]


def _assert_equals_naive(plan, shapes, seed=0) -> None:
    """``plan`` passes the checks, and one attention layer of it on random q/k/v gives every item
    row what naive's plan of ``shapes`` gives."""
    check_plan(plan, 32768)
    q, k, v = _random_qkv(shapes, seed=seed)
    expected = replay_attention(REGISTRY["naive"].plan(shapes), _backend(), q, k, v)
    torch.testing.assert_close(replay_attention(plan, _backend(), q, k, v), expected, atol=1e-4, rtol=1e-4)


def _backend():
    return TorchBackend(HeadSpec(4, 2, 8, torch.float32, torch.device("cpu")))


EDGES = [
    [Shape(300, (80,) * 40)],  # the largest request of the range
    [Shape(1, (1,))],  # one prefix token, one one-token doc
    [Shape(7, (1,) * 40)],  # many one-token docs
    [Shape(300, (1,)), Shape(1, (80, 1, 80))],  # N = 1 next to an uneven request
]


@given(shapes=st.lists(shape_st, min_size=1, max_size=3), scheme=st.sampled_from(CONCRETE))
@example(shapes=EDGES[0], scheme="grouped:3")
@example(shapes=EDGES[0], scheme="custom_mask")
@example(shapes=EDGES[0], scheme="cascade")
@example(shapes=EDGES[1], scheme="split_cache")
@example(shapes=EDGES[1], scheme="multi_item")
@example(shapes=EDGES[2], scheme="multi_item")
@example(shapes=EDGES[2], scheme="ragged")
@example(shapes=EDGES[3], scheme="split_cache")
@example(shapes=EDGES[3], scheme="cascade")
def test_every_scheme_attention_rows_equal_naive(shapes, scheme):
    _assert_equals_naive(_plan(scheme, shapes), shapes)


@given(
    shapes=st.lists(shape_st, min_size=2, max_size=4), schemes=st.lists(st.sampled_from(CONCRETE), min_size=4)
)
def test_mixed_batch_equals_naive(shapes, schemes):
    parts = [_plan(sc, [s]) for sc, s in zip(schemes, shapes, strict=False)]
    _assert_equals_naive(combine(parts), shapes, seed=1)


def test_cascade_runs_three_calls_and_one_merge_per_layer():
    backend = _backend()
    q, k, v = _random_qkv(EXAMPLE)
    replay_attention(REGISTRY["cascade"].plan(EXAMPLE), backend, q, k, v)
    assert backend.stats == {"calls": 3, "merges": 1}


@given(shape=shape_st, scheme=st.sampled_from(CONCRETE + ["naive"]), budget=st.integers(1, 2000))
@example(shape=Shape(50, (10,) * 12), scheme="cascade", budget=80)
@example(shape=Shape(50, (10,) * 12), scheme="grouped:5", budget=80)
@example(shape=Shape(50, (10,) * 12), scheme="split_cache", budget=80)
def test_split_to_budget_reuses_the_prompt_and_equals_naive(shape, scheme, budget):
    name, _, g = scheme.partition(":")
    plan = split_to_budget(get(name), shape, budget, int(g or 8))
    _assert_equals_naive(plan, [shape], seed=2)
    prefix_rows = sum(int((p.logical < shape.prefix_len).sum()) for p in plan.passes)
    n_chunks = len(chunk_items(shape, budget, naive=name == "naive"))
    if name == "naive":
        assert prefix_rows == shape.prefix_len * len(shape.item_lens)
    else:
        assert prefix_rows == shape.prefix_len
        assert len(plan.passes) >= n_chunks
    for p in plan.passes:
        multi_item_rows = max(shape.item_lens) + (
            shape.prefix_len if name == "naive" or p is plan.passes[0] else 0
        )
        assert p.num_rows <= max(budget, multi_item_rows)


@given(shape=shape_st, scheme=st.sampled_from(CONCRETE), budget=st.integers(1, 2000))
@example(shape=Shape(50, (10,) * 12), scheme="cascade", budget=80)
@example(shape=Shape(50, (10,) * 12), scheme="split_cache", budget=80)
def test_split_recomputing_the_prompt_needs_no_pool_and_equals_naive(shape, scheme, budget):
    """With room to recompute, each chunk is the prompt and its items, a pass that reads only its
    own rows: no K/V pool (no copies), the same scores."""
    name, _, g = scheme.partition(":")
    plan = split_to_budget(get(name), shape, budget, int(g or 8), recompute_share=1e9)
    _assert_equals_naive(plan, [shape], seed=2)
    chunks = chunk_items(shape, budget, naive=False, recompute=True)
    prefix_rows = sum(int((p.logical < shape.prefix_len).sum()) for p in plan.passes)
    assert prefix_rows == shape.prefix_len * len(chunks)
    if name != "split_cache":  # its own plan is two passes, the items reading the prompt's
        assert len(plan.passes) == len(chunks)
        assert all(p.slot_offset == 0 for p in plan.passes)
        assert KVPool(plan, 1, 2, 4, torch.float32, "cpu").pools is None
    for p in plan.passes:
        assert p.num_rows <= max(budget, shape.prefix_len + max(shape.item_lens))


def test_split_recomputes_the_prompt_only_within_its_share():
    shape = Shape(100, (400,) * 50)  # workload C: 20,100 rows in passes of at most 16,384
    reuse = split_to_budget(get("ragged"), shape, 16384, 0, recompute_share=0.0)
    assert [p.num_rows for p in reuse.passes] == [16100, 4000]
    assert [p.slot_offset for p in reuse.passes] == [0, 16100]
    again = split_to_budget(get("ragged"), shape, 16384, 0, recompute_share=0.01)  # 100 <= 201
    assert [p.num_rows for p in again.passes] == [16100, 4100]
    assert [p.slot_offset for p in again.passes] == [0, 0]
    assert (
        len(split_to_budget(get("ragged"), shape, 16384, 0, recompute_share=0.004).passes[1].logical) == 4000
    )
    long_prompt = Shape(2000, (100,) * 200)  # 22,000 rows: recomputing 2,000 of them does not pay
    assert (
        split_to_budget(get("ragged"), long_prompt, 16384, 0, recompute_share=0.043).passes[1].slot_offset > 0
    )


def _mask_keys_per_query(c) -> float:
    """Keys per query counted from the reference mask of every request of ``c``."""
    seen = 0
    for i in range(c.num_requests):
        q_len = int(c.qo_indptr[i + 1] - c.qo_indptr[i])
        kv_len = int(c.kv_indptr[i + 1] - c.kv_indptr[i])
        seen += int(request_mask(c, i, q_len, kv_len).sum())
    return seen / int(c.qo_indptr[-1])


@pytest.mark.parametrize("scheme", ["naive", "ragged", "cascade", "multi_item", "grouped:3", "split_cache"])
def test_keys_per_query_is_the_mask_work_per_row(scheme: str):
    """The FA2/FA3 choice reads the mean keys a query sees: exact for causal and full calls,
    within the items' own tokens for multi-item ones (those count their prefix only)."""
    from scorer.attention.flashinfer import keys_per_query

    shapes = [Shape(300, (50, 20, 70)), Shape(40, (5, 9))]
    for p in _plan(scheme, shapes).passes:
        for c in p.calls:
            want = _mask_keys_per_query(c)
            slack = 0 if c.multi_item is None else int(c.multi_item.max_item_len.max())
            assert want - slack <= keys_per_query(c) <= want + 1e-9, (scheme, c)


def test_fa2_on_hopper_only_for_large_calls_whose_queries_see_few_keys():
    from scorer.attention.flashinfer import (
        FA2_MIN_ROWS,
        FA3_MIN_KEYS_PER_QUERY,
        choose_kernel,
        keys_per_query,
    )

    def one_call(scheme, shapes):
        (p,) = _plan(scheme, shapes).passes
        (c,) = p.calls
        return c

    a = [Shape(300, (50,) * 10)]  # workload A: ~260 keys a query, 800 rows a call
    batch = one_call("ragged", a * 20)  # a serving batch of A: 16,000 rows
    lone = one_call("ragged", a)
    multi = one_call("multi_item", a * 20)
    long = one_call("multi_item", [Shape(8000, (4,) * 32)] * 2)  # workload D: ~4,000 keys
    assert keys_per_query(batch) < FA3_MIN_KEYS_PER_QUERY <= keys_per_query(long)
    assert lone.q_end < FA2_MIN_ROWS <= min(batch.q_end, multi.q_end, long.q_end)
    calls = (batch, multi, lone, long)
    assert [choose_kernel(c, "auto", True) for c in calls] == ["fa2", "fa2", "fa3", "fa3"]
    assert [choose_kernel(c, "auto", False) for c in calls] == ["fa2"] * 4
    assert choose_kernel(batch, "fa3", True) == "fa3" and choose_kernel(long, "fa2", True) == "fa2"
    masked = one_call("custom_mask", [Shape(2000, (4,) * 2)])
    assert choose_kernel(masked, "auto", True) == choose_kernel(masked, "fa3", True) == "fa2"


def test_contiguous_run_is_one_consecutive_run_of_slots_in_request_order():
    """The calls that read one run of slots (cascade's levels, naive's requests) are found, with
    the run; ragged's (each doc reads its prompt, then jumps to its own rows), multi-item's and the
    custom mask's are not."""
    from scorer.attention.flashinfer import contiguous_run

    shapes = [Shape(300, (50, 20, 70)), Shape(40, (5, 9))]
    (cascade,) = _plan("cascade", shapes).passes
    prefix, shared, unique = cascade.calls
    assert contiguous_run(prefix) == (0, 340) and contiguous_run(shared) == (0, 340)
    assert contiguous_run(unique) == (340, 340 + 154)
    (naive,) = _plan("naive", shapes).passes
    assert [contiguous_run(c) for c in naive.calls] == [(0, naive.num_rows)]
    for scheme in ("ragged", "multi_item", "custom_mask"):
        (p,) = _plan(scheme, shapes).passes
        assert [contiguous_run(c) for c in p.calls] == [None], scheme
    (one_doc,) = _plan("ragged", [Shape(30, (7,))]).passes  # a prompt and its one doc: one run
    assert [contiguous_run(c) for c in one_doc.calls] == [(0, 37)]
    gap = dataclasses.replace(one_doc.calls[0], kv_indices=torch.tensor([0, 1, 3, 3], dtype=torch.int32))
    assert contiguous_run(gap) is None  # first and last 3 apart over 4 slots, but not a run


def _shared_prefix_reference(shapes, group_size):
    """The ragged / multi-item / grouped layout written as a plain loop over items (what
    ``_shared_prefix_groups`` vectorises): rows are the logical tokens in order."""
    items, q_lens, kv, mi_prefix, mi_items, base = [], [], [], [], [], 0
    for s in shapes:
        starts = [base + s.prefix_len + sum(s.item_lens[:i]) for i in range(len(s.item_lens))]
        items.append(tuple(ItemLoc(0, st, n) for st, n in zip(starts, s.item_lens, strict=True)))
        size = group_size or len(starts)
        for g in range(0, len(starts), size):
            lens = s.item_lens[g : g + size]
            q_lens.append(sum(lens) + (s.prefix_len if g == 0 else 0))
            own = torch.arange(starts[g], starts[g] + sum(lens))
            kv.append(torch.cat([torch.arange(base, base + s.prefix_len), own]))
            mi_prefix.append(s.prefix_len)
            mi_items.append(list(lens))
        base += s.num_tokens
    meta = multi_item_meta(mi_prefix, mi_items) if group_size != 1 else None
    return call(0, q_lens, kv, causal=True, multi_item=meta), tuple(items), base


def _same_tensors(a, b):
    """Equal dataclasses of tensors: same values and dtypes, field by field."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif dataclasses.is_dataclass(x):
            _same_tensors(x, y)
        else:
            assert x == y, f.name


@given(
    shapes=st.lists(
        st.builds(Shape, st.integers(0, 300), shape_st.map(lambda s: s.item_lens)), min_size=1, max_size=6
    ),
    scheme=st.sampled_from(["ragged", "multi_item", "grouped:1", "grouped:3", "grouped:8"]),
)
def test_shared_prefix_layout_equals_a_per_item_loop(shapes, scheme):
    name, _, g = scheme.partition(":")
    group_size = {"ragged": 1, "multi_item": None}.get(name, int(g or 0))
    plan = _plan(scheme, shapes)
    expected, items, total = _shared_prefix_reference(shapes, group_size)
    (p,) = plan.passes
    (c,) = p.calls
    _same_tensors(c, expected)
    assert plan.items == items and all(type(loc) is ItemLoc for locs in plan.items for loc in locs)
    assert p.logical.dtype == torch.int64 and torch.equal(p.logical, torch.arange(total))
    assert p.slot_offset == 0 and plan.shapes == tuple(shapes)
    (rows,) = with_score_rows(plan, range(len(shapes))).score_rows
    assert rows.dtype == torch.int64 and ints(rows) == [loc.row + loc.length - 1 for loc in chain(*items)]


@pytest.mark.parametrize("cap", [4, 1 << 21])
def test_np_ranges_int32_is_the_int64_ranges_cast(monkeypatch, cap):
    monkeypatch.setattr(base, "_IOTA_CAP", cap)
    monkeypatch.setattr(base, "_IOTA", np.zeros(0, dtype=np.int32))
    starts, lengths = np.array([5, 0, 3, 100], dtype=np.int64), np.array([3, 0, 4, 2], dtype=np.int64)
    expected = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
    for _ in range(2):  # the buffer grown, then reused
        assert np.array_equal(base.np_ranges(starts, lengths), expected)
        got = base.np_ranges(starts, lengths, np.int32)
        assert got.dtype == np.int32 and np.array_equal(got, expected)
    assert not base.iota(3).flags.writeable  # shared between plans: nobody writes it


def test_only_large_calls_of_long_docs_are_materialized():
    """FlashInfer's rule for FA3 over a gathered copy of a call's keys (``materialize_call``):
    C-like calls qualify, short docs, long prompts (a copy over 1.25x the rows), small calls
    and calls whose keys are already one run do not."""
    from scorer.attention.flashinfer import materialize_call

    def calls(name, shapes):
        return [c for p in get(name).plan(shapes, 0).passes for c in p.calls]

    assert all(materialize_call(c) for c in calls("ragged", [Shape(100, (400,) * 50)]))
    assert all(materialize_call(c) for c in calls("ragged", [Shape(100, (400,) * 6)] * 2))
    assert not any(materialize_call(c) for c in calls("ragged", [Shape(300, (50,) * 10)] * 20))  # A
    assert not any(materialize_call(c) for c in calls("ragged", [Shape(2000, (400,) * 30)]))  # copy 2.3x
    assert not any(materialize_call(c) for c in calls("ragged", [Shape(100, (400,) * 5)]))  # 2,100 rows
    assert not any(materialize_call(c) for c in calls("naive", [Shape(100, (400,) * 50)]))  # one run each
    assert not any(materialize_call(c) for c in calls("multi_item", [Shape(100, (400,) * 50)]))
