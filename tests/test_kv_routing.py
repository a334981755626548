"""KV-cache-aware routing (#44): the engine's block-hash event feed, and on a real cluster the
KVAwareRouter (app.kv_routing) sending each request to the replica whose prefix cache holds
its prompt, traded against load, with LoRA adapters keyed apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.lora_request import LoRARequest
from runtime.engine.request import Request, prefix_block_hashes
from runtime.engine.sampling_params import SamplingParams

BS = 4


def _request(rid: str, tokens: list[int], lora: LoRARequest | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, ignore_eos=True), eos_token_ids=(0,), block_size=BS,
                   max_model_len=128, sample_seed=0, lora_request=lora)


def test_block_hash_events_mirror_the_prefix_cache_and_hashes_agree_across_processes():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable blocks
    cursor = kv.block_hash_events().cursor
    first = _request("a", list(range(1, 10)))  # 9 tokens: 2 full blocks
    assert kv.allocate_slots(first, 9, []) and first.block_hashes == prefix_block_hashes(list(range(1, 10)), BS)
    events = kv.block_hash_events(cursor)
    assert events.stored == first.block_hashes and events.removed == [] and not events.reset
    kv.free(first)  # cached blocks stay cached while free
    assert kv.block_hash_events(events.cursor).stored == []
    second = _request("b", list(range(50, 66)))  # 16 tokens: all 4 blocks, evicting the first request's
    assert kv.allocate_slots(second, 16, [])
    later = kv.block_hash_events(events.cursor)
    assert set(later.removed) == set(first.block_hashes) and later.stored == second.block_hashes
    snapshot = kv.block_hash_events(-1)
    assert snapshot.reset and set(snapshot.stored) == set(second.block_hashes)
    # An adapter's blocks chain from the adapter: other keys for the same tokens.
    lora = LoRARequest("adapter", 7, "/nowhere")
    assert _request("c", list(range(1, 10)), lora).block_hashes == prefix_block_hashes(list(range(1, 10)), BS, 7)
    assert prefix_block_hashes(list(range(1, 10)), BS, 7) != first.block_hashes
    # The keys are the same in another process (a router hashes prompts where the engine is not).
    code = "from runtime.engine.request import prefix_block_hashes as p; print(p(list(range(1, 10)), 4, 7))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "random"}, cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == str(prefix_block_hashes(list(range(1, 10)), BS, 7))
