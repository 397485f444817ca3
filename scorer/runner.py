"""The model runner: the model on its device, its CUDA graphs, the attention backend and the K/V
pool of each plan. ``forward`` runs a plan's passes and returns the hidden state of every item's
score row, in plan order; it does no per-item work in Python (the plan carries the rows)."""

from __future__ import annotations

import logging
from collections import Counter

import torch

from .attention.base import AttentionBackend
from .attention.kvpool import CachePool, KVPool
from .devices import to_device
from .models.decoder import DecoderLM
from .models.graphs import GraphedDecoder
from .planning import Plan
from .prefix_cache import PrefixCache

log = logging.getLogger(__name__)


GRAPH_COPY_ROWS = 2048
"""A pass off the prefix cache's pool that writes rows to it (``Pass.copies``) of up to this many
rows writes them through the graphs' pool-write step: every row of its bucket stored, the rest to
the spare slots, one replay a layer. A larger one copies only its kept rows, four eager launches a
layer. On the H200 (``bash scripts/gpu/prefix_cache.sh states``) the graphed write
cost E's batches of 3 and 11 calls 6-8% of their docs/s (torch's index_copy_ of every row) and the
eager copies a lone A call 2.5 ms of launch: small passes are the lone calls, whose launch is their
latency; under load the host plans ahead of the device and the copies' launches cost nothing."""


class ModelRunner:
    """``cuda_graph_max_tokens``: on CUDA, passes up to this many tokens replay piecewise CUDA
    graphs (once captured); 0: every pass runs eagerly."""

    def __init__(self, model: DecoderLM, backend: AttentionBackend, cuda_graph_max_tokens: int = 0) -> None:
        self.model = model
        self.backend = backend
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.stats: Counter = Counter()
        n = cuda_graph_max_tokens
        self.graphs = GraphedDecoder(model, n) if n > 0 and self.device.type == "cuda" else None

    def capture_graphs(self, cache: PrefixCache | None = None) -> float:
        """Capture the CUDA graphs of every token bucket (seconds taken; 0 without graphs). Until
        then every forward runs eagerly; so does every forward when the capture runs out of
        memory (logged: lower ``cuda_graph_max_tokens``). With ``cache``, each bucket also gets the
        graphs that write a layer's K/V to its pool, for passes that write it
        (``GraphedDecoder.attach_pool``)."""
        if self.graphs is None:
            return 0.0
        if cache is not None:
            self.graphs.attach_pool(cache.k, cache.v, cache.spare, cache.spare_slots)
        try:
            return self.graphs.warm_up()
        except torch.OutOfMemoryError as e:
            log.warning(
                "CUDA graphs up to %d tokens do not fit (%s); forwards run eagerly", self.graphs.max_tokens, e
            )
            self.graphs = None
            torch.cuda.empty_cache()
            return 0.0

    def forward(
        self, plan: Plan, ids: torch.Tensor, positions: torch.Tensor, cache: PrefixCache | None = None
    ) -> torch.Tensor:
        """Run every pass of ``plan`` over the batch's logical tokens (``ids``, ``positions``);
        returns the final hidden state of each item's score row [items, hidden], in plan order.
        A plan on the prefix cache's pool (``plan.on_pool``) reads and writes ``cache``'s K/V; a
        pass with ``copies`` writes those rows' K/V to it."""
        mc = self.model.config
        if plan.on_pool:
            pool = CachePool(cache.k, cache.v)
        else:
            pool = KVPool(plan, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype, self.device)
            self.stats["pooled_forwards"] += pool.pools is not None  # passes copying K/V for later ones
        rows = []
        for p, score_rows in zip(plan.passes, plan.score_rows, strict=True):
            self.backend.plan(p)
            logical = to_device(p.logical, self.device)
            slots = to_device(p.slots, self.device) if p.slots is not None else None
            # the graphs write the pool (one small graph a layer) where the pass fits a bucket
            graphs = self.graphs
            graphed = cache is not None and graphs is not None and graphs.writes_pool(cache.k, p.num_rows)
            written = plan.on_pool and graphed
            copies = None
            if p.copies is not None:
                copies = tuple(to_device(t, self.device) for t in p.copies)
                self.stats["pool_copy_passes"] += 1
            graph_copies = graphed and p.num_rows <= GRAPH_COPY_ROWS
            eager_copies = None if graph_copies else copies

            def attn(layer, q, k, v, out=None, p=p, slots=slots, written=written, copies=eager_copies):
                if copies is not None:  # the rows the prefix cache keeps, from a pass off its pool
                    rows, to = copies
                    cache.k[layer].index_copy_(0, to, k.index_select(0, rows))
                    cache.v[layer].index_copy_(0, to, v.index_select(0, rows))
                kv = pool.read(layer) if written else pool.write(layer, p, k, v, slots)
                return self.backend.run(layer, q, *kv, out=out)

            if graphs is not None:
                pool_slots, pool_rows = (slots if written else None), (copies if graph_copies else None)
                hidden = graphs.forward_hidden(ids[logical], positions[logical], attn, pool_slots, pool_rows)
            else:
                hidden = self.model.forward_hidden(ids[logical], positions[logical], attn)
            rows.append(hidden[to_device(score_rows, self.device)])
            self.stats["forward_passes"] += 1
            self.stats["tokens_computed"] += p.num_rows
        out = rows[0] if len(rows) == 1 else torch.cat(rows)
        if plan.item_order is not None:
            out = out[to_device(plan.item_order, self.device)]
        self.stats["lm_head_rows"] += len(out)
        return out
