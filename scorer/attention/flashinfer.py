"""FlashInfer attention: every attention call of a plan as one paged batch-prefill call.

The K/V of a layer is the page pool itself (``page_size = 1``): ``k`` and ``v`` of shape
``[slots, Hkv, D]`` are handed to FlashInfer as ``[slots, 1, Hkv, D]`` views, so no K/V is
copied. ``plan`` runs once per forward pass: it turns the host-side metadata of each call into
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
  server waits for. ``_Launch`` builds the arguments of the module's ``paged_run`` once per plan,
  as ``run`` builds them in FlashInfer ``FAST_RUN_VERSION`` (AOT modules, no cuDNN/TRT-LLM, no
  fp8, NHD); other versions take ``run`` itself.
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
Measured on the H200 (bench/RESULTS.md section 15): in serving batches (12-16k rows) FA2's
attention is 1.1-2.0x faster where queries see ~200-300 keys (200- to 300-token prompts: a 50-token
doc is one 128-row tile, which FA2 fills with both query heads of a KV head and FA3 does not; even
with 400-token docs), FA3 1.4-1.5x faster at ~1,900 (2,000-token prompts) and ~4,000 (8,000); on
one call of a few docs (section 3's kernel grid, hundreds of rows) FA3 is up to 3.5x faster, so a
small call keeps FA3."""


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


@dataclass
class _Planned:
    rows: tuple[int, int]
    wrappers: list  # one per call of the merge group
    launch: _Launch | None = None  # a group of one call, where the fast launch applies


class _Launch:
    """``wrapper.run(q, (k, v), out=out)`` as the module's ``paged_run`` with the arguments
    ``run`` would pass, fixed once the wrapper is planned (see the module's docstring)."""

    def __init__(self, w, spec: HeadSpec) -> None:
        from flashinfer.prefill import MaskMode, TensorLayout
        from flashinfer.utils import _get_cache_alibi_slopes_buf, device_support_pdl

        mask = MaskMode.CAUSAL.value if w._causal else MaskMode.NON_CAUSAL.value
        if w._custom_mask_buf is not None:
            mask = MaskMode.CUSTOM.value
        if w._prefix_len_ptr is not None:
            mask = MaskMode.MULTIITEMSCORING.value
        self.run = w._cached_module.paged_run
        self.head = (w._float_workspace_buffer, w._int_workspace_buffer, w._plan_info)
        self.mid = (
            w._qo_indptr_buf,
            w._paged_kv_indptr_buf,
            w._paged_kv_indices_buf,
            w._paged_kv_last_page_len_buf,
        )
        self.mode = (mask, TensorLayout[w._kv_layout].value, w._window_left, device_support_pdl(spec.device))
        sm_scale = w._sm_scale if w._sm_scale is not None else 1.0 / math.sqrt(spec.head_dim)
        alibi = _get_cache_alibi_slopes_buf(spec.num_qo_heads, spec.device)
        self.masks = (w._custom_mask_buf, w._mask_indptr_buf, alibi)
        self.items = (w._prefix_len_ptr, w._token_pos_in_items_ptr, w._max_item_len_ptr)
        self.scales = (w._logits_soft_cap or 0.0, sm_scale, None, None, None)
        self.rope = (w._rope_scale or 1.0, w._rope_theta or 1e4, w._token_pos_in_items_len, w._workspace_size)
        self.tail = (w._num_qo_heads, w._num_kv_heads, w._block_tables, w._kv_lens_buffer)
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

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        self.run(
            *self.head,
            q,
            k,
            v,
            *self.mid,
            out,
            None,
            *self.mode,
            *self.masks,
            *self.items,
            *self.scales,
            *self.rope,
            *self.tail,
            k.shape[1],
            *self.lens,
            *self.rest,
        )


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
        Launch single-call groups through ``_Launch`` where it applies (False: always the
        wrapper's ``run``; the GPU tests compare the two).

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
    ) -> None:
        if kernels == "auto":
            kernels = os.environ.get(KERNELS_ENV, "auto") or "auto"
        if kernels not in KERNELS:
            raise ValueError(f"unknown FlashInfer kernels {kernels!r}; expected one of {KERNELS}")
        self.spec = spec
        self.fast_run = fast_run
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

    def kernel_for(self, c: AttentionCall) -> str:
        return choose_kernel(c, self.kernels, self._hopper)

    def plan(self, p: Pass) -> None:
        """Plan every call of ``p`` (host metadata -> device, no synchronisation). A failure
        raises: the call fails, the backend stays FlashInfer."""
        slot = self._next_slot()
        groups = []
        for members in p.merge_groups():
            wrappers = [self._plan_call(slot, i, p.calls[i]) for i in members]
            fast = len(wrappers) == 1 and self.fast_run and _Launch.applies(wrappers[0])
            launch = _Launch(wrappers[0], self.spec) if fast else None
            groups.append(_Planned(p.calls[members[0]].rows, wrappers, launch))
        ev = torch.cuda.Event()
        ev.record()
        self._ring_events[slot] = ev
        self._groups = groups
        self._num_calls = len(p.calls)

    def _next_slot(self) -> int:
        self._slot = (self._slot + 1) % RING
        ev = self._ring_events[self._slot]
        if ev is not None and not ev.query():
            ev.synchronize()  # the GPU is RING plans behind; never seen in the engine's use
        return self._slot

    def _wrapper(self, slot: int, index: int, kernel: str):
        import flashinfer

        key = (index, kernel)
        w = self._wrappers[slot].get(key)
        if w is None:
            # plan() updates the wrapper's buffers in place: they must not be inference tensors
            with torch.inference_mode(False):
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend=kernel)
            self._wrappers[slot][key] = w
        return w

    def _plan_call(self, slot: int, index: int, c: AttentionCall):
        s, dev = self.spec, self.spec.device
        kernel = self.kernel_for(c)
        w = self._wrapper(slot, index, kernel)
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
        w.plan(
            c.qo_indptr,
            c.kv_indptr,
            c.kv_indices,
            torch.ones(c.num_requests, dtype=torch.int32) if c.last_page_len is None else c.last_page_len,
            s.num_qo_heads,
            s.num_kv_heads,
            s.head_dim,
            c.page_size,
            causal=c.causal,
            sm_scale=s.sm_scale,
            q_data_type=s.dtype,
            kv_data_type=s.dtype,
            non_blocking=True,
            **kw,
        )
        if c.custom_mask is not None:
            w._mask_indptr_buf = to_device(c.custom_mask.indptr, dev)
        return w

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
        kv = (k, v) if k.dim() == 4 else (k.unsqueeze(1), v.unsqueeze(1))
        out = torch.empty_like(q) if out is None else out
        for g in self._groups:
            q0, q1 = g.rows
            if q1 == q0:
                continue
            qs, os_ = q[q0:q1], out[q0:q1]
            if g.launch is not None:
                g.launch(qs, *kv, os_)
                continue
            if len(g.wrappers) == 1:
                g.wrappers[0].run(qs, kv, out=os_)
                continue
            _, lse = g.wrappers[0].run(qs, kv, out=os_, return_lse=True)
            for w in g.wrappers[1:]:
                o2, lse2 = w.run(qs, kv, return_lse=True)
                _merge_state_in_place(os_, lse, o2, lse2)
            self.stats["merges"] += len(g.wrappers) - 1
        self.stats["calls"] += self._num_calls
        return out


def _merge_state_in_place(v, s, v_other, s_other) -> None:
    import flashinfer

    flashinfer.merge_state_in_place(v, s, v_other, s_other)
