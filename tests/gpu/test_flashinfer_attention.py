"""FlashInfer backend against the torch reference, one attention layer per plan (replay_attention).

Skipped without CUDA and flashinfer; run on the device machine with ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from scorer.planning import REGISTRY as _REG

UNGROUPED = tuple(n for n, s in _REG.items() if not s.grouped)

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
flashinfer = pytest.importorskip("flashinfer")

from replay import replay_attention  # noqa: E402

from bench.paging import to_pages  # noqa: E402
from scorer.attention.base import HeadSpec  # noqa: E402
from scorer.attention.flashinfer import FlashInferBackend  # noqa: E402
from scorer.attention.torch_ref import TorchBackend  # noqa: E402
from scorer.planning import Shape, check_plan, combine, get  # noqa: E402
from scorer.planning.base import Plan  # noqa: E402
from scorer.planning.packbits import multi_item_mask, pack_segments  # noqa: E402

DEV = torch.device("cuda")
SM90 = torch.cuda.get_device_capability()[0] == 9
KERNELS = ["auto", "fa2", pytest.param("fa3", marks=pytest.mark.skipif(not SM90, reason="FA3 needs sm90"))]
SCHEMES = list(UNGROUPED) + ["grouped:1", "grouped:3", "grouped:8"]
MAX_REL_ERR = 1e-2


def make_plan(name: str, shapes: list[Shape]) -> Plan:
    scheme, _, g = name.partition(":")
    plan = get(scheme).planner(int(g or 8))(shapes)
    check_plan(plan, 32768)
    return plan


def spec(dtype: torch.dtype, heads: tuple[int, int] = (8, 2)) -> HeadSpec:
    return HeadSpec(heads[0], heads[1], 128, dtype, DEV)


def random_qkv(shapes, sp: HeadSpec, seed: int) -> list[torch.Tensor]:
    n = sum(s.num_tokens for s in shapes)
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [
        torch.randn(n, h, sp.head_dim, generator=g, device=DEV, dtype=sp.dtype)
        for h in (sp.num_qo_heads, sp.num_kv_heads, sp.num_kv_heads)
    ]


def random_shapes(rng: random.Random) -> list[Shape]:
    """1-3 prompts; prefixes across FlashInfer's 64/128-row tiles, items from 1 to 300 tokens."""
    out = []
    for _ in range(rng.randint(1, 3)):
        p = rng.choice([1, 7, 63, 64, 65, 129, rng.randint(1, 700)])
        n = rng.randint(1, 12)
        items = tuple(rng.choice([1, 2, 5, rng.randint(1, 40), rng.randint(1, 300)]) for _ in range(n))
        out.append(Shape(p, items))
    return out


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


def check_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite output"
    err = rel_err(got, ref)
    assert err < MAX_REL_ERR, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_scheme_equals_torch_reference(scheme: str, dtype: torch.dtype, kernels: str):
    rng = random.Random(f"{scheme}-{dtype}-{kernels}")
    sp = spec(dtype)
    backend = FlashInferBackend(sp, kernels=kernels)
    for trial in range(4):
        shapes = random_shapes(rng)
        q, k, v = random_qkv(shapes, sp, seed=trial)
        plan = make_plan(scheme, shapes)
        got = replay_attention(plan, backend, q, k, v)
        check_close(got, replay_attention(plan, TorchBackend(sp), q, k, v), f"{scheme} {shapes}")
        naive = replay_attention(make_plan("naive", shapes), TorchBackend(sp), q, k, v)
        check_close(got, naive, f"{scheme} vs naive {shapes}")
    assert backend.name == "flashinfer"


@pytest.mark.parametrize("kernels", KERNELS)
def test_mixed_batch_equals_torch_reference(kernels: str):
    rng = random.Random(kernels)
    sp = spec(torch.bfloat16)
    backend = FlashInferBackend(sp, kernels=kernels)
    for trial in range(6):
        shapes = random_shapes(rng) + random_shapes(rng)
        plan = combine([make_plan(rng.choice(SCHEMES), [s]) for s in shapes])
        check_plan(plan, 32768)
        q, k, v = random_qkv(shapes, sp, seed=100 + trial)
        check_close(
            replay_attention(plan, backend, q, k, v),
            replay_attention(make_plan("naive", shapes), TorchBackend(sp), q, k, v),
            f"mixed {shapes}",
        )


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("scheme", ["ragged", "cascade", "multi_item", "grouped:8", "split_cache"])
@pytest.mark.parametrize(
    "shape", [Shape(8196, (4,) * 32), Shape(96, (256,) * 32)], ids=["P8196S4M32", "P96S256M32"]
)
def test_article_shapes_equal_torch_reference(scheme: str, shape: Shape, kernels: str):
    sp = spec(torch.float16, heads=(16, 8))
    q, k, v = random_qkv([shape], sp, seed=7)
    plan = make_plan(scheme, [shape])
    got = replay_attention(plan, FlashInferBackend(sp, kernels=kernels), q, k, v)
    check_close(got, replay_attention(plan, TorchBackend(sp), q, k, v), f"{scheme} {shape}")


class PagedBackend:
    """FlashInfer on the K/V copied into pages of ``page_size`` (``bench.paging``)."""

    def __init__(self, backend: FlashInferBackend, page_size: int) -> None:
        self.inner, self.page_size, self.name, self.stats = backend, page_size, "paged", backend.stats

    def plan(self, p) -> None:
        self.paged = to_pages(p, self.page_size)
        self.inner.plan(self.paged.pass_)

    def run(self, layer, q, k, v, out=None):
        pool = [self.paged.pool(x, self.page_size) for x in (k, v)]
        return self.inner.run(layer, q, *pool, out)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_paged_layout_equals_the_flat_one(scheme: str, page_size: int):
    """The page-size benchmark's layout: the same attention as the engine's page_size 1."""
    rng = random.Random(f"paged-{scheme}-{page_size}")
    sp = spec(torch.bfloat16)
    flat, paged = (FlashInferBackend(sp) for _ in range(2))
    for trial in range(3):
        shapes = random_shapes(rng)
        q, k, v = random_qkv(shapes, sp, seed=200 + trial)
        plan = make_plan(scheme, shapes)
        want = replay_attention(plan, flat, q, k, v)
        got = replay_attention(plan, PagedBackend(paged, page_size), q, k, v)
        check_close(got, want, f"{scheme} page_size {page_size} {shapes}")


def test_cascade_merges_once_per_layer():
    sp = spec(torch.bfloat16)
    shapes = [Shape(96, (4, 4))]
    backend = FlashInferBackend(sp)
    replay_attention(make_plan("cascade", shapes), backend, *random_qkv(shapes, sp, 0))
    assert backend.stats == Counter({"calls": 3, "merges": 1, "contiguous": 3})


@pytest.mark.skipif(not SM90, reason="FA3 needs sm90")
@pytest.mark.parametrize("scheme", ["cascade", "ragged", "multi_item"])
def test_auto_runs_fa3_and_fa2_calls_of_one_pass_and_merges_them(scheme: str):
    """``auto`` picks the kernel per call: cascade's prefix and shared levels over a 1,500-token
    prompt run FA3 and its unique level (4,500 rows of short items) FA2, and their log-sum-exp
    merge is exact; a long prompt's call runs FA3 and a wide batch of short ones FA2."""
    sp = spec(torch.bfloat16)
    if scheme == "cascade":
        plans = [make_plan(scheme, [Shape(1500, (90,) * 50)])]
    else:
        plans = [make_plan(scheme, [Shape(3000, (30, 12))]), make_plan(scheme, [Shape(200, (50,) * 6)] * 12)]
    for i, plan in enumerate(plans):
        q, k, v = random_qkv(plan.shapes, sp, 40 + i)
        backend = FlashInferBackend(sp, kernels="auto")
        got = replay_attention(plan, backend, q, k, v)
        check_close(got, replay_attention(plan, TorchBackend(sp), q, k, v), f"{scheme} {plan.shapes}")
        kernels = [backend.kernel_for(c) for p in plan.passes for c in p.calls]
        if scheme == "cascade":
            assert kernels == ["fa3", "fa3", "fa2"] and backend.stats["merges"] == 1
        else:
            assert kernels == (["fa3"] if i == 0 else ["fa2"])


class RaggedWrapperBackend:
    """Multi-item calls through ``BatchPrefillWithRaggedKVCacheWrapper``, which accepts the
    multi-item arguments and runs a plain causal mask: the leak the isolation test must catch."""

    name = "ragged-wrapper"

    def __init__(self, sp: HeadSpec) -> None:
        self.spec, self.stats = sp, Counter()
        ws = torch.empty(128 << 20, dtype=torch.uint8, device=DEV)
        self.wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa2")

    def plan(self, p) -> None:
        (c,) = p.calls
        m = c.multi_item
        self.idx = c.kv_indices.long().to(DEV)
        self.wrapper.plan(
            c.qo_indptr.to(DEV),
            c.kv_indptr.to(DEV),
            self.spec.num_qo_heads,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            causal=True,
            q_data_type=self.spec.dtype,
            prefix_len_ptr=m.prefix_len.view(torch.uint32).to(DEV),
            token_pos_in_items_ptr=m.token_pos_in_items.to(DEV),
            token_pos_in_items_len=m.token_pos_in_items_len,
            max_item_len_ptr=m.max_item_len.to(torch.uint16).to(DEV),
        )

    def run(self, layer, q, k, v):
        return self.wrapper.run(q, k[self.idx].contiguous(), v[self.idx].contiguous())


def later_items_change(backend, scheme: str) -> bool:
    """Whether changing item 1's K/V changes the output of item 2 (which must not see item 1)."""
    sp = backend.spec
    shape = Shape(100, (30, 40, 50))
    q, k, v = random_qkv([shape], sp, seed=3)
    plan = make_plan(scheme, [shape])
    before = replay_attention(plan, backend, q, k, v)
    item1 = slice(130, 170)
    k2, v2 = k.clone(), v.clone()
    k2[item1] += 3 * torch.randn_like(k2[item1])
    v2[item1] += 3 * torch.randn_like(v2[item1])
    after = replay_attention(plan, backend, q, k2, v2)
    assert rel_err(after[30:70], before[30:70]) > 0.05, "item 1 itself must change"
    return rel_err(after[70:], before[70:]) > 1e-3


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize(
    "scheme", ["multi_item", "grouped:2", "grouped:8", "custom_mask", "ragged", "cascade"]
)
def test_items_cannot_see_each_other(scheme: str, kernels: str):
    sp = spec(torch.bfloat16)
    assert not later_items_change(FlashInferBackend(sp, kernels=kernels), scheme)


def test_isolation_check_catches_the_ragged_wrapper():
    assert later_items_change(RaggedWrapperBackend(spec(torch.bfloat16)), "multi_item")


def test_packing_equals_flashinfer_segment_packbits():
    g = torch.Generator().manual_seed(0)
    sizes = [(1, 1), (3, 5), (7, 9), (16, 16), (33, 70), (5, 3)]
    masks = [torch.rand(q, k, generator=g) < 0.5 for q, k in sizes]
    ours = pack_segments(masks)
    bit_indptr = torch.tensor([0] + [q * k for q, k in sizes], dtype=torch.int32).cumsum(0).to(torch.int32)
    flat = torch.cat([m.flatten() for m in masks]).to(DEV)
    theirs, theirs_indptr = flashinfer.quantization.segment_packbits(
        flat, bit_indptr.to(DEV), bitorder="little"
    )
    assert torch.equal(ours.packed, theirs.cpu())
    assert ours.indptr.tolist() == theirs_indptr.cpu().tolist()


def test_planner_mask_equals_flashinfers_own_packing_in_plan():
    """FlashInfer packs a boolean ``custom_mask`` itself inside ``plan``; the planner's bytes and
    byte offsets must be the same."""
    shapes = [Shape(13, (3, 9, 1)), Shape(70, (20, 5))]
    plan = make_plan("custom_mask", shapes)
    (c,) = plan.passes[0].calls
    flat = torch.cat([multi_item_mask(s.prefix_len, s.item_lens).flatten() for s in shapes])
    ws = torch.empty(16 << 20, dtype=torch.uint8, device=DEV)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    n = c.num_requests
    ones = torch.ones(n, dtype=torch.int32)
    meta = [t.to(DEV) for t in (c.qo_indptr, c.kv_indptr, c.kv_indices, ones)]  # packing runs on the GPU
    w.plan(*meta, 8, 2, 128, 1, custom_mask=flat.to(DEV), q_data_type=torch.bfloat16)
    assert torch.equal(w._custom_mask_buf.cpu(), c.custom_mask.packed)
    assert w._mask_indptr_buf.cpu().tolist() == c.custom_mask.indptr.tolist()


def test_an_unsupported_spec_is_refused_at_start_never_switched_while_running():
    """FlashInfer cannot run fp32 or head_dim 96 here: the backend raises at construction;
    make_backend's auto takes the torch reference, an explicit flashinfer is BackendUnavailable
    unless the torch fallback is asked for."""
    from scorer.attention import BackendUnavailable, make_backend
    from scorer.attention.flashinfer import UnsupportedShape

    fp32 = HeadSpec(8, 2, 128, torch.float32, DEV)
    with pytest.raises(UnsupportedShape, match="float32"):
        FlashInferBackend(fp32)
    with pytest.raises(UnsupportedShape, match="head_dim 96"):
        FlashInferBackend(HeadSpec(8, 2, 96, torch.bfloat16, DEV))
    assert make_backend("auto", fp32).name == "torch"
    with pytest.raises(BackendUnavailable, match="float32"):
        make_backend("flashinfer", fp32)
    assert make_backend("flashinfer", fp32, fallback="torch").name == "torch"
    assert make_backend("auto", HeadSpec(8, 2, 128, torch.bfloat16, DEV)).name == "flashinfer"


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fast_launch_equals_the_wrappers_run(scheme: str, kernels: str):
    """_Launch (paged_run or ragged_run with the arguments fixed at plan time) is the wrapper's
    run, bit for bit, and is what runs every call."""
    rng = random.Random(f"fast-{scheme}-{kernels}")
    sp = spec(torch.bfloat16)
    fast, slow = (
        FlashInferBackend(sp, kernels=kernels),
        FlashInferBackend(sp, kernels=kernels, fast_run=False),
    )
    for trial in range(3):
        shapes = random_shapes(rng)
        q, k, v = random_qkv(shapes, sp, seed=200 + trial)
        plan = make_plan(scheme, shapes)
        got = replay_attention(plan, fast, q, k, v)
        assert torch.equal(got, replay_attention(plan, slow, q, k, v)), f"{scheme} {shapes}"
    assert all(c.launch is not None for g in fast._groups for c in g.calls), "a call took the wrapper's run"
    assert all(c.launch is None for g in slow._groups for c in g.calls)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("scheme", ["cascade", "naive", "ragged", "split_cache"])
def test_contiguous_kv_equals_the_paged_pool(scheme: str, kernels: str):
    """Calls that read one run of slots (cascade's three, naive's) run on the ragged-KV wrapper
    and agree with the same calls through the paged pool; ragged's calls are not such runs."""
    rng = random.Random(f"contiguous-{scheme}-{kernels}")
    sp = spec(torch.bfloat16)
    on, off = FlashInferBackend(sp, kernels=kernels), FlashInferBackend(sp, kernels=kernels, contiguous=False)
    for trial in range(3):
        shapes = random_shapes(rng)
        q, k, v = random_qkv(shapes, sp, seed=300 + trial)
        plan = make_plan(scheme, shapes)
        check_close(
            replay_attention(plan, on, q, k, v), replay_attention(plan, off, q, k, v), f"{scheme} {shapes}"
        )
    assert off.stats["contiguous"] == 0
    if scheme in ("cascade", "naive"):
        assert on.stats["contiguous"] == on.stats["calls"] > 0
    if scheme == "ragged":
        assert on.stats["contiguous"] < on.stats["calls"]


@pytest.mark.skipif(not SM90, reason="FA3 needs sm90")
@pytest.mark.parametrize(
    "shapes", [[Shape(100, (400,) * 12)], [Shape(100, (400,) * 6)] * 2, [Shape(60, (300, 520, 410, 260) * 3)]]
)
def test_long_docs_run_fa3_over_a_gathered_copy_of_their_keys(shapes):
    """A large ragged call of long docs on a short prompt (C's shape) runs FA3 over its keys
    gathered in request order, and agrees with the paged call and the torch reference; below
    the rule (``materialize=False``, or short docs) the call stays paged."""
    sp = spec(torch.bfloat16)
    plan = make_plan("ragged", shapes)
    q, k, v = random_qkv(shapes, sp, 500)
    on, off = FlashInferBackend(sp), FlashInferBackend(sp, materialize=False)
    got = replay_attention(plan, on, q, k, v)
    check_close(got, replay_attention(plan, TorchBackend(sp), q, k, v), f"materialized {shapes}")
    check_close(got, replay_attention(plan, off, q, k, v), f"materialized against paged {shapes}")
    assert on.stats["materialized"] > 0 and off.stats["materialized"] == 0
    if len(plan.passes) == 1:  # k and v as views of one QKV buffer (the serving layout): one gather
        from scorer.models.triton_ops import qkv_views

        idx = plan.passes[0].logical.to(DEV)
        qkv = torch.cat([t[idx].flatten(1) for t in (q, k, v)], 1)
        on.plan(plan.passes[0])
        views = qkv_views(qkv, sp.num_qo_heads, sp.num_kv_heads, sp.head_dim)
        assert torch.equal(on.run(0, *views), on.run(0, q[idx], k[idx], v[idx]))
    short = [Shape(100, (40,) * 120)]  # 4,900 rows of 40-token docs: paged
    short_backend = FlashInferBackend(sp)
    replay_attention(make_plan("ragged", short), short_backend, *random_qkv(short, sp, 501))
    assert short_backend.stats["materialized"] == 0
