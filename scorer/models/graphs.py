"""Piecewise CUDA graphs for the decoder: everything but attention is replayed from graphs.

An eager forward of a small model is host-bound: about 60 small kernels per layer, each a Python
call and a launch (bench/RESULTS.md, Model level and the calibrated `auto`), so a Qwen3-0.6B
forward costs ~24 ms on an H200 whether it computes 16 tokens or 4096. Attention cannot sit inside
a graph cheaply: its metadata (page table, item layout, number of requests) changes with every
request. So, as vLLM's piecewise graphs do, the forward is cut at the attention calls: segment
``i`` is the end of layer ``i - 1`` (output projection, residuals, MLP) and the start of layer
``i`` (norm, QKV, q/k norm, RoPE), captured once per token-count bucket; the planned attention runs
eagerly between them. A forward is then ``L + 1`` graph replays and ``L`` attention calls.

With the prefix cache's pool attached (``attach_pool``), each bucket also has one small graph a
layer that writes that layer's K/V to the pool at the slots of a static buffer (the pass's
``slots``, or the rows the cache keeps of a pass off the pool; every other row to the pool's
spare slots, spread so that no address takes thousands of stores), replayed after segment ``i``
by a pass that writes the pool only: such a pass launches no copies of its own (two per layer,
~0.8 ms of host time in a 28-layer forward of one call), and a pass that writes nothing stores
nothing (segments that wrote every pass's K/V, to the spare slots when off the pool, cost E's
batches 7-8% of the engine's docs/s with the cache on: bench/RESULTS.md, What did not pay).

Inputs and outputs of the segments live in buffers allocated once for the largest bucket; a
request of ``T`` tokens runs in the smallest bucket ``>= T`` and its rows ``T..bucket`` are
padding, which the row-wise segments compute and nobody reads (attention sees rows ``:T`` only).
Without capture (``capture=False``, e.g. on the CPU) the same segments run eagerly over the same
buffers, which is how the padding and buffer plumbing is tested without a GPU.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable
from functools import partial

import torch

from .decoder import AttnFn, DecoderLM
from .rope import Rope
from .triton_ops import qkv_views

log = logging.getLogger(__name__)


FINE = (0.25, 128)
"""(f, n): from ``f * max_tokens`` up, a bucket every ``max_tokens / n`` rows."""
TOP_QUARTER = (0.75, 64)
"""Finer buckets in the top quarter alone, every ``max_tokens / 64`` rows (what ``FINE`` replaced;
benchmarks compare the two)."""


def buckets(max_tokens: int, fine: tuple[float, int] | None = FINE) -> list[int]:
    """Token-count buckets up to ``max_tokens``: multiples of 16 growing by at most 1/8 (padding costs
    under 12.5% of a large pass's rows), and finer where a loaded server's passes land (a batch
    filled to the budget but for the call that did not fit, a long call's last pass): by default one
    every ``max_tokens / 128`` rows (128 of 16,384) from a quarter of the budget up, so a pass there
    pads at most 1/32 of its rows (1/128 at the top). With the top quarter alone fine (``TOP_QUARTER``),
    B's 12,000-token batches padded 2.4%, E's 1.4% (137 buckets now against 67: 9.8 s of capture at
    start on an H200 with the prefix cache's pool attached, 3.3-3.7 s before). ``fine=None``: the 1/8
    growth alone."""
    out, b = [], 16
    while b < max_tokens:
        out.append(b)
        b = max(b + 16, (b * 9 // 8) // 16 * 16)
    if fine:
        f, n = fine
        step = max(16, max_tokens // n // 16 * 16)
        start = max(step, int(max_tokens * f) // step * step)
        out = [x for x in out if x < start] + list(range(start, max_tokens, step))
    return out + [max_tokens] if max_tokens >= 1 else out


class GraphedDecoder:
    """``forward_hidden`` of ``model`` over piecewise CUDA graphs, for up to ``max_tokens`` tokens.

    Longer inputs run the model eagerly. The returned hidden states are a view of a shared
    buffer: valid until the next call.
    """

    def __init__(self, model: DecoderLM, max_tokens: int, capture: bool = True) -> None:
        self.model = model
        self.buckets = buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.capture = capture
        self.stats: Counter = Counter()
        mc = model.config
        p = next(model.parameters())
        dev, dt, n = p.device, p.dtype, self.max_tokens
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.h = torch.zeros(n, mc.hidden_size, dtype=dt, device=dev)
        self.qkv = None  # the QKV GEMM's output, q/k/v views of it (``qkv_in_place``)
        if model.qkv_in_place:
            width = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
            self.qkv = torch.zeros(n, width, dtype=dt, device=dev)
            self.q, self.k, self.v = qkv_views(self.qkv, mc.num_heads, mc.num_kv_heads, mc.head_dim)
        else:
            self.q = torch.zeros(n, mc.num_heads, mc.head_dim, dtype=dt, device=dev)
            self.k = torch.zeros(n, mc.num_kv_heads, mc.head_dim, dtype=dt, device=dev)
            self.v = torch.zeros_like(self.k)
        self.attn = torch.zeros(n, mc.num_heads, mc.head_dim, dtype=dt, device=dev)
        self.cos = self.sin = None  # HF's RoPE tables; the fused RoPE reads its cache instead
        if not model.uses_rope_cache:
            self.cos = torch.zeros(n, 1, mc.head_dim, dtype=dt, device=dev)
            self.sin = torch.zeros_like(self.cos)
        self._segments: dict[int, list[Callable[[], None]]] = {}
        self._writes: dict[int, list[Callable[[], None]]] = {}  # a bucket's pool writes, one a layer
        self.pool: tuple[torch.Tensor, torch.Tensor] | None = None
        self.slots: torch.Tensor | None = None
        self.spare: torch.Tensor | None = None

    def attach_pool(self, k: torch.Tensor, v: torch.Tensor, spare: int, spare_slots: int) -> None:
        """Write every layer's K/V to ``k``/``v`` [layers, slots, Hkv, D] too (before ``warm_up``);
        row ``r`` with no slot of its own goes to slot ``spare + r % spare_slots``."""
        if self._segments:
            raise RuntimeError("attach the pool before the graphs are captured")
        self.pool = (k, v)
        rows = torch.arange(self.max_tokens, device=self.ids.device)
        self.spare = spare + rows % spare_slots
        self.slots = self.spare.clone()

    def writes_pool(self, k: torch.Tensor, n: int) -> bool:
        """Does a pass of ``n`` rows write its K/V to the pool ``k`` (the attached one, graphed)?"""
        return (
            self.pool is not None
            and self.pool[0] is k
            and bool(self._segments)
            and self.bucket(n) is not None
        )

    def bucket(self, n: int) -> int | None:
        i = bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    def _segment(self, i: int, n: int) -> None:
        """Segment ``i`` over the first ``n`` rows of the buffers."""
        m, h = self.model, self.h[:n]
        # fused kernels: positions and the cache, nothing to compute; else HF's tables, computed
        # once per forward in segment 0 and read by every segment
        rope = m.rope(self.pos[:n], h.dtype) if m.uses_rope_cache else Rope(self.cos[:n], self.sin[:n])
        if i == 0:
            h.copy_(m.embed(self.ids[:n]))
            if not m.uses_rope_cache:
                tables = m.rope(self.pos[:n], h.dtype)
                rope.cos.copy_(tables.cos)
                rope.sin.copy_(tables.sin)
        heads = self.qkv[:n] if self.qkv is not None else (self.q[:n], self.k[:n], self.v[:n])
        if i == 0:
            m.layer_qkv(0, h, rope, out=heads)
        elif i < m.num_layers:
            m.layer_next(i - 1, h, self.attn[:n], rope, out=heads)
        else:
            m.layer_finish(i - 1, h, self.attn[:n], out=h)

    def _write(self, i: int, n: int) -> None:
        """Layer ``i``'s K/V of the first ``n`` rows to the pool, at ``slots``."""
        self.pool[0][i].index_copy_(0, self.slots[:n], self.k[:n])
        self.pool[1][i].index_copy_(0, self.slots[:n], self.v[:n])

    def _build(self, steps: list[Callable[[], None]], pool) -> list[Callable[[], None]]:
        """``steps`` captured one graph each (as they are without capture)."""
        if not self.capture:
            return steps
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture: cuBLAS handles, lazy inits
            for step in steps:
                step()
        torch.cuda.current_stream().wait_stream(side)
        graphs = []
        for step in steps:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                step()
            graphs.append(g.replay)
        return graphs

    def warm_up(self) -> float:
        """Capture (or prepare) every bucket, largest first so smaller ones reuse its memory pool;
        returns the seconds it took."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.capture else None
        with torch.inference_mode():
            layers = self.model.num_layers
            for n in reversed(self.buckets):
                self._segments[n] = self._build(
                    [partial(self._segment, i, n) for i in range(layers + 1)], pool
                )
                if self.pool is not None:
                    self._writes[n] = self._build([partial(self._write, i, n) for i in range(layers)], pool)
        if self.capture:
            torch.cuda.synchronize()
        took = time.perf_counter() - t0
        log.info(
            "captured %d CUDA graph buckets up to %d tokens in %.1f s",
            len(self.buckets),
            self.max_tokens,
            took,
        )
        return took

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttnFn,
        pool_slots: torch.Tensor | None = None,
        pool_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """As ``DecoderLM.forward_hidden``; ``attn`` is called with ``out=`` a buffer to fill.
        With a pool attached, ``pool_slots`` [T] are where the rows' K/V go, or ``pool_rows``
        (rows, slots) where some of them go, the rest to the spare slots (None: nowhere); the
        graphs write them before each ``attn`` call (eager passes do not)."""
        n = input_ids.shape[0]
        b = self.bucket(n)
        if b is None or not self._segments:
            self.stats["eager_forwards"] += 1
            return self.model.forward_hidden(input_ids, positions, attn)
        self.ids[:n].copy_(input_ids)
        self.pos[:n].copy_(positions)
        writes = None
        if pool_slots is not None or pool_rows is not None:
            if pool_slots is not None:
                self.slots[:n].copy_(pool_slots)
                self.slots[n:b].copy_(self.spare[n:b])
            else:
                self.slots[:b].copy_(self.spare[:b])
                self.slots.index_copy_(0, *pool_rows)
            writes = self._writes[b]
            self.stats["pool_written_forwards"] += 1
        segments = self._segments[b]
        for layer, run in enumerate(segments[:-1]):
            run()
            if writes is not None:
                writes[layer]()
            attn(layer, self.q[:n], self.k[:n], self.v[:n], out=self.attn[:n])
        segments[-1]()
        self.stats["graphed_forwards"] += 1
        return self.h[:n]
