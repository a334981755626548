"""The KV cache manager: which blocks each request holds, and prefix-cache lookups.

The scheduler decides who runs; this class answers "can this request get slots for n
more tokens?" and keeps the per-request block lists; the block pool owns the blocks.
"""

from __future__ import annotations

import dataclasses

from runtime.engine.block_pool import BlockPool, KVCacheBlock
from runtime.engine.request import Request


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Per-request block lists on top of a BlockPool.

    Args:
        num_blocks: blocks in the cache (the null block included).
        block_size: tokens per block.
        enable_caching: reuse full blocks across requests by their hash.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
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

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's tokens: (blocks, number of tokens).

        At least one token is always left to compute, so the step yields logits. Requests
        that want prompt logprobs get no hits (every prompt position must be computed).
        The lookup counts in `prefix_cache_stats` once `allocate_slots` admits the request with them.
        """
        if not self.enable_caching or request.needs_prompt_logprobs:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens; False if there are too few.

        `new_computed_blocks` are prefix-cache hits found by get_computed_blocks for a
        request that is being admitted (for the first time, or again after preemption);
        passing them, even empty, records the lookup in `prefix_cache_stats` when the allocation succeeds.
        """
        admitting = new_computed_blocks is not None
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = total_needed - len(blocks) - len(new_computed_blocks)
        # Hits sitting in the free queue stop being free once we reference them.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            return False
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, (num_computed + num_new_tokens) // self.block_size)
        if admitting:
            self._prefix_queries += request.num_tokens
            self._prefix_hits += len(new_computed_blocks) * self.block_size
        return True

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_full: int) -> None:
        start = self._num_cached_blocks.get(request.request_id, 0)
        num_full = min(num_full, len(request.block_hashes))
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        """Return all of the request's blocks (tail first, so they are evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]
