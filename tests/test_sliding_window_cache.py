"""Sliding-window layers keep only their window's blocks (KV cache groups, #41).

Gemma 2/3 interleave sliding-window and global layers; the global layers form one KV cache
group, the sliding ones others, each with its own block table (runtime.ops.step.KVCacheGroups).
The KV cache manager frees a sliding group's blocks once they fall out of its window, and a
prefix-cache hit needs only the window before the hit point there. Checked here: the grouping,
the manager's freeing and window-aware prefix lookup, and on the tiny Gemma checkpoints (8-token
windows) conversations of several hundred tokens through the engine: transformers' greedy
tokens and logprobs with chunked prefill, a second turn hitting the first one's prefix,
preemption, and the blocks a long sequence holds (its global context plus the windows) with
none left behind.
"""

from __future__ import annotations

import random

import pytest

from conftest import (
    assert_greedy_and_logprobs_match_hf, assert_prompt_logprobs_match_hf, greedy, hf_greedy, hf_model,
    output_tokens as tokens, quick_loop_keeps, tiny_llm,
)
from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.request import Request
from runtime.engine.sampling_params import SamplingParams
from runtime.ops.step import KVCacheGroups

WINDOW = 8  # the tiny Gemma configs' sliding window (registry/tiny.py)
BS = 8
# Long enough for the window to slide over hundreds of tokens; prefilled in 32-token chunks.
LONG = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=256, block_size=BS,
            show_progress=False)
LONG_PROMPTS = [[random.Random(1000 + n).randrange(4, 500) for _ in range(n)] for n in (300, 365, 420)]
NEW = 24
GEMMA = ["gemma2", "gemma3"]
SLIDING_GROUPS = {"gemma2": 2, "gemma3": 3}  # tiny configs: one global layer, these sliding ones


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- the grouping and the KV cache manager, without a model ---------------------------------

def test_kv_cache_groups_split_layers_by_window():
    # Gemma 3 1B: 26 layers, every sixth global -> 4 global layers, 22 sliding in 6 groups of 4 rows.
    gemma3_1b = tuple(None if i % 6 == 5 else 512 for i in range(26))
    groups = KVCacheGroups.of(gemma3_1b)
    assert groups.num_rows == 4 and groups.windows == (None,) + (512,) * 6
    assert [groups.layer_group[i] for i in (5, 11, 17, 23)] == [0] * 4
    assert [groups.layer_row[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    pairs = {(groups.layer_group[i], groups.layer_row[i]) for i in range(26)}
    assert len(pairs) == 26  # each layer its own (group, row)
    # A long sequence holds the global context plus a window per sliding group.
    assert groups.blocks_per_seq(8192, 16, 512) == 512 + 6 * (cdiv(511 + 512, 16) + 1)
    # One window (or none) for every layer: one group, a row per layer, as before.
    for windows in ((None,) * 4, (4096,) * 4):
        one = KVCacheGroups.of(windows)
        assert one.num_groups == 1 and one.num_rows == 4 and one.layer_row == (0, 1, 2, 3)
    alternating = KVCacheGroups.of((WINDOW, None) * 3)  # Gemma 2, gpt-oss
    assert alternating.windows == (None, WINDOW) and alternating.num_rows == 3


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), eos_token_ids=(0,), block_size=4, max_model_len=256,
                   sample_seed=0)


def run_in_chunks(kv: KVCacheManager, request: Request, chunk: int) -> list[int]:
    """Allocate a request's prompt chunk by chunk as the scheduler would; the blocks it holds
    after each allocation."""
    held = []
    while request.num_computed_tokens < request.num_tokens:
        n = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate_slots(request, n)
        held.append(kv.num_held_blocks(request.request_id))
        request.num_computed_tokens += n
    return held


def test_sliding_group_frees_blocks_behind_its_window():
    kv = KVCacheManager(64, 4, group_windows=(None, WINDOW, WINDOW))
    a = req("a", list(range(1, 41)))  # 10 blocks of 4
    held = run_in_chunks(kv, a, 8)
    # The global group keeps everything; each sliding group the window before a chunk plus the chunk.
    full = kv.block_ids("a", 0)
    assert len(full) == 10 and 0 not in full
    for g in (1, 2):
        table = kv.block_ids("a", g)
        assert len(table) == 10 and table[:6] == [0] * 6 and 0 not in table[6:]
    assert held[-1] == 10 + 2 * 4 and max(held) < 3 * 10
    assert kv.num_free_blocks == 63 - held[-1]
    kv.free(a)
    assert kv.num_free_blocks == 63 and not kv.req_to_blocks


def test_sliding_prefix_hit_needs_only_the_window_before_it():
    kv = KVCacheManager(21, 4, group_windows=(None, WINDOW))  # 20 usable: every block is used once below
    prompt = list(range(1, 41))
    a = req("a", prompt)
    run_in_chunks(kv, a, 8)  # frees sliding blocks 0-5 on the way
    kv.free(a)
    # The whole prompt again: a hit of 10 blocks; the sliding group brings the two blocks of its window.
    hits, n = kv.get_computed_blocks(req("b", prompt + [99]))
    assert n == 40 and len(hits[0]) == len(hits[1]) == 10
    assert [b.block_id for b in hits[1][:8]] == [0] * 8 and 0 not in [b.block_id for b in hits[1][8:]]
    # A prompt sharing the first 24 tokens: its hit needs sliding blocks 4 and 5, freed first.
    partial = prompt[:24] + [99] * 8
    assert kv.get_computed_blocks(req("c", partial))[1] == 24
    kv.pool.free_blocks(kv.pool.get_new_blocks(6))  # evicts the six sliding blocks freed first (LRU)
    assert kv.get_computed_blocks(req("c", partial))[1] == 0  # the global group alone cannot serve it
    assert kv.get_computed_blocks(req("b", prompt + [99]))[1] == 40  # its window is still cached


def test_admitted_prefix_hit_frees_nothing_twice():
    """A request admitted on a sliding hit (null blocks before its window) and then run to the
    end returns every block it took exactly once."""
    kv = KVCacheManager(64, 4, group_windows=(None, WINDOW))
    prompt = list(range(1, 41))
    a = req("a", prompt)
    run_in_chunks(kv, a, 8)
    kv.free(a)
    b = req("b", prompt + list(range(50, 70)))
    hits, n = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 8, hits)
    b.num_computed_tokens = n + 8
    run_in_chunks(kv, b, 8)
    kv.free(b)
    assert kv.num_free_blocks == 63
    assert all(block.ref_cnt == 0 for block in kv.pool.blocks[1:])


# ---- tiny Gemma models through the engine --------------------------------------------------

@pytest.fixture(scope="module", params=quick_loop_keeps(GEMMA, "gemma3"))
def long_gemma(request, tiny_checkpoint):
    with tiny_llm(request.param, **LONG) as llm:
        yield request.param, llm, hf_model(tiny_checkpoint(request.param))


def assert_no_blocks_held(llm) -> None:
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    assert not llm.engine.kv.req_to_blocks


def test_long_conversation_matches_transformers(long_gemma):
    """Prompts of 300-420 tokens against an 8-token window, prefilled in 32-token chunks: the
    greedy tokens and their logprobs are transformers'; a second turn (prompt, answer, a new
    message) hits the first turn's prefix and still continues as transformers does."""
    name, llm, hf = long_gemma
    assert llm.engine.kv_spec.groups.num_groups == 1 + SLIDING_GROUPS[name]
    outs = llm.generate(LONG_PROMPTS, greedy(NEW, logprobs=0))
    assert_greedy_and_logprobs_match_hf(hf, LONG_PROMPTS, outs, NEW)
    assert_no_blocks_held(llm)
    second = LONG_PROMPTS[2] + outs[2].outputs[0].token_ids + [7, 8, 9, 10, 11] * 7
    again = llm.generate([second], greedy(NEW))[0]
    assert again.num_cached_tokens >= len(LONG_PROMPTS[2]) - BS
    assert again.outputs[0].token_ids == hf_greedy(hf, second, NEW)
    assert llm.engine.stats().compilations_since_warmup == 0
    assert_no_blocks_held(llm)


@pytest.mark.slow
def test_long_prompt_logprobs_match_transformers(long_gemma):
    name, llm, hf = long_gemma
    assert_prompt_logprobs_match_hf(llm, hf, LONG_PROMPTS[0])
    assert_no_blocks_held(llm)


@pytest.mark.slow
@pytest.mark.parametrize("name", GEMMA)
def test_long_conversations_survive_preemption(name, tiny_checkpoint):
    """A cache with room for one long sequence at a time (its global context and windows):
    requests are preempted, recomputed with prefix hits, and still give transformers' tokens."""
    hf = hf_model(tiny_checkpoint(name))
    want = [hf_greedy(hf, p, NEW) for p in LONG_PROMPTS]
    with tiny_llm(name, **{**LONG, "num_kv_blocks": 100}) as llm:
        assert tokens(llm.generate(LONG_PROMPTS, greedy(NEW))) == want
        assert llm.engine.stats().num_preemptions > 0 and llm.engine.kv.prefix_cache_stats.hits > 0
        assert_no_blocks_held(llm)


@pytest.mark.slow
@pytest.mark.parametrize("name", GEMMA)
def test_long_conversation_on_xla_attention_in_one_scanned_step(name, tiny_checkpoint):
    """The other reading of the group tables: the XLA attention path, all layers under one scan
    (each layer's row and group traced)."""
    hf = hf_model(tiny_checkpoint(name))
    with tiny_llm(name, **LONG, attention_backend="xla", layered=False) as llm:
        assert_greedy_and_logprobs_match_hf(hf, LONG_PROMPTS, llm.generate(LONG_PROMPTS, greedy(NEW, logprobs=0)), NEW)
        assert_no_blocks_held(llm)


@pytest.mark.slow
def test_speculative_drafts_on_sliding_groups_keep_the_tokens(tiny_checkpoint):
    """n-gram drafts verified a row per token over the group tables, on prompts that quote
    themselves: transformers' greedy tokens."""
    rng = random.Random(7)
    prompts = [([rng.randrange(4, 500) for _ in range(6)] * 60)[:n] for n in (310, 333)]
    hf = hf_model(tiny_checkpoint("gemma3"))
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
             "adaptive_drafts": False}
    with tiny_llm("gemma3", **LONG, speculative_config=ngram) as llm:
        assert tokens(llm.generate(prompts, greedy(NEW))) == [hf_greedy(hf, p, NEW) for p in prompts]
        assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
        assert_no_blocks_held(llm)


def test_long_gemma3_sequence_holds_its_global_context_plus_windows(long_gemma):
    """Measured at every step of a 420-token prompt and its decode: the request holds its global
    layers' blocks for the whole context plus, per sliding group, the window before the step and
    the step's tokens, far below the figure with every layer keeping everything; an aborted
    request and a finished one leave no block behind."""
    name, llm, _ = long_gemma
    engine, sliding = llm.engine, SLIDING_GROUPS[name]
    engine.add_request("long", LONG_PROMPTS[2], greedy(64))
    engine.add_request("aborted", LONG_PROMPTS[0], greedy(64))
    held, full = [], []
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step == 30:
            engine.abort_request("aborted")
        if "long" in engine.kv.req_to_blocks:
            held.append(engine.kv.num_held_blocks("long"))
            full.append(len(engine.kv.block_ids("long", 0)))  # the global group: every block of the context
    per_window = cdiv(WINDOW - 1 + LONG["max_num_batched_tokens"], BS) + 1
    assert all(f <= h <= f + sliding * per_window for h, f in zip(held, full))
    # While decoding (one token a step) each sliding group holds at most the two blocks the window spans.
    assert held[-1] <= full[-1] + sliding * 2 and full[-1] == cdiv(len(LONG_PROMPTS[2]) + 64, BS)
    every_layer = (1 + sliding) * full[-1]  # what it would hold if every layer kept every block
    assert held[-1] / every_layer < 1 / (1 + sliding) + 0.05
    assert_no_blocks_held(llm)
