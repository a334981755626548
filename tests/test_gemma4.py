"""Native Gemma 4 (text) against transformers on tiny random checkpoints (#41).

`servax-tiny/gemma4`: global layers with a larger head (32 against 16) and one KV head whose
values are its keys, proportional rope on the global layers, per-layer input embeddings, the
last two layers reading earlier layers' K/V with a double-wide MLP, final logits soft-capped,
norm scales and layer scalars drawn away from 1. `servax-tiny/gemma4_moe`: the MoE block beside
every layer's MLP. Both have 8-token sliding windows.

Through the engine (the CPU attention kernel, layers stepped a few per call from their weight
stacks): greedy tokens identical to transformers' and their logprobs and prompt logprobs within
1e-4, with chunked prefill, prefix hits, preemption and conversations of hundreds of tokens
against the window; the blocks a long sequence holds measured against every layer keeping
every block; none left behind. The one-program step on the XLA attention path matches
transformers' logits at every decode step; bfloat16 agrees with transformers' bfloat16; tensor
parallel 2 and 4 on fake devices give one device's tokens.
"""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from conftest import (
    ENGINE_PROMPTS as PROMPTS, NEW_TOKENS, PagedRunner, assert_greedy_and_logprobs_match_hf,
    assert_prefix_hits_keep_their_tokens, assert_prompt_logprobs_match_hf, greedy, hf_greedy, hf_logits, hf_model,
    SMALL_ENGINE, output_tokens as tokens, tiny_llm,
)

GEMMA4 = ["gemma4", "gemma4_moe"]
WINDOW, BS = 8, 8
LONG = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=256, block_size=BS,
            show_progress=False)
LONG_PROMPTS = [[random.Random(2000 + n).randrange(4, 500) for _ in range(n)] for n in (300, 365, 420)]
NEW = 24


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_gemma4_configs_exercise_every_part(tiny_checkpoint):
    """The tiny configs have what models_jax/gemma4.py claims to serve, it is the native path, and
    the cache has one block shape: the global head size, the KV heads repeated to their lcm,
    rows only for the layers that own K/V."""
    import jax.numpy as jnp

    import registry
    from models_jax.gemma4 import kv_spec
    from models_jax.gemma4_config import Gemma4Args, layer_stacks

    dense = Gemma4Args.from_hf(registry.resolve(str(tiny_checkpoint("gemma4"))).hf_config)
    assert (dense.head_dim, dense.global_head_dim, dense.num_kv_heads, dense.global_kv_heads) == (16, 32, 2, 1)
    assert dense.values_from_keys and dense.per_layer_dim == 8 and dense.double_wide_mlp
    assert dense.num_kv_shared_layers == 2 and [dense.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    assert dense.final_logit_softcap == 10.0 and dense.moe is None
    inv_freq = np.asarray(dense.rope.inv_freq)  # proportional: 4 of 16 frequencies rotate
    assert dense.rope.rope_type == "proportional" and np.count_nonzero(inv_freq) == 4 and inv_freq[0] == 1.0
    assert layer_stacks(dense) == (("sliding", 2), ("global", 1), ("sliding", 1), ("shared_sliding", 1),
                                   ("shared_global", 1))
    moe = Gemma4Args.from_hf(registry.resolve(str(tiny_checkpoint("gemma4_moe"))).hf_config)
    assert moe.moe.num_experts == 4 and moe.moe.top_k == 2 and moe.per_layer_dim == 0
    for name in GEMMA4:
        resolved = registry.resolve(str(tiny_checkpoint(name)))
        assert resolved.architecture == "Gemma4ForCausalLM" and resolved.impl == "jax"
        spec = kv_spec(Gemma4Args.from_hf(resolved.hf_config), jnp.float32)
        assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (4, 2, 32)
        assert spec.groups.num_groups > 1  # the sliding layers keep only their window


@pytest.fixture(scope="module", params=GEMMA4)
def gemma4_model(request, tiny_checkpoint):
    with tiny_llm(request.param) as llm:
        yield request.param, llm, hf_model(tiny_checkpoint(request.param))


@pytest.mark.slow
def test_gemma4_greedy_tokens_and_logprobs_match_transformers(gemma4_model):
    """Batched, the 70-token prompt prefilled in chunks of the 32-token budget."""
    _, llm, hf = gemma4_model
    assert llm.engine.model.impl == "jax"
    assert_greedy_and_logprobs_match_hf(hf, PROMPTS, llm.generate(PROMPTS, greedy(logprobs=0)), NEW_TOKENS)
    assert llm.engine.stats().compilations_since_warmup == 0


@pytest.mark.slow
def test_gemma4_prompt_logprobs_and_prefix_hits(gemma4_model):
    _, llm, hf = gemma4_model
    assert_prompt_logprobs_match_hf(llm, hf, PROMPTS[2])
    assert_prefix_hits_keep_their_tokens(llm, PROMPTS[2])


def test_gemma4_scanned_step_on_xla_attention_matches_transformers_logits(tiny_checkpoint):
    """The whole step in one program (each run of layers under a scan over its stack) over a
    shuffled paged cache on the XLA attention path: every decode step's logits within 1e-4 of
    transformers' on the full sequence, the same greedy tokens, 23 + 24 tokens against a window
    of 8 (the shared layers reading their source layers' rows all the way)."""
    import registry

    path = tiny_checkpoint("gemma4")
    loaded = registry.load(str(path), model_impl="jax", dtype="float32")
    runner = PagedRunner(loaded, jax.jit(loaded.step_fn, donate_argnames="kv_cache"), pad_tokens=32)
    got, logits = runner.greedy(PROMPTS[1], 24)
    hf = hf_model(path)
    assert got == hf_greedy(hf, PROMPTS[1], 24)
    np.testing.assert_allclose(logits, hf_logits(hf, PROMPTS[1] + got[:-1])[len(PROMPTS[1]) - 1:], atol=1e-4)


@pytest.mark.slow
def test_gemma4_moe_scanned_step_matches_transformers_logits(tiny_checkpoint):
    import registry

    path = tiny_checkpoint("gemma4_moe")
    loaded = registry.load(str(path), model_impl="jax", dtype="float32")
    runner = PagedRunner(loaded, pad_tokens=32)
    got, logits = runner.greedy(PROMPTS[1], 24)
    hf = hf_model(path)
    assert got == hf_greedy(hf, PROMPTS[1], 24)
    np.testing.assert_allclose(logits, hf_logits(hf, PROMPTS[1] + got[:-1])[len(PROMPTS[1]) - 1:], atol=1e-4)


def assert_no_blocks_held(llm) -> None:
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    assert not llm.engine.kv.req_to_blocks


@pytest.mark.slow
@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_long_conversation_matches_transformers(name, tiny_checkpoint):
    """Prompts of 300-420 tokens against an 8-token window, prefilled in 32-token chunks: the
    greedy tokens, their logprobs and the prompt logprobs are transformers'; a second turn hits
    the first one's prefix and continues as transformers does; no block is left held."""
    hf = hf_model(tiny_checkpoint(name))
    with tiny_llm(name, **LONG) as llm:
        outs = llm.generate(LONG_PROMPTS, greedy(NEW, logprobs=0))
        assert_greedy_and_logprobs_match_hf(hf, LONG_PROMPTS, outs, NEW)
        assert_prompt_logprobs_match_hf(llm, hf, LONG_PROMPTS[0])
        second = LONG_PROMPTS[2] + outs[2].outputs[0].token_ids + [7, 8, 9, 10, 11] * 7
        again = llm.generate([second], greedy(NEW))[0]
        assert again.num_cached_tokens >= len(LONG_PROMPTS[2]) - BS
        assert again.outputs[0].token_ids == hf_greedy(hf, second, NEW)
        assert llm.engine.stats().compilations_since_warmup == 0
        assert_no_blocks_held(llm)


@pytest.mark.slow
@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_long_conversations_survive_preemption(name, tiny_checkpoint):
    """A cache with room for about one long sequence at a time: requests are preempted and
    recomputed (with prefix hits) and still give transformers' tokens."""
    hf = hf_model(tiny_checkpoint(name))
    want = [hf_greedy(hf, p, NEW) for p in LONG_PROMPTS]
    with tiny_llm(name, **{**LONG, "num_kv_blocks": 100}) as llm:
        assert tokens(llm.generate(LONG_PROMPTS, greedy(NEW))) == want
        assert llm.engine.stats().num_preemptions > 0 and llm.engine.kv.prefix_cache_stats.hits > 0
        assert_no_blocks_held(llm)


@pytest.mark.slow
def test_gemma4_long_sequence_holds_its_global_context_plus_windows(tiny_checkpoint):
    """Measured at every step of a 420-token prompt and 64 decodes on servax-tiny/gemma4 (cache
    rows for 4 of its 6 layers: one global layer, three sliding ones, each its own group): the
    request holds the global layer's blocks for the whole context plus, per sliding group, the
    window before the step and the step's tokens; at the end about 1/4 of what the 4 cache layers
    would hold keeping every block, 1/6 of every layer with a cache of its own; an aborted
    request and a finished one leave no block behind."""
    with tiny_llm("gemma4", **LONG) as llm:
        engine = llm.engine
        groups = engine.kv_spec.groups
        sliding = sum(w is not None for w in groups.windows)
        assert groups.num_groups == 4 and sliding == 3 and groups.num_rows == 1
        engine.add_request("long", LONG_PROMPTS[2], greedy(64))
        engine.add_request("aborted", LONG_PROMPTS[0], greedy(64))
        held, full, step = [], [], 0
        while engine.has_unfinished_requests():
            engine.step()
            step += 1
            if step == 30:
                engine.abort_request("aborted")
            if "long" in engine.kv.req_to_blocks:
                held.append(engine.kv.num_held_blocks("long"))
                full.append(len(engine.kv.block_ids("long", 0)))
        per_window = cdiv(WINDOW - 1 + LONG["max_num_batched_tokens"], BS) + 1
        assert all(f <= h <= f + sliding * per_window for h, f in zip(held, full))
        assert held[-1] <= full[-1] + sliding * 2 and full[-1] == cdiv(len(LONG_PROMPTS[2]) + 64, BS)
        cache_layers, all_layers = 1 + sliding, 6
        assert held[-1] / (cache_layers * full[-1]) < 1 / cache_layers + 0.05
        assert held[-1] / (all_layers * full[-1]) < 1 / all_layers + 0.05
        assert_no_blocks_held(llm)


@pytest.mark.slow
@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_bfloat16_agrees_with_transformers_bfloat16(name, tiny_checkpoint):
    """A bfloat16 load: the same next token as transformers' bfloat16 model for at least 3 of 4
    prompts, logits within bfloat16 noise (a little wider than Gemma 3's: attention at scale 1.0
    has larger logits, which transformers' eager attention rounds to bfloat16 before its softmax)."""
    import registry

    path = tiny_checkpoint(name)
    loaded = registry.load(str(path), model_impl="jax", dtype="bfloat16")
    runner = PagedRunner(loaded, pad_tokens=32, pad_seqs=1)
    hf = hf_model(path, "bfloat16")
    agree = 0
    for seq, n in enumerate((6, 11, 17, 23)):
        prompt = [random.Random(100 + n).randrange(4, 500) for _ in range(n)]
        ours, ref = runner.run([(seq, 0, prompt)])[0], hf_logits(hf, prompt)[-1]
        assert np.abs(ours - ref).max() < 0.35
        agree += int(ours.argmax() == ref.argmax())
    assert agree >= 3


@pytest.mark.slow
def test_gemma4_refusals_name_the_feature(tmp_path, tiny_checkpoint):
    """Bidirectional attention is refused natively; the torchax path still refuses Gemma 4 (its
    layers' KV shapes differ), so model_impl='torchax' says so rather than serving it wrong."""
    from app import LLM
    from registry.errors import ModelLoadError
    from registry.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("gemma4", tmp_path / "bidirectional", use_bidirectional_attention="vision")
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        LLM(str(path), model_impl="jax", **SMALL_ENGINE)
    with pytest.raises(ModelLoadError, match="differing KV shapes"):
        LLM(str(tiny_checkpoint("gemma4")), model_impl="torchax", **SMALL_ENGINE)


@pytest.mark.slow
def test_gemma4_tensor_parallel_matches_one_device(servax_cache):
    """Tensor parallel 2 and 4 give one device's greedy tokens (the cache's 2 KV heads stored
    twice at tp 4; the experts split by their features); nothing compiles while serving. The
    dense model at tp 2 and 4, the MoE one at tp 2 (CI's time: each engine compiles its buckets)."""
    from test_spmd import run_worker

    tps = {"gemma4": (2, 4), "gemma4_moe": (2,)}
    params = {"q": "sliding.q", "embed": "embed", "gate": "sliding.experts.gate"}
    runs = run_worker(dict(model_impl="jax", runs=[
        dict(model=f"servax-tiny/{name}", name=name, tp=[1, *tps[name]],
             params={k: v for k, v in params.items() if k != "gate" or name == "gemma4_moe"})
        for name in GEMMA4
    ]), servax_cache)
    for name in GEMMA4:
        ref = runs[(name, 1)]
        for tp in tps[name]:
            run = runs[(name, tp)]
            for field in ("batched", "alone", "pair"):
                assert run[field] == ref[field], f"{name} tp {tp}: {field}"
            assert run["compilations_since_warmup"] == 0
    assert runs[("gemma4", 4)]["params"]["q"]["shard_shape"] == [64, 1, 16]  # a sliding layer's q, by head
    assert runs[("gemma4", 4)]["params"]["embed"]["shard_shape"] == [128, 64]
    assert runs[("gemma4_moe", 2)]["params"]["gate"]["shard_shape"] == [4, 64, 16]  # every expert, half its features
