"""The prefix cache: prompt K/V kept across calls in a persistent pool on the device.

The pool holds ``capacity`` K/V slots per layer (page size 1, as every plan uses). An index of
blocks of ``BLOCK`` prompt tokens maps a prompt to the slots of its cached prefix: block ``i`` of a
prompt is keyed by (the id of block ``i - 1``, the salt, its tokens), so a hit is exact (dict
equality on the token ids, never a hash alone) and calls with different salts never share K/V.
Every batch on the cache holds a ``Lease``: the blocks it reads (reference counted, so no block a
batch in flight reads is evicted or overwritten), the blocks it writes (indexed when the batch is
planned, so a later call of the same batch or of the next batch reads them: the device runs
batches in launch order) and its scratch slots (the rows that are not cached: docs, naive's
copies), all given back when the batch is collected. Eviction takes the least recently used leaf
block that no lease holds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import metrics
from .planning.cached import NO_HIT, PrefixHit

BLOCK = 16
"""Prompt tokens per index block: a prompt is cached and matched in whole blocks."""
CPU_AUTO_MIB = 64
"""``--prefix-cache-mib auto`` on the CPU."""
GPU_AUTO_SHARE = 0.4
"""``--prefix-cache-mib auto`` on a GPU: this share of the memory free after the model loaded
(the rest is left to activations, CUDA graphs and the K/V of plans off the cache)."""


def slot_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K and V over every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def auto_mib(device: torch.device) -> int:
    """The pool size ``auto`` takes on ``device``."""
    if device.type != "cuda":
        return CPU_AUTO_MIB
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * GPU_AUTO_SHARE) >> 20


@dataclass(eq=False)
class _Block:
    key: tuple
    id: int
    parent: _Block | None
    slots: torch.Tensor  # int64 [BLOCK]
    refs: int = 0
    children: int = 0


@dataclass(eq=False)
class Lease:
    """What one batch holds of the cache until it is collected (``release``) or fails to launch
    (``abort``: the blocks it was to write are dropped again)."""

    cache: PrefixCache
    held: list[_Block] = field(default_factory=list)
    written: list[_Block] = field(default_factory=list)
    scratch: list[torch.Tensor] = field(default_factory=list)
    done: bool = False

    def alloc_scratch(self, n: int) -> torch.Tensor:
        slots = self.cache.alloc(n)
        if slots is None:
            raise PoolFull(f"{n} scratch slots do not fit the prefix cache's pool")
        self.scratch.append(slots)
        return slots

    def release(self) -> None:
        self.cache.end(self, keep_written=True)

    def abort(self) -> None:
        self.cache.end(self, keep_written=False)


class PoolFull(RuntimeError):
    """The batch does not fit the pool beside what batches in flight hold; it runs off the cache."""


class PrefixCache:
    def __init__(
        self,
        capacity: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        block: int = BLOCK,
    ) -> None:
        if capacity < block:
            raise ValueError(f"a prefix cache of {capacity} slots holds no block of {block} tokens")
        self.capacity, self.block = capacity, block
        self.slot_bytes = slot_bytes(num_layers, num_kv_heads, head_dim, dtype)
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self._free = torch.arange(capacity - 1, -1, -1, dtype=torch.int64)  # a stack: top at the end
        self._top = capacity
        self._index: dict[tuple, _Block] = {}
        self._lru: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self._ids = 0
        self._lock = threading.Lock()
        self.stats = {"hit_tokens": 0, "lookup_tokens": 0, "evictions": 0, "off_pool_batches": 0}
        metrics.PREFIX_CACHE_BYTES.labels(kind="capacity").set(capacity * self.slot_bytes)
        self._report()

    @classmethod
    def for_model(cls, mib: int, config, dtype: torch.dtype, device: torch.device) -> PrefixCache | None:
        """A pool of ``mib`` MiB for a model of ``config`` (None for 0 or less than one block)."""
        per = slot_bytes(config.num_layers, config.num_kv_heads, config.head_dim, dtype)
        capacity = (mib << 20) // per
        if capacity < BLOCK:
            return None
        return cls(capacity, config.num_layers, config.num_kv_heads, config.head_dim, dtype, device)

    # -- the index -------------------------------------------------------------------------------

    def peek(self, ids: Sequence[int], salt: str = "") -> int:
        """Prompt tokens of ``ids`` cached now (a hint for ``auto``; nothing is held)."""
        return len(self._match(tuple(ids), salt)) * self.block

    def _match(self, ids: tuple[int, ...], salt: str) -> list[_Block]:
        out: list[_Block] = []
        parent, b = 0, self.block
        for i in range(0, len(ids) - len(ids) % b, b):
            blk = self._index.get((parent, salt, ids[i : i + b]))
            if blk is None:
                break
            out.append(blk)
            parent = blk.id
        return out

    def reserve(self, prompts: Sequence[tuple[tuple[int, ...], str] | None]) -> tuple[list[PrefixHit], Lease]:
        """The hits of a batch's prompts (None: a call off the cache), in order, under one lease:
        each prompt's cached blocks are held and its next whole blocks are indexed with fresh
        slots (as many as the pool can free), so a later prompt of the batch reads them."""
        lease = Lease(self)
        hits = []
        with self._lock:
            for prompt in prompts:
                if prompt is None:
                    hits.append(NO_HIT)
                    continue
                ids, salt = prompt
                blocks = self._match(ids, salt)
                self.stats["hit_tokens"] += len(blocks) * self.block
                self.stats["lookup_tokens"] += len(ids)
                metrics.PREFIX_CACHE_HIT_TOKENS.inc(len(blocks) * self.block)
                metrics.PREFIX_CACHE_LOOKUP_TOKENS.inc(len(ids))
                for blk in reversed(blocks):  # the leaf least recent: evicted before its parents
                    self._lru.move_to_end(blk.id)
                    blk.refs += 1
                lease.held += blocks
                new = self._insert(ids, salt, blocks[-1] if blocks else None, len(blocks), lease)
                hits.append(PrefixHit(_cat([b.slots for b in blocks]), _cat([b.slots for b in new])))
            self._report()
        return hits, lease

    def _insert(self, ids, salt, parent: _Block | None, start: int, lease: Lease) -> list[_Block]:
        new, b = [], self.block
        for i in range(start * b, len(ids) - len(ids) % b, b):
            slots = self._alloc(b)
            if slots is None:
                break
            self._ids += 1
            blk = _Block((parent.id if parent else 0, salt, ids[i : i + b]), self._ids, parent, slots, refs=1)
            if parent is not None:
                parent.children += 1
            self._index[blk.key] = blk
            self._lru[blk.id] = blk
            new.append(blk)
            parent = blk
        lease.written += new
        return new

    def end(self, lease: Lease, keep_written: bool) -> None:
        with self._lock:
            if lease.done:
                return
            lease.done = True
            for blk in lease.held + lease.written:
                blk.refs -= 1
            if not keep_written:
                for blk in reversed(lease.written):
                    self._evict(blk, count=False)
            for slots in lease.scratch:
                self._release(slots)
            self._report()

    def clear(self) -> None:
        """Evict every block no batch holds, and zero ``stats``."""
        with self._lock:
            self.stats = dict.fromkeys(self.stats, 0)
            for blk in sorted(self._lru.values(), key=lambda b: -b.id):  # children before parents
                if blk.refs == 0 and blk.children == 0:
                    self._evict(blk, count=False)
            self._report()

    # -- slots -----------------------------------------------------------------------------------

    def alloc(self, n: int) -> torch.Tensor | None:
        with self._lock:
            return self._alloc(n)

    def _alloc(self, n: int) -> torch.Tensor | None:
        while self._top < n:
            victim = next((b for b in self._lru.values() if b.refs == 0 and b.children == 0), None)
            if victim is None:
                return None
            self._evict(victim, count=True)
        self._top -= n
        return self._free[self._top : self._top + n].clone()

    def _evict(self, blk: _Block, count: bool) -> None:
        del self._index[blk.key]
        del self._lru[blk.id]
        if blk.parent is not None:
            blk.parent.children -= 1
        self._release(blk.slots)
        if count:
            self.stats["evictions"] += 1
            metrics.PREFIX_CACHE_EVICTIONS.inc()

    def _release(self, slots: torch.Tensor) -> None:
        self._free[self._top : self._top + len(slots)] = slots
        self._top += len(slots)

    def _report(self) -> None:
        metrics.PREFIX_CACHE_BYTES.labels(kind="used").set(len(self._lru) * self.block * self.slot_bytes)

    @property
    def cached_blocks(self) -> int:
        return len(self._lru)

    @property
    def free_slots(self) -> int:
        return self._top


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
