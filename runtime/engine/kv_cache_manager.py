"""The KV cache manager: which blocks each request holds, and prefix-cache lookups.

The scheduler decides who runs; this class answers "can this request get slots for n
more tokens?" and keeps the per-request block lists; the block pool owns the blocks.

A request holds one block list per KV cache group (runtime.ops.step.KVCacheGroups; one group
unless the model's layers have different sliding windows), all from the one pool. A list
covers every token computed so far, except that a sliding-window group's blocks that fell out
of its window (no later token attends to them) are freed and replaced by the null block, so
such a group holds only about a window's worth (vLLM v1's SlidingWindowManager). A prefix-cache
hit must hold for every group: a full-attention group needs every block before the hit point,
a sliding group only those of the window before it, so a hit whose window was evicted is
shorter (vLLM v1's HybridKVCacheCoordinator).
"""

from __future__ import annotations

import dataclasses

from runtime.engine.block_pool import BlockHashEvents, BlockPool, KVCacheBlock
from runtime.engine.request import Request


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Per-request block lists, one per KV cache group, on top of one BlockPool.

    Args:
        num_blocks: blocks in the cache (the null block included).
        block_size: tokens per block.
        enable_caching: reuse full blocks across requests by their hash.
        group_windows: each KV cache group's sliding window, None for full attention
            (runtime.ops.step.KVCacheGroups.windows); one full-attention group by default.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 group_windows: tuple[int | None, ...] = (None,)):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.group_windows = tuple(group_windows)
        # Per group, the blocks before a prefix-cache hit point it must have: those of the
        # window's W - 1 tokens before it (None: all of them, full attention).
        self._hit_blocks_needed = [None if w is None else -(-(w - 1) // block_size) for w in self.group_windows]
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}  # request id -> per group, its blocks
        self._num_cached_blocks: dict[str, int] = {}
        self._prefix_queries = 0  # prompt tokens looked up at admission
        self._prefix_hits = 0  # of which found cached

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.pool.num_usable_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens looked up in the prefix cache at admission, and how many were found."""
        return PrefixCacheStats(self._prefix_queries, self._prefix_hits)

    @property
    def usage(self) -> float:
        """Share of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def block_hash_events(self, since: int = -1) -> BlockHashEvents:
        """The block hashes (Request.block_hashes' values) cached and evicted since cursor
        `since` in the first KV cache group (the only one unless layers have different sliding
        windows), as BlockPool.events_since. Any thread."""
        events = self.pool.events_since(since)
        return BlockHashEvents(events.cursor, [h for g, h in events.stored if g == 0],
                               [h for g, h in events.removed if g == 0], events.reset)

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """The longest cached prefix of the request's tokens: (per group, its blocks, null
        blocks where a sliding group needs none; number of tokens).

        At least one token is always left to compute, so the step yields logits. Requests
        that want prompt logprobs get no hits (every prompt position must be computed), nor
        pooling requests whose pooling reads every token (MEAN, CLS).
        The lookup counts in `prefix_cache_stats` once `allocate_slots` admits the request with them.
        """
        groups = range(len(self.group_windows))
        if not self.enable_caching or request.needs_prompt_logprobs or request.skip_reading_prefix_cache:
            return [[] for _ in groups], 0
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        n = len(hashes)
        settled = False
        while not settled:  # a group's shorter hit may leave another without its window: again until none shortens
            before = n
            for g in groups:
                n = self._hit_length(g, hashes, n)
            settled = n == before or len(groups) == 1
        return [self._hit_blocks(g, hashes, n) for g in groups], n * self.block_size

    def _cached(self, group: int, block_hash: int) -> KVCacheBlock | None:
        return self.pool.get_cached_block((group, block_hash))

    def _hit_length(self, group: int, hashes: list[int], n: int) -> int:
        """The longest hit of at most `n` blocks group `group` can serve: every block before it
        cached (full attention), or the blocks of the window before it (vLLM's search from the
        right; a run from the first block counts however short)."""
        needed = self._hit_blocks_needed[group]
        if needed is None:
            for i in range(n):
                if self._cached(group, hashes[i]) is None:
                    return i
            return n
        if needed == 0:
            return n
        run = 0  # cached blocks in a row, ending at block i + run - 1
        for i in range(n - 1, -1, -1):
            if self._cached(group, hashes[i]) is None:
                run = 0
                continue
            run += 1
            if run >= needed:
                return i + run
        return run

    def _hit_blocks(self, group: int, hashes: list[int], n: int) -> list[KVCacheBlock]:
        needed = self._hit_blocks_needed[group]
        skipped = 0 if needed is None else max(0, n - needed)
        return [self.pool.null_block] * skipped + [self._cached(group, h) for h in hashes[skipped:n]]

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[list[KVCacheBlock]] | None = None
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens; False if there are too few.

        First the blocks its sliding groups no longer need are freed (they are out of the window
        of every token from here on, whether or not this allocation succeeds).
        `new_computed_blocks` are prefix-cache hits found by get_computed_blocks for a
        request that is being admitted (for the first time, or again after preemption);
        passing them, even empty, records the lookup in `prefix_cache_stats` when the allocation succeeds.
        """
        admitting = new_computed_blocks is not None
        hits = new_computed_blocks or [[] for _ in self.group_windows]
        groups = self.req_to_blocks.setdefault(request.request_id, [[] for _ in self.group_windows])
        num_hit = len(hits[0])
        num_computed = request.num_computed_tokens + num_hit * self.block_size
        self._free_out_of_window(groups, num_computed)
        total_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = [max(0, total_needed - len(blocks) - num_hit) for blocks in groups]
        # Hits sitting in the free queue stop being free once we reference them.
        num_evictable_hits = sum(1 for hit in hits for b in hit if b.ref_cnt == 0)
        if sum(num_new_blocks) > self.pool.num_free_blocks - num_evictable_hits:
            return False
        for blocks, hit, num_new in zip(groups, hits, num_new_blocks):
            self.pool.touch(hit)
            blocks.extend(hit)
            if num_new > 0:
                blocks.extend(self.pool.get_new_blocks(num_new))
        if self.enable_caching:
            self._cache_full_blocks(request, groups, (num_computed + num_new_tokens) // self.block_size)
        if admitting:
            self._prefix_queries += request.num_tokens
            self._prefix_hits += num_hit * self.block_size
        return True

    def _free_out_of_window(self, groups: list[list[KVCacheBlock]], num_computed: int) -> None:
        """Free each sliding group's blocks before its window as seen from token `num_computed`
        (the first one to compute), leaving the null block in their place."""
        null = self.pool.null_block
        for window, blocks in zip(self.group_windows, groups):
            if window is None:
                continue
            first_kept = min(max(0, num_computed - window + 1) // self.block_size, len(blocks))
            freed = []
            for i in range(first_kept - 1, -1, -1):  # back to the first block freed before
                if blocks[i] is null:
                    break
                freed.append(blocks[i])
                blocks[i] = null
            self.pool.free_blocks(freed[::-1])  # oldest first: evicted first

    def _cache_full_blocks(self, request: Request, groups: list[list[KVCacheBlock]], num_full: int) -> None:
        start = self._num_cached_blocks.get(request.request_id, 0)
        num_full = min(num_full, len(request.block_hashes))
        for g, blocks in enumerate(groups):
            for i in range(start, num_full):
                self.pool.cache_block(blocks[i], (g, request.block_hashes[i]))  # the null block is never cached
        self._num_cached_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        """Return all of the request's blocks (tail first, so they are evicted first)."""
        groups = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        for blocks in groups:
            self.pool.free_blocks(list(reversed(blocks)))

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block table in KV cache group `group` (0: the only one, or the first)."""
        groups = self.req_to_blocks.get(request_id)
        return [b.block_id for b in groups[group]] if groups else []

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's block table in every KV cache group."""
        groups = self.req_to_blocks.get(request_id) or [[] for _ in self.group_windows]
        return [[b.block_id for b in blocks] for blocks in groups]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds over all groups (the null blocks of freed windows not counted)."""
        null = self.pool.null_block
        return sum(b is not null for blocks in self.req_to_blocks.get(request_id, []) for b in blocks)
