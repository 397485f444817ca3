"""FlashInfer attention: every attention call of a plan as one batch-prefill call.

The K/V of a layer is the page pool itself (``page_size = 1``): ``k`` and ``v`` of shape
``[slots, Hkv, D]`` are handed to the paged wrapper as ``[slots, 1, Hkv, D]`` views, so no K/V
is copied; a call whose requests read one consecutive run of slots (``contiguous_run``:
cascade's levels, naive) goes to the ragged-KV wrapper as that run's ``k[a:b]``, without a page
table; on Hopper a large call of long docs on a short prompt runs on FA3's contiguous kernel
over its keys gathered in request order (``materialize_call``).
``plan`` runs once per forward pass: it turns the host-side metadata of each call into
FlashInfer's plan (indptrs, page table, kMultiItemScoring metadata or the packed custom mask)
and moves it to the device with non-blocking copies; ``run`` then only launches kernels, once
per layer, and never waits on the device. Calls over the same rows (cascade's shared and
unique levels) are merged by log-sum-exp with ``merge_state_in_place``.

Facts this relies on (FlashInfer 0.6.15.post1, see the GPU kit's README):

* kMultiItemScoring is honoured only by ``BatchPrefillWithPagedKVCacheWrapper``.
* ``prefix_len_ptr`` is read as ``uint32``, ``token_pos_in_items_ptr`` and ``max_item_len_ptr``
  as ``uint16`` through raw pointers: an ``int32`` ``max_item_len`` would be read wrongly for
  every request after the first.
* The custom mask runs on the FA2 kernels only.
* With ``packed_custom_mask``, ``plan`` leaves the mask offsets in bits while the kernel reads
  bytes (flashinfer-ai/flashinfer#2201); the byte offsets of the plan are written back.
* ``plan`` copies its scheduling data from a pinned host buffer with an asynchronous copy, so
  a wrapper is planned again only once the copy of its previous plan has run (wrappers rotate
  over ``RING`` sets, guarded by an event).
* The wrapper's ``run`` spends ~40 us of Python per call (checks, defaults, API logging) around
  a ~17 us launch: 1.1 ms of a 28-layer forward of one call, most of what a call on an idle
  server waits for. ``_Launch`` builds the arguments of the module's ``paged_run`` (or
  ``ragged_run``) once per plan, as ``run`` builds them in FlashInfer ``FAST_RUN_VERSION`` (AOT
  modules, no cuDNN/TRT-LLM, no fp8, NHD); other versions take ``run`` itself.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from ..devices import to_device
from ..planning import Pass
from ..planning.base import MAX_ITEM_LEN, AttentionCall, PlanError
from .base import HeadSpec

log = logging.getLogger(__name__)

KERNELS = ("auto", "fa2", "fa3")
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
PREBUILT_HEAD_DIMS = (128,)  # in the GPU kit; the others compile on first use
WORKSPACE_BYTES = 256 << 20
RING = 2
FAST_RUN_VERSION = "0.6.15.post1"
KERNELS_ENV = "SCORER_FLASHINFER_KERNELS"


class UnsupportedShape(ValueError):
    """A head spec FlashInfer has no kernel for."""


def unsupported_reason(spec: HeadSpec) -> str | None:
    """Why FlashInfer cannot run ``spec``, or None when it can."""
    if spec.device.type != "cuda":
        return f"device {spec.device} is not CUDA"
    if spec.dtype not in DTYPES:
        return f"dtype {spec.dtype} (FlashInfer prefill runs float16 and bfloat16)"
    if spec.head_dim not in HEAD_DIMS:
        return f"head_dim {spec.head_dim} (FlashInfer prefill has kernels for {HEAD_DIMS})"
    if spec.num_qo_heads % spec.num_kv_heads:
        return f"{spec.num_qo_heads} query heads are not a multiple of {spec.num_kv_heads} kv heads"
    return None


FA3_MIN_KEYS_PER_QUERY = 1024
FA2_MIN_ROWS = 4096
"""With ``kernels="auto"`` on Hopper, a call of at least ``FA2_MIN_ROWS`` query rows whose queries
see fewer than ``FA3_MIN_KEYS_PER_QUERY`` keys on average runs FA2, every other call FA3.
Measured on the H200 (bench/RESULTS.md, One attention layer by K/V layout): in serving batches
(12-16k rows) FA2's attention is 1.1-2.0x faster where queries see ~200-300 keys (200- to 300-token
prompts: a 50-token doc is one 128-row tile, which FA2 fills with both query heads of a KV head and
FA3 does not; even with 400-token docs), FA3 1.4-1.5x faster at ~1,900 (2,000-token prompts) and
~4,000 (8,000); on one call of a few docs (the article's kernel grid, hundreds of rows) FA3 is up to
3.5x faster, so a small call keeps FA3."""


def hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def keys_per_query(c: AttentionCall) -> float:
    """The mean number of keys a query of ``c`` attends to: the work of its mask per row. A
    multi-item request's items count their prefix only (their own tokens are a few dozen)."""
    qo_ptr = c.qo_indptr.numpy()
    q = np.diff(qo_ptr).astype(np.float64)
    if c.multi_item is not None:
        p = c.multi_item.prefix_len.numpy().astype(np.float64)
        work = p * p / 2 + (q - p) * p
    else:
        pages = np.diff(c.kv_indptr.numpy()).astype(np.float64)
        k = pages * c.page_size
        if c.last_page_len is not None:
            k += c.last_page_len.numpy() - c.page_size
        work = q * (k - q) + q * (q + 1) / 2 if c.causal else q * k
    return float(work.sum() / max(qo_ptr[-1] - qo_ptr[0], 1))


def choose_kernel(c: AttentionCall, kernels: str, on_hopper: bool) -> str:
    """The FlashInfer prefill kernel of a call: the custom mask runs on FA2 only; ``kernels``
    when forced; for ``auto``, FA3 on Hopper unless the call is large and its queries see few
    keys (see ``FA2_MIN_ROWS``), FA2 elsewhere."""
    if c.custom_mask is not None:
        return "fa2"
    if kernels != "auto":
        return kernels
    if not on_hopper:
        return "fa2"
    wide = c.q_end - c.q_start >= FA2_MIN_ROWS and keys_per_query(c) < FA3_MIN_KEYS_PER_QUERY
    return "fa2" if wide else "fa3"


def contiguous_run(c: AttentionCall) -> tuple[int, int] | None:
    """The slots ``[a, b)`` when the requests of ``c`` read one consecutive run of slots, request
    after request (cascade's levels, naive, a single-pass plan's own rows), else None. Such a call
    runs on ``k[a:b]`` through the ragged-KV wrapper: contiguous loads (FA3's TMA) instead of
    ``page_size = 1``'s gathered ones (13% faster on B's shared level: bench/RESULTS.md, One attention
    layer by K/V layout)."""
    if c.page_size != 1 or c.multi_item is not None or c.custom_mask is not None:
        return None
    idx = c.kv_indices.numpy()
    if len(idx) == 0:
        return None
    a = int(idx[0])
    if int(idx[-1]) - a != len(idx) - 1 or (len(idx) > 2 and not (np.diff(idx) == 1).all()):
        return None
    return a, a + len(idx)


MATERIALIZE_MIN_QUERIES = 256
MATERIALIZE_MAX_GROWTH = 1.25
"""With ``materialize`` on Hopper, a large call (``FA2_MIN_ROWS``) of long requests (at least
``MATERIALIZE_MIN_QUERIES`` queries each on average: long docs on a shared prompt) whose keys are
not one run of slots is run on FA3's contiguous kernel over a copy of its keys, gathered in
request order (each doc's prompt keys copied before its own), when that copy holds at most
``MATERIALIZE_MAX_GROWTH`` times the call's rows. On the H200 (bench/RESULTS.md, One attention layer
by K/V layout), one
attention layer of C (100 + 50 x 400): 0.270 ms paged (FA2 or FA3 alike), 0.203 ms on FA3 over
the copy; in the model, C's attention 8.3 -> 5.9 ms a call and the gather 1.5 ms: +0.9% docs/s."""


def materialize_call(c: AttentionCall) -> bool:
    """Does ``c`` qualify for FA3 over a gathered copy of its keys (see ``MATERIALIZE_MIN_QUERIES``)?"""
    if c.page_size != 1 or c.multi_item is not None or c.custom_mask is not None:
        return False
    rows, keys = c.q_end - c.q_start, len(c.kv_indices)
    return (
        rows >= FA2_MIN_ROWS
        and rows >= MATERIALIZE_MIN_QUERIES * c.num_requests
        and keys <= MATERIALIZE_MAX_GROWTH * rows
        and contiguous_run(c) is None
    )


def _adjacent(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``[slots, 2, Hkv, D]``, k and v as one view, where v's heads follow k's in each row of one
    buffer (the QKV GEMM's output, ``qkv_views``), else None."""
    if k.dim() != 3 or k.shape != v.shape or k.stride() != v.stride() or k.dtype != v.dtype:
        return None
    slots, h, d = k.shape
    if k.stride(2) != 1 or k.stride(1) != d or v.data_ptr() != k.data_ptr() + h * d * k.element_size():
        return None
    return k.as_strided((slots, 2, h, d), (k.stride(0), h * d, d, 1))


class _Launch:
    """``wrapper.run(q, kv, out=out, lse=lse)`` as the module's ``paged_run`` (or ``ragged_run``
    for the ragged-KV wrapper) with the arguments ``run`` would pass, fixed once the wrapper is
    planned (see the module's docstring)."""

    def __init__(self, w, spec: HeadSpec, ragged: bool) -> None:
        from flashinfer.prefill import MaskMode, TensorLayout
        from flashinfer.utils import _get_cache_alibi_slopes_buf, device_support_pdl

        mask = MaskMode.CAUSAL.value if w._causal else MaskMode.NON_CAUSAL.value
        if w._custom_mask_buf is not None:
            mask = MaskMode.CUSTOM.value
        if not ragged and w._prefix_len_ptr is not None:
            mask = MaskMode.MULTIITEMSCORING.value
        self.ragged = ragged
        self.head = (w._float_workspace_buffer, w._int_workspace_buffer, w._plan_info)
        self.mode = (mask, TensorLayout[w._kv_layout].value, w._window_left, device_support_pdl(spec.device))
        sm_scale = w._sm_scale if w._sm_scale is not None else 1.0 / math.sqrt(spec.head_dim)
        alibi = _get_cache_alibi_slopes_buf(spec.num_qo_heads, spec.device)
        self.masks = (w._custom_mask_buf, w._mask_indptr_buf, alibi)
        self.items = (w._prefix_len_ptr, w._token_pos_in_items_ptr, w._max_item_len_ptr)
        self.scales = (w._logits_soft_cap or 0.0, sm_scale)
        rope = (w._rope_scale or 1.0, w._rope_theta or 1e4, w._token_pos_in_items_len)
        if ragged:
            self.run = w._cached_module.ragged_run
            self.mid = (w._qo_indptr_buf, w._kv_indptr_buf)
            self.tail = (*self.scales, *rope, None, None)
            return
        self.run = w._cached_module.paged_run
        self.mid = (
            w._qo_indptr_buf,
            w._paged_kv_indptr_buf,
            w._paged_kv_indices_buf,
            w._paged_kv_last_page_len_buf,
        )
        self.tail = (
            *self.scales, None, None, None, *rope, w._workspace_size,
            w._num_qo_heads, w._num_kv_heads, w._block_tables, w._kv_lens_buffer,
        )  # fmt: skip
        self.lens = (w._max_q_len, w._max_kv_len, w._batch_size, w._qo_indptr_buf, w._paged_kv_indptr_buf)
        self.rest = (None, None, None, None, True, w._trtllm_gen_multi_ctas_kv_counter_buffer)

    @staticmethod
    def applies(w) -> bool:
        import flashinfer

        return (
            flashinfer.__version__ == FAST_RUN_VERSION
            and w._jit_module is None
            and w._backend in ("fa2", "fa3")
            and w._kv_layout == "NHD"
            and w._cached_module is not None
        )

    def __call__(self, q, k, v, out, lse=None) -> None:
        if self.ragged:
            self.run(
                *self.head, q, k, v, *self.mid, out, lse, *self.mode, *self.masks, *self.items, *self.tail
            )
            return
        self.run(
            *self.head, q, k, v, *self.mid, out, lse, *self.mode, *self.masks, *self.items, *self.tail,
            k.shape[1], *self.lens, *self.rest,
        )  # fmt: skip


@dataclass
class _Call:
    """One planned attention call: its wrapper, the contiguous slots it reads (the ragged-KV
    wrapper) or None (the paged one), its fast launch where that applies, and for a materialized
    call (``materialize_call``) the slots to gather and the buffers they go to."""

    wrapper: object
    run_slots: tuple[int, int] | None
    launch: _Launch | None
    gather: tuple[torch.Tensor, torch.Tensor] | None = None  # slots [n], buffer [n, 2, Hkv, D]

    def __call__(self, q, k, v, out, lse=None) -> None:
        """Attention of the call's rows ``q`` into ``out`` (and its log-sum-exp into ``lse``);
        ``k``, ``v`` the layer's pool, ``[slots, Hkv, D]`` or ``[pages, page_size, Hkv, D]``."""
        if self.gather is not None:
            idx, buf = self.gather
            kv = _adjacent(k, v)
            if kv is not None:  # one gather of both (q/k/v in place in the QKV GEMM's output)
                torch.index_select(kv, 0, idx, out=buf)
                k, v = buf[:, 0], buf[:, 1]
            else:
                k, v = torch.index_select(k, 0, idx), torch.index_select(v, 0, idx)
        elif self.run_slots is not None:
            a, b = self.run_slots
            k, v = k[a:b], v[a:b]
        elif k.dim() == 3:
            k, v = k.unsqueeze(1), v.unsqueeze(1)
        if self.launch is not None:
            self.launch(q, k, v, out, lse)
        elif self.run_slots is not None or self.gather is not None:
            self.wrapper.run(q, k, v, out=out, lse=lse, return_lse=lse is not None)
        else:
            self.wrapper.run(q, (k, v), out=out, lse=lse, return_lse=lse is not None)


@dataclass
class _Planned:
    rows: tuple[int, int]
    calls: list[_Call]  # the merge group: the first writes the output, the others merge into it
    merge: tuple[torch.Tensor, ...] = ()  # a group of several: lse, and each other call's out and lse


class FlashInferBackend:
    """Runs planned passes on FlashInfer's paged prefill kernels.

    Parameters
    ----------
    spec
        Heads, head_dim, dtype and device of the model.
    kernels
        ``"fa2"``, ``"fa3"`` or ``"auto"`` (per call on sm90: FA2 for large calls whose queries
        see few keys, FA3 for the others, ``choose_kernel``; FA2 elsewhere). The custom mask
        always runs on FA2. ``$SCORER_FLASHINFER_KERNELS`` overrides ``"auto"``.
    fast_run
        Launch calls through ``_Launch`` where it applies (False: always the wrapper's ``run``;
        the GPU tests compare the two).
    contiguous
        Run a call whose requests read one consecutive run of slots (``contiguous_run``) on that
        run through the ragged-KV wrapper (False: every call through the paged wrapper; the
        benchmarks compare the two).
    materialize
        On Hopper with ``kernels="auto"``, run a large call of long requests on FA3 over a
        gathered copy of its keys (``materialize_call``; False: paged, as any other call).

    Raises ``UnsupportedShape`` when FlashInfer cannot run ``spec`` (dtype, head_dim, device) and
    ImportError when it is not installed: the choice of backend is made once, at start
    (``scorer.attention.make_backend``), never by switching while serving.
    """

    name = "flashinfer"

    def __init__(
        self,
        spec: HeadSpec,
        kernels: str = "auto",
        workspace_bytes: int = WORKSPACE_BYTES,
        fast_run: bool = True,
        contiguous: bool = True,
        materialize: bool = True,
    ) -> None:
        if kernels == "auto":
            kernels = os.environ.get(KERNELS_ENV, "auto") or "auto"
        if kernels not in KERNELS:
            raise ValueError(f"unknown FlashInfer kernels {kernels!r}; expected one of {KERNELS}")
        self.spec = spec
        self.fast_run = fast_run
        self.contiguous = contiguous
        self.materialize = materialize
        self.stats: Counter = Counter()
        reason = unsupported_reason(spec)
        if reason is not None:
            raise UnsupportedShape(f"FlashInfer cannot run {reason}")
        import flashinfer  # noqa: F401  (optional dependency; fails here, not in the layer loop)

        self.kernels = kernels
        self._hopper = hopper(spec.device)
        with torch.inference_mode(False):
            self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=spec.device)
        self._wrappers: list[dict[tuple[int, str], object]] = [{} for _ in range(RING)]
        self._ring_events: list[torch.cuda.Event | None] = [None] * RING
        self._slot = 0
        self._groups: list[_Planned] = []
        self._num_calls = 0
        self._contiguous = 0
        self._materialized = 0
        self._merge = merge_in_place()

    def kernel_for(self, c: AttentionCall) -> str:
        return choose_kernel(c, self.kernels, self._hopper)

    def plan(self, p: Pass) -> None:
        """Plan every call of ``p`` (host metadata -> device, no synchronisation). A failure
        raises: the call fails, the backend stays FlashInfer."""
        slot = self._next_slot()
        self._groups = [self._plan_group(slot, p, members) for members in p.merge_groups()]
        ev = torch.cuda.Event()
        ev.record()
        self._ring_events[slot] = ev
        self._num_calls = len(p.calls)
        self._contiguous = sum(c.run_slots is not None for g in self._groups for c in g.calls)
        self._materialized = sum(c.gather is not None for g in self._groups for c in g.calls)

    def _plan_group(self, slot: int, p: Pass, members: list[int]) -> _Planned:
        """The calls of one merge group, and for several the buffers of their merge, allocated
        once per plan instead of once per layer."""
        rows = p.calls[members[0]].rows
        g = _Planned(rows, [self._plan_call(slot, i, p.calls[i]) for i in members])
        if len(members) > 1:
            s, n = self.spec, rows[1] - rows[0]
            lse, lse2 = (torch.empty(n, s.num_qo_heads, dtype=torch.float32, device=s.device) for _ in "ab")
            g.merge = (lse, torch.empty(n, s.num_qo_heads, s.head_dim, dtype=s.dtype, device=s.device), lse2)
        return g

    def _next_slot(self) -> int:
        self._slot = (self._slot + 1) % RING
        ev = self._ring_events[self._slot]
        if ev is not None and not ev.query():
            ev.synchronize()  # the GPU is RING plans behind; never seen in the engine's use
        return self._slot

    def _wrapper(self, slot: int, index: int, kernel: str, contiguous: bool):
        import flashinfer

        key = (index, kernel, contiguous)
        w = self._wrappers[slot].get(key)
        if w is None:
            cls = (
                flashinfer.BatchPrefillWithRaggedKVCacheWrapper
                if contiguous
                else flashinfer.BatchPrefillWithPagedKVCacheWrapper
            )
            # plan() updates the wrapper's buffers in place: they must not be inference tensors
            with torch.inference_mode(False):
                w = cls(self._workspace, "NHD", backend=kernel)
            self._wrappers[slot][key] = w
        return w

    def _plan_call(self, slot: int, index: int, c: AttentionCall) -> _Call:
        s, dev = self.spec, self.spec.device
        gather = None
        if self.materialize and self.kernels == "auto" and self._hopper and materialize_call(c):
            buf = torch.empty(len(c.kv_indices), 2, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=dev)
            gather = (to_device(c.kv_indices.long(), dev), buf)
        kernel = "fa3" if gather is not None else self.kernel_for(c)
        run_slots = contiguous_run(c) if self.contiguous and gather is None else None
        w = self._wrapper(slot, index, kernel, run_slots is not None or gather is not None)
        common = dict(
            causal=c.causal, sm_scale=s.sm_scale, q_data_type=s.dtype, kv_data_type=s.dtype, non_blocking=True
        )
        if s.soft_cap:  # Gemma 2: cap * tanh(scaled logits / cap), in both wrappers' plans
            common["logits_soft_cap"] = s.soft_cap
        heads = (s.num_qo_heads, s.num_kv_heads, s.head_dim)
        if run_slots is not None or gather is not None:
            w.plan(c.qo_indptr, c.kv_indptr, *heads, **common)
        else:
            kw: dict = {}
            if c.multi_item is not None:
                m = c.multi_item
                if int(m.max_item_len.max()) > MAX_ITEM_LEN:
                    raise PlanError(f"an item over {MAX_ITEM_LEN} tokens cannot run multi-item scoring")
                kw = dict(
                    prefix_len_ptr=to_device(m.prefix_len.to(torch.int32).view(torch.uint32), dev),
                    token_pos_in_items_ptr=to_device(m.token_pos_in_items.to(torch.uint16), dev),
                    token_pos_in_items_len=int(m.token_pos_in_items_len),
                    max_item_len_ptr=to_device(m.max_item_len.to(torch.uint16), dev),
                )
            if c.custom_mask is not None:
                kw["packed_custom_mask"] = c.custom_mask.packed
            last = (
                torch.ones(c.num_requests, dtype=torch.int32) if c.last_page_len is None else c.last_page_len
            )
            w.plan(c.qo_indptr, c.kv_indptr, c.kv_indices, last, *heads, c.page_size, **common, **kw)
            if c.custom_mask is not None:
                w._mask_indptr_buf = to_device(c.custom_mask.indptr, dev)
        fast = self.fast_run and _Launch.applies(w)
        ragged = run_slots is not None or gather is not None
        return _Call(w, run_slots, _Launch(w, s, ragged) if fast else None, gather)

    def run(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention of every planned call for one layer, into ``out`` when given.

        Parameters
        ----------
        q
            ``[rows, Hq, D]``, the pass's queries.
        k, v
            ``[slots, Hkv, D]``, the layer's K/V pool (a single-pass plan: the pass's own K/V),
            or ``[pages, page_size, Hkv, D]`` for calls planned with a larger page size.

        Returns
        -------
        torch.Tensor
            ``[rows, Hq, D]`` in ``q.dtype``.
        """
        out = torch.empty_like(q) if out is None else out
        for g in self._groups:
            q0, q1 = g.rows
            if q1 == q0:
                continue
            qs, os_ = q[q0:q1], out[q0:q1]
            first, *rest = g.calls
            if not rest:
                first(qs, k, v, os_)
                continue
            lse, o2, lse2 = g.merge
            first(qs, k, v, os_, lse)
            for c in rest:
                c(qs, k, v, o2, lse2)
                self._merge(os_, lse, o2, lse2)
            self.stats["merges"] += len(rest)
        self.stats["calls"] += self._num_calls
        self.stats["contiguous"] += self._contiguous
        self.stats["materialized"] += self._materialized
        return out


def merge_in_place():
    """``flashinfer.merge_state_in_place`` (v, s, v_other, s_other: ``v``, ``s`` updated), as the
    cascade module's op itself where ``FAST_RUN_VERSION`` is installed: the API wrapper's logging
    and checks cost ~10 us a layer and its ``.to(float32)`` is a no-op on the float32 LSE here."""
    import flashinfer

    if flashinfer.__version__ != FAST_RUN_VERSION:
        return flashinfer.merge_state_in_place
    from flashinfer.cascade import get_cascade_module

    op = get_cascade_module().merge_state_in_place
    return lambda v, s, v_other, s_other: op(v, s, v_other, s_other, None)
