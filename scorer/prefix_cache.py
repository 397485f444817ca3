"""The prefix cache: prompt K/V kept across calls in a persistent pool on the device.

The pool holds ``capacity`` K/V slots per layer (page size 1, as every plan uses), handed out in
pages of ``BLOCK`` slots (host work per page, not per slot). An index of
blocks of ``BLOCK`` prompt tokens maps a prompt to the pages of its cached prefix: block ``i`` of a
prompt is keyed by its chain digest, BLAKE2b-256 of (block ``i - 1``'s digest, its token ids),
the first block's predecessor being the digest of the salt (``block_digests``). So a key names a
block's whole prefix and salt, a hit is exact to a 256-bit hash's collision resistance (as
vLLM's sha256 prefix hashing), and calls with different salts never share K/V. A prompt's digests
are computed once (~0.6 us a block on a 2-core VM) and kept with the prompts matched lately,
found by the SHA-256 of their salt and ids (``prompt_key``: ~3 us per 1,000 ids, once per call),
so a repeated prompt costs a hash of its bytes, not a step per block.
Every batch on the cache holds a ``Lease``: the deepest block of each prompt it reads and every
block it writes (reference counted), the blocks it writes being indexed when the batch is planned,
so a later call of the same batch or of the next batch reads them (the device runs batches in
launch order), and its scratch slots (the rows that are not cached: docs, naive's copies), all
given back when the batch is collected. Only leaf blocks are evicted, least recently used first
and never one a lease holds; so holding a prompt's deepest block keeps its whole chain, and a
block's ancestors are live while it is.

Admission (``admit``): a prompt's blocks are written to the pool on their first sighting or on
their second. Blocks seen and not cached are remembered by digest (as many as the pool holds
blocks, ``SEEN`` at most; least recently seen forgotten first), and on the second sighting a
prompt writes the blocks seen before. That costs a prompt that repeats a second full compute (of
ten calls of an 8,000-token prompt, two computed it: 3.0x cache-off on an H100 where the first
sighting's write would allow more, bench/RESULTS.md) but protects the pool from prompts that do
not come back: a prompt seen once (a unique query) writes nothing, and a set larger than the pool,
cycled, is forgotten before it returns (without this rule the served sweeps' 4,000 prompts wrote
and evicted on every call, and hit 1-9% of their tokens). ``auto`` (the default) picks between
the two by what came back lately: each block written on its first sighting is on trial until it
is read (it came back) or evicted unread (it did not); each block remembered as seen comes back on
its second sighting or is forgotten. Over about the last pool's worth of such outcomes (``seen_limit``
blocks: past that, both counts are halved), if at least ``MIN_REUSE`` of the blocks came back,
blocks are written on first sight; else on the second. (``python -m bench.admission`` replays
traffic shapes under each rule.)
Writing costs a copy of the block's rows (~2% of a batch that writes every prompt, against one
that writes none, bench/RESULTS.md) and a read saves most of the block's compute, so the write
pays where more than a few percent come back. A call that neither reads nor writes the pool plans
off it, and a batch of such calls runs exactly as without a cache (no pool writes, no scattered
K/V reads: bench/RESULTS.md, The prefix cache, measures what they cost).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from . import metrics
from .lazy_torch import torch
from .options import CPU_AUTO_MIB, GPU_AUTO_SHARE
from .planning.cached import PrefixHit, no_hit
from .token_ids import TokenIds

BLOCK = 16
"""Prompt tokens per index block: a prompt is cached and matched in whole blocks."""
RECENT = 256
"""Prompts whose block digests and cached blocks are remembered whole: a prompt seen lately is
matched with one lookup (hashing its ids once) instead of one per block."""
SEEN = 1 << 16
"""Block chains remembered as seen-but-not-cached, for admission on a later sighting, at most
(fewer where the pool holds fewer blocks)."""
MIN_REUSE = 1 / 16
"""The share of blocks that must come back for ``auto`` to write blocks on their first sighting:
a write costs a copy, a read saves most of a compute (module docstring), so writing pays from a
few percent; 1 in 16 leaves a margin for the blocks those writes evict."""
ADMIT = ("auto", 1, 2)


def admission(admit: int | str) -> int | str:
    """``admit`` as the cache holds it (a flag's string "1" or "2" as its number); ValueError for a
    value that is none of ``ADMIT``."""
    admit = int(admit) if str(admit) in ("1", "2") else admit
    if admit not in ADMIT:
        raise ValueError(
            f"admit is auto, 1 (cache a block when first seen) or 2 (when seen again), not {admit!r}"
        )
    return admit


DIGEST = 32
"""Bytes of a block's digest (BLAKE2b-256)."""


def as_ids(ids: Sequence[int]) -> TokenIds:
    return ids if isinstance(ids, TokenIds) else TokenIds(ids)


def _salt_digest(salt: str) -> bytes:
    return hashlib.blake2b(salt.encode(), digest_size=DIGEST, person=b"scorer-salt").digest()


def block_digests(data: bytes, salt: str, block: int, n: int) -> list[bytes]:
    """The chain digests of the first ``n`` blocks of ``block`` ids of ``data`` (``TokenIds.data``):
    block ``i``'s is BLAKE2b-256 of block ``i - 1``'s and its ids' bytes, block 0's predecessor
    the salt's digest. Equal for equal (salt, ids up to the block's end), else different but for
    a collision of the hash."""
    out: list[bytes] = []
    _extend(out, memoryview(data), salt, block, n)
    return out


def _extend(digests: list[bytes], data: memoryview, salt: str, block: int, n: int) -> None:
    """``digests`` (a prompt's first, as ``block_digests``) grown to ``n``."""
    digest, size = digests[-1] if digests else _salt_digest(salt), 4 * block
    for i in range(len(digests), n):
        digest = hashlib.blake2b(digest + data[i * size : (i + 1) * size], digest_size=DIGEST).digest()
        digests.append(digest)


class _Chain:
    """A prompt's block digests (``block_digests``) of the ``n`` blocks ``_match`` can read,
    computed as far as they are asked for: a prompt whose first block is not cached needs one
    (~0.6 us a block on a 2-core VM), until it is written (``_insert``: all of them)."""

    __slots__ = ("data", "salt", "block", "n", "digests")

    def __init__(self, ids: TokenIds, salt: str, block: int) -> None:
        self.data: memoryview | None = memoryview(ids.data)
        self.salt, self.block = salt, block
        self.n = max(0, (len(ids) - 1) // block)
        self.digests: list[bytes] = []

    def grow(self, k: int) -> list[bytes]:
        """The digests, the first ``k`` (at most ``n``) computed."""
        k = min(k, self.n)
        if len(self.digests) < k:
            _extend(self.digests, self.data, self.salt, self.block, k)
            if k == self.n:
                self.data = None  # every digest made: the ids are no longer needed
        return self.digests


def prompt_key(ids: TokenIds, salt: str) -> bytes:
    """A prompt's digest under ``salt`` (SHA-256 of the salt's digest and that of the ids, which
    ``ids`` keeps): what the prompts matched lately are found by."""
    return hashlib.sha256(_salt_digest(salt) + ids.digest()).digest()


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
    key: bytes  # its chain digest
    id: int
    parent: _Block | None
    page: int  # its K/V: slots page * BLOCK ..
    refs: int = 0
    children: int = 0
    live: bool = True  # False once evicted
    trial: int | None = None  # written on its first sighting, not read since: ``arrived`` then


@dataclass(eq=False)
class Lease:
    """What one batch holds of the cache until it is collected (``release``) or fails to launch
    (``abort``: the blocks it was to write are dropped again)."""

    cache: PrefixCache
    held: list[_Block] = field(default_factory=list)
    written: list[_Block] = field(default_factory=list)
    scratch: list[int] = field(default_factory=list)  # pages
    done: bool = False

    def alloc_scratch(self, n: int) -> torch.Tensor:
        pages = self.cache.alloc(-(-n // self.cache.block))
        if pages is None:
            raise PoolFull(f"{n} scratch slots do not fit the prefix cache's pool")
        self.scratch += pages
        return self.cache.slots(pages)[:n]

    def release(self) -> None:
        self.cache.end(self, keep_written=True)

    def abort(self) -> None:
        self.cache.end(self, keep_written=False)


SPARE_SLOTS = 4096
"""Spare slots of a pool (past its blocks' slots), for the K/V its graphs write and no block keeps:
a pass that writes some rows to the cache writes the rest there. 4,096 (470 MB for Qwen3-0.6B):
a pass of up to 4,096 rows stores each to its own address, so that no address takes thousands of
stores."""


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
        admit: int | str = "auto",
    ) -> None:
        if capacity < block:
            raise ValueError(f"a prefix cache of {capacity} slots holds no block of {block} tokens")
        self.capacity, self.block = capacity // block * block, block
        capacity = self.capacity
        self.slot_bytes = slot_bytes(num_layers, num_kv_heads, head_dim, dtype)
        # ``spare_slots`` slots more than the blocks hold, from ``spare`` on: where a CUDA graph that
        # writes every row of its bucket to the pool puts the rows the cache does not keep, spread
        # over them (thousands of rows stored to one address would queue up; see
        # GraphedDecoder.attach_pool); as many as the pool's slots at most
        self.spare, self.spare_slots = capacity, min(SPARE_SLOTS, capacity)
        shape = (num_layers, capacity + self.spare_slots, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self._free = list(range(capacity // block - 1, -1, -1))  # pages, a stack
        self._in_page = np.arange(block, dtype=np.int64)
        self._index: dict[bytes, _Block] = {}
        self._leaves: OrderedDict[int, _Block] = OrderedDict()  # blocks without children, LRU first
        self._ids = 0
        # prompt_key -> (its block digests, its cached blocks when last matched, their slots)
        self._recent: OrderedDict[bytes, tuple[_Chain, tuple, torch.Tensor | None]] = OrderedDict()
        self.admit = admission(admit)
        self.came_back = self.lost = 0.0  # block outcomes weighed by ``auto``, halved past seen_limit
        self.arrived = 0  # blocks written or remembered as seen, ever: the clock of a block's reach
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # digests of blocks seen, not cached
        self.seen_limit = min(SEEN, capacity // block)  # the pool's reach, in blocks
        self._lock = threading.RLock()
        self.stats = dict.fromkeys(
            ("hit_tokens", "lookup_tokens", "declined_tokens", "evictions", "off_pool_batches"), 0
        )
        metrics.PREFIX_CACHE_BYTES.labels(kind="capacity").set(capacity * self.slot_bytes)
        self._report()

    @classmethod
    def for_model(
        cls, mib: int, config, dtype: torch.dtype, device: torch.device, admit: int | str = "auto"
    ) -> PrefixCache | None:
        """A pool of ``mib`` MiB for a model of ``config`` (None for 0 or less than one block)."""
        per = slot_bytes(config.num_layers, config.num_kv_heads, config.head_dim, dtype)
        capacity = (mib << 20) // per
        if capacity < BLOCK:
            return None
        return cls(
            capacity, config.num_layers, config.num_kv_heads, config.head_dim, dtype, device, admit=admit
        )

    # -- the index -------------------------------------------------------------------------------

    def peek(self, ids: Sequence[int], salt: str = "") -> tuple[int, tuple]:
        """Prompt tokens of ``ids`` cached now and their blocks: a hint for ``auto`` and for
        ``reserve``, which checks it (nothing is held)."""
        with self._lock:
            blocks, _, _ = self._match(ids, salt, want_slots=False)
        return len(blocks) * self.block, blocks

    def _match(
        self, ids: Sequence[int], salt: str, hint: tuple = (), want_slots: bool = True
    ) -> tuple[tuple, torch.Tensor | None, _Chain]:
        """The cached blocks of ``ids`` and their slots (None unless ``want_slots``: a peek, on
        every call's way in, needs none; the batch's reservation makes them), leaving at least its
        last token to compute (its row carries the prompt's queries into every scheme's requests),
        and its chain of block digests. ``hint``: the blocks an earlier match found. A prompt
        matched lately (the next page of a query, the same user's context) is remembered whole:
        its ids are hashed once, not per block."""
        ids = as_ids(ids)
        key = prompt_key(ids, salt)
        chain, known, slots = self._recent.get(key) or (_Chain(ids, salt, self.block), (), None)
        if hint and len(hint) > len(known):
            known, slots = hint, None
        if known and not known[-1].live:  # the deepest live: every one live
            known, slots = (), None
        out = list(known)
        digests = chain.digests
        while len(out) < chain.n:
            if len(out) >= len(digests):  # (a hint's blocks may be past a new chain's digests)
                chain.grow(2 * len(out) + 1)  # doubling: a prompt not cached hashes its first block
            blk = self._index.get(digests[len(out)])
            if blk is None:
                break
            out.append(blk)
        if len(out) > len(known):
            slots = None
        if slots is None and want_slots:
            slots = self.slots([blk.page for blk in out])
        blocks = tuple(out)
        self._recent[key] = (chain, blocks, slots)
        self._recent.move_to_end(key)
        if len(self._recent) > RECENT:
            self._recent.popitem(last=False)
        return blocks, slots, chain

    def reserve(
        self, prompts: Sequence[tuple[Sequence[int], str, tuple] | None]
    ) -> tuple[list[PrefixHit], Lease]:
        """The hits of a batch's prompts ((ids, salt, hint from ``peek``), or None for a call off
        the cache), in order, under one lease: each prompt's deepest cached block is held and its
        next whole blocks are indexed with fresh slots (as many as the pool can free), so a later
        prompt of the batch reads them."""
        lease = Lease(self)
        hits = []
        hit_tokens = lookup_tokens = 0
        with self._lock:
            for prompt in prompts:
                if prompt is None:
                    hits.append(no_hit())
                    continue
                ids, salt, hint = prompt
                blocks, slots, chain = self._match(ids, salt, hint)
                hit = len(blocks) * self.block
                hit_tokens += hit
                lookup_tokens += len(ids)
                if blocks:
                    deepest = blocks[-1]
                    if deepest.trial is not None:
                        self._read_on_trial(blocks)
                    deepest.refs += 1
                    lease.held.append(deepest)
                    if deepest.id in self._leaves:
                        self._leaves.move_to_end(deepest.id)
                new = self._insert(chain.grow(chain.n), blocks[-1] if blocks else None, len(blocks), lease)
                hits.append(PrefixHit(slots, self.slots([blk.page for blk in new])))
            self.stats["hit_tokens"] += hit_tokens
            self.stats["lookup_tokens"] += lookup_tokens
            metrics.PREFIX_CACHE_HIT_TOKENS.inc(hit_tokens)
            metrics.PREFIX_CACHE_LOOKUP_TOKENS.inc(lookup_tokens)
            self._report()
        return hits, lease

    def declined(self, tokens: int) -> None:
        """A batch computes ``tokens`` of its hits' cached prompt tokens rather than read them."""
        with self._lock:
            self.stats["declined_tokens"] += tokens
        metrics.PREFIX_CACHE_DECLINED_TOKENS.inc(tokens)

    def _insert(self, digests: list[bytes], parent: _Block | None, start: int, lease: Lease) -> list[_Block]:
        """Index the prompt's blocks from ``start`` on (``digests``: all of its blocks that
        ``_match`` can read), those admitted, with as many fresh pages as the pool can free."""
        new = []
        wanted = range(start, len(digests))
        seen = 0  # blocks from ``start + seen`` on: on their first sighting
        if self.admit != 1:
            first = self.first_sight
            seen = self._seen_before(digests, start, remember=not first)
            if not first:
                wanted = wanted[:seen]
        pages = self._alloc(len(wanted), partial=True)
        for i, page in zip(wanted, pages, strict=False):
            self._ids += 1
            self.arrived += 1
            trial = self.arrived if i >= start + seen else None
            blk = _Block(digests[i], self._ids, parent, page, refs=1, trial=trial)
            if parent is not None:
                parent.children += 1
                self._leaves.pop(parent.id, None)
            self._index[blk.key] = blk
            self._leaves[blk.id] = blk
            new.append(blk)
            parent = blk
        lease.written += new
        return new

    @property
    def first_sight(self) -> bool:
        """Whether blocks are written on their first sighting: ``admit`` 1, or ``auto`` while at
        least ``MIN_REUSE`` of the blocks weighed came back (or none were weighed yet: an empty pool
        evicts nothing to write)."""
        if self.admit != "auto":
            return self.admit == 1
        return self.came_back >= MIN_REUSE * (self.came_back + self.lost)

    def _outcome(self, came_back: int = 0, lost: int = 0) -> None:
        self.came_back += came_back
        self.lost += lost
        if self.came_back + self.lost > self.seen_limit:
            self.came_back /= 2
            self.lost /= 2

    @property
    def reuse(self) -> float:
        """The share of the blocks weighed lately that came back (1.0 before any)."""
        total = self.came_back + self.lost
        return self.came_back / total if total else 1.0

    def _read_on_trial(self, blocks: tuple[_Block, ...]) -> None:
        """``blocks`` (a prompt's cached chain) are read: those on trial came back if fewer blocks
        arrived since they were written (were written or remembered as seen) than the pool holds,
        as a block remembered as seen must come back before it is forgotten. (A block that lived
        longer did so because little was written after it, and tells nothing of whether writing
        pays.) Ancestors of a block read or kept on its second sighting were read, so the blocks on
        trial are a chain's tail."""
        reach, came_back, lost = self.capacity // self.block, 0, 0
        for blk in reversed(blocks):
            if blk.trial is None:
                break
            if self.arrived - blk.trial <= reach:
                came_back += 1
            else:
                lost += 1
            blk.trial = None
        self._outcome(came_back, lost)

    def _seen_before(self, digests: list[bytes], start: int, remember: bool = True) -> int:
        """How many of the blocks of ``digests`` from block ``start`` on were seen before, in a
        row (they came back: those are admitted); ``remember``: the rest are remembered as seen
        now. A block's digest covers its whole chain (the salt and every token up to its end), as
        its index key does."""
        admitted = None
        for i in range(start, len(digests)):
            digest = digests[i]
            if admitted is None and digest in self._seen:
                del self._seen[digest]  # cached now: the index remembers it
                continue
            if admitted is None:
                admitted = i - start
                if not remember:
                    break
            if digest in self._seen:
                self._seen.move_to_end(digest)
            else:
                self._seen[digest] = None
                self.arrived += 1
        forgotten = max(0, len(self._seen) - self.seen_limit)
        for _ in range(forgotten):
            self._seen.popitem(last=False)
        admitted = len(digests) - start if admitted is None else admitted
        if admitted or forgotten:
            self._outcome(came_back=admitted, lost=forgotten)
        return admitted

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
            self._free += lease.scratch
            self._report()

    def clear(self) -> None:
        """Evict every block no batch holds, forget the prompts seen (a prompt is new again), and
        zero ``stats``."""
        with self._lock:
            self.stats = dict.fromkeys(self.stats, 0)
            self._seen.clear()
            self.came_back = self.lost = 0.0
            for blk in sorted(self._index.values(), key=lambda b: -b.id):  # children before parents
                if blk.refs == 0 and blk.children == 0:
                    self._evict(blk, count=False)
            self._report()

    # -- slots -----------------------------------------------------------------------------------

    def slots(self, pages: Sequence[int]) -> torch.Tensor:
        """The slots of ``pages``, in order (int64; no pages: one shared empty tensor, never
        written to)."""
        if not pages:
            return no_hit().cached
        # numpy: three torch ops on a few dozen ints cost ~10x the arithmetic
        slots = np.asarray(pages, dtype=np.int64)[:, None] * self.block + self._in_page
        return torch.from_numpy(slots.ravel())

    def alloc(self, n: int) -> list[int] | None:
        """``n`` free pages (evicting what it must), or None when the pool cannot free them."""
        with self._lock:
            return self._alloc(n)

    def _alloc(self, n: int, partial: bool = False) -> list[int] | None:
        """``n`` pages, or None; ``partial``: as many as can be freed, up to ``n``."""
        while len(self._free) < n:
            victim = next((b for b in self._leaves.values() if b.refs == 0), None)
            if victim is None:
                if not partial:
                    return None
                n = len(self._free)
                break
            self._evict(victim, count=True)
        out = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return out

    def _evict(self, blk: _Block, count: bool) -> None:
        blk.live = False
        del self._index[blk.key]
        del self._leaves[blk.id]
        if blk.parent is not None:
            blk.parent.children -= 1
            if blk.parent.children == 0:  # a leaf now: next in line after this one
                self._leaves[blk.parent.id] = blk.parent
                self._leaves.move_to_end(blk.parent.id, last=False)
        self._free.append(blk.page)
        if count:
            self.stats["evictions"] += 1
            metrics.PREFIX_CACHE_EVICTIONS.inc()
            if blk.trial is not None:  # written on its first sighting, never read
                self._outcome(lost=1)

    def _report(self) -> None:
        metrics.PREFIX_CACHE_BYTES.labels(kind="used").set(len(self._index) * self.block * self.slot_bytes)
        metrics.PREFIX_CACHE_REUSE.set(self.reuse)

    @property
    def cached_blocks(self) -> int:
        return len(self._index)

    @property
    def free_slots(self) -> int:
        return len(self._free) * self.block
