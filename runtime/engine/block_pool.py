"""The block pool: owns the KV-cache blocks, their reference counts and the prefix cache.

Blocks live in a free queue in LRU order while nobody references them. A full block may
keep its hash after being freed, so that a later request with the same prefix can take it
back (a prefix-cache hit); it only loses its hash when it is reused for something else
(eviction, oldest freed first). Block 0 is the null block: never handed out, it pads
block-table rows and stands in for the blocks a sliding-window group has freed; taking or
dropping a reference to it does nothing.

The pool also logs which keys it caches and evicts (`events_since`), so that something outside
the engine (a KV-aware router, a prefill/decode pair) can mirror the set of cached keys by
reading only what changed.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict, deque
from typing import Hashable


@dataclasses.dataclass(frozen=True)
class BlockHashEvents:
    """What changed in the prefix cache since a cursor (BlockPool.events_since).

    Attributes:
        cursor: pass it as `since` next time.
        stored: keys cached now that were not at the cursor (or were evicted and cached again).
        removed: keys evicted since then and not cached again (disjoint from `stored`: a mirror
            applies both in any order).
        reset: the cursor was older than the log keeps (or the cache was reset): `stored` is
            every key cached now, `removed` is empty, and a mirror drops what it had first.
    """

    cursor: int
    stored: list[Hashable]
    removed: list[Hashable]
    reset: bool = False


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Hashable | None = None  # its prefix-cache key while it has one

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """Fixed-size blocks with a free list, ref counts and a key -> block prefix cache (the KV
    cache manager's keys: a block hash and the KV cache group it is cached for).

    Args:
        num_blocks: blocks in the KV cache, the null block included.
        enable_caching: keep hashes of full blocks for prefix reuse.
        max_events: cache/evict events kept for `events_since` (a reader further behind gets
            a snapshot instead).
    """

    NULL_BLOCK_ID = 0

    def __init__(self, num_blocks: int, enable_caching: bool = True, max_events: int | None = None):
        if num_blocks < 2:
            raise ValueError(f"the block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[self.NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # never freed, never handed out
        # block_id -> block, least recently freed first.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[Hashable, KVCacheBlock] = {}
        # (stored?, key) in order; event number i is _events[i - _events_start]. The lock is
        # the reader's guard: the engine thread writes, a server's event loop reads.
        self._events: deque[tuple[bool, Hashable]] = deque(maxlen=max_events or 4 * num_blocks)
        self._events_start = 0
        self._events_end = 0
        self._events_lock = threading.Lock()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unreferenced blocks included)."""
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: Hashable) -> KVCacheBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on (possibly free) cached blocks a request reuses."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, num: int) -> list[KVCacheBlock]:
        """Hand out `num` blocks from the head of the free queue, evicting their cached hashes.

        Raises:
            ValueError: fewer than `num` blocks are free (callers check first).
        """
        if num > len(self._free):
            raise ValueError(f"cannot allocate {num} blocks, only {len(self._free)} free")
        out = []
        for _ in range(num):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) is block:
                    with self._events_lock:
                        del self._cached[block.block_hash]
                        self._log(False, block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; unreferenced ones join the tail of the free queue.

        Pass a sequence's blocks tail-first so that its last blocks are evicted first.
        """
        for block in blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than allocated")
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    block.block_hash = None
                self._free[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: Hashable) -> None:
        """Register a full block under its hash (first writer wins for duplicates)."""
        if not self.enable_caching or block.block_hash is not None or block is self.null_block:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        with self._events_lock:
            self._cached[block_hash] = block
            self._log(True, block_hash)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        for block in self._cached.values():
            block.block_hash = None
        with self._events_lock:
            self._cached.clear()
            self._events.clear()
            self._events_start = self._events_end  # every reader gets a (now empty) snapshot

    def _log(self, stored: bool, key: Hashable) -> None:
        """Record an event (the caller holds _events_lock, with the change to _cached)."""
        if len(self._events) == self._events.maxlen:
            self._events_start += 1  # the append drops the oldest
        self._events.append((stored, key))
        self._events_end += 1

    def events_since(self, since: int = -1) -> BlockHashEvents:
        """The keys cached and evicted since cursor `since` (a cursor an earlier call returned;
        -1, or any cursor the log no longer reaches: a snapshot of every cached key). Any thread."""
        with self._events_lock:
            if since < self._events_start or since > self._events_end:
                return BlockHashEvents(self._events_end, list(self._cached), [], reset=True)
            last: dict[Hashable, bool] = {}  # each key's last event: its state now
            for i in range(since - self._events_start, len(self._events)):
                is_stored, key = self._events[i]
                last[key] = is_stored
            return BlockHashEvents(self._events_end, [k for k, s in last.items() if s],
                                   [k for k, s in last.items() if not s])
