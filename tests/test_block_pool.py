"""Block pool and KV cache manager: ref counts, the null block, prefix hits, LRU eviction."""

from __future__ import annotations

import pytest

from runtime.engine.block_pool import BlockPool
from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.request import Request
from runtime.engine.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), eos_token_ids=(0,), block_size=BS, max_model_len=64, sample_seed=0)


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_ref_counts_and_free():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.touch(a)  # shared by a second sequence
    pool.free_blocks(a)
    assert pool.num_free_blocks == 1 and all(b.ref_cnt == 1 for b in a)
    pool.free_blocks(a)
    assert pool.num_free_blocks == 3
    with pytest.raises(RuntimeError):
        pool.free_blocks(a[:1])


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    pool = BlockPool(4)
    b1, b2, b3 = pool.get_new_blocks(3)
    for b, h in ((b1, 11), (b2, 22), (b3, 33)):
        pool.cache_block(b, h)
    pool.free_blocks([b2])  # freed first -> evicted first
    pool.free_blocks([b3, b1])
    assert pool.get_cached_block(22) is b2 and pool.num_cached_blocks == 3
    (new,) = pool.get_new_blocks(1)
    assert new is b2 and pool.get_cached_block(22) is None and new.block_hash is None
    assert pool.get_cached_block(33) is b3 and pool.get_cached_block(11) is b1


def test_prefix_hit_reuses_blocks_and_leaves_a_token_to_compute():
    kv = KVCacheManager(16, BS)
    a = req("a", list(range(1, 11)))  # 2 full blocks + 2 tokens
    assert kv.allocate_slots(a, a.num_tokens)
    b = req("b", list(range(1, 9)) + [99, 98, 97])  # shares the 2 full blocks
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [x.block_id for x in hits[0]] == kv.block_ids("a")[:2]
    assert kv.allocate_slots(b, b.num_tokens - n, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert all(x.ref_cnt == 2 for x in hits[0])
    # A prompt that is exactly cached still computes its last token.
    c = req("c", list(range(1, 9)))
    _, n = kv.get_computed_blocks(c)
    assert n == 4
    free0 = 15
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == free0
    # Freed but still cached: a later request hits.
    hits, n = kv.get_computed_blocks(req("d", list(range(1, 10))))
    assert n == 8


def test_allocation_fails_cleanly_when_blocks_run_out():
    kv = KVCacheManager(4, BS)  # 3 usable blocks
    a = req("a", list(range(1, 10)))  # needs 3 blocks
    assert kv.allocate_slots(a, 9)
    b = req("b", [5, 6])
    assert not kv.allocate_slots(b, 2)
    assert kv.block_ids("b") == []
    kv.free(a)
    assert kv.allocate_slots(b, 2)


def test_prefix_caching_off_means_no_hits():
    kv = KVCacheManager(16, BS, enable_caching=False)
    a = req("a", list(range(1, 11)))
    kv.allocate_slots(a, a.num_tokens)
    kv.free(a)
    assert kv.get_computed_blocks(req("b", list(range(1, 11)))) == ([[]], 0)


def test_block_hashes_chain_on_the_previous_block():
    x = req("x", [1, 2, 3, 4, 5, 6, 7, 8])
    y = req("y", [9, 9, 9, 9, 5, 6, 7, 8])
    assert x.block_hashes[1] != y.block_hashes[1]  # same tokens, different prefix
    x.append_output_token(3)
    assert len(x.block_hashes) == 2
    for t in (3, 3, 3):
        x.append_output_token(t)
    assert len(x.block_hashes) == 3
