"""Native Gemma 2 and Gemma 3 (text) against transformers on tiny random checkpoints.

Greedy tokens identical to transformers' and prompt logprobs within 1e-4, through the engine
(the CPU attention kernel, layers stepped and packed): prompts longer than the 8-token sliding
window and one longer than the 32-token step budget (chunked prefill), prefix-cache hits and
preemption; the scanned step on the XLA attention path matches transformers' logits at every
decode step; a bfloat16 load agrees with transformers' bfloat16; tensor parallel 2 and 4 on
fake devices give one device's tokens.
Gemma 2 soft-caps attention and final logits; Gemma 3 has QK-norm and a rope base per layer type.
"""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from conftest import (
    ENGINE_PROMPTS as PROMPTS, assert_prefix_hits_keep_their_tokens, assert_prompt_logprobs_match_hf, greedy,
    hf_greedy, hf_logits, hf_model, NEW_TOKENS,
    output_tokens as tokens, quick_loop_keeps, PagedRunner, SMALL_ENGINE as ENGINE, tiny_llm,
)

GEMMA = ["gemma2", "gemma3"]
ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


@pytest.fixture(scope="module", params=quick_loop_keeps(GEMMA, "gemma3"))
def gemma_model(request, tiny_checkpoint):
    with tiny_llm(request.param) as llm:
        yield request.param, llm, tiny_checkpoint(request.param)


def test_gemma_configs_mix_sliding_and_global_layers(tiny_checkpoint):
    """The tiny configs exercise what the module claims: both layer types, the window shorter
    than the prompts, Gemma 2's caps, Gemma 3's two rope bases."""
    import registry
    from models_jax.gemma import GemmaArgs

    for name in GEMMA:
        resolved = registry.resolve(str(tiny_checkpoint(name)))
        assert resolved.architecture == ARCHITECTURES[name] and resolved.impl == "jax"
        args = GemmaArgs.from_hf(resolved.hf_config)
        assert set(args.sliding_windows) == {8, None} and args.tie_word_embeddings
        assert args.query_pre_attn_scalar == 24 != args.head_dim
        if name == "gemma2":
            assert args.attn_logit_softcap == 5.0 and args.final_logit_softcap == 5.0 and args.local_rope is None
        else:
            assert args.qk_norm and args.attn_logit_softcap is None
            assert args.local_rope.theta == 10000.0 and args.rope.rope_type == "linear"


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_gemma_greedy_tokens_match_transformers(gemma_model):
    """Batched, with the 70-token prompt prefilled in chunks of the 32-token budget; each
    generated token's logprob within 1e-4 of transformers' (the decodes are where the windows
    and Gemma 2's attention cap change the logits most: random prompts give flat attention)."""
    name, llm, path = gemma_model
    assert llm.engine.model.impl == "jax"
    hf = hf_model(path)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    outs = llm.generate(PROMPTS, greedy(logprobs=0))
    assert tokens(outs) == want
    assert llm.engine.stats().compilations_since_warmup == 0
    for prompt, new, out in zip(PROMPTS, want, outs):
        ref = log_softmax(hf_logits(hf, prompt + new[:-1])[len(prompt) - 1:])
        ours = [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, new)]
        np.testing.assert_allclose(ours, ref[np.arange(len(new)), new], atol=1e-4)


def test_gemma_prompt_logprobs_match_transformers(gemma_model):
    name, llm, path = gemma_model
    assert_prompt_logprobs_match_hf(llm, hf_model(path), PROMPTS[2])


def test_gemma_prefix_hits_keep_their_tokens(gemma_model):
    name, llm, _ = gemma_model
    assert_prefix_hits_keep_their_tokens(llm, PROMPTS[2])


@pytest.mark.slow
def test_gemma_preemption_recomputes_the_same_tokens(tiny_checkpoint):
    """A KV cache too small for every sequence at once: requests are preempted and recomputed.
    (Blocks of one layer each here: the sliding and global layers are KV cache groups of one.)"""
    from app import LLM

    path = tiny_checkpoint("gemma3")
    want = [hf_greedy(hf_model(path), p, 24) for p in PROMPTS]
    llm = LLM("servax-tiny/gemma3", **{**ENGINE, "max_model_len": 128, "num_kv_blocks": 40})
    try:
        assert tokens(llm.generate(PROMPTS * 2, greedy(max_tokens=24))) == want * 2
        assert llm.engine.stats().num_preemptions > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", quick_loop_keeps(GEMMA, "gemma3"))
def test_gemma_scanned_step_on_xla_attention_matches_transformers_logits(name, tiny_checkpoint):
    """The whole step (layers under one scan) over a shuffled paged cache on the XLA attention
    path: every decode step's logits within 1e-4 of transformers' on the full sequence, and
    the same greedy tokens, 23 + 24 tokens against a window of 8."""
    import registry

    path = tiny_checkpoint(name)
    loaded = registry.load(str(path), model_impl="jax", dtype="float32")
    runner = PagedRunner(loaded, jax.jit(loaded.step_fn, donate_argnames="kv_cache"), pad_tokens=32)
    prompt = PROMPTS[1]
    got, logits = runner.greedy(prompt, 24)
    hf = hf_model(path)
    assert got == hf_greedy(hf, prompt, 24)
    ref = hf_logits(hf, prompt + got[:-1])[len(prompt) - 1:]
    np.testing.assert_allclose(logits, ref, atol=1e-4)


@pytest.mark.parametrize("name", quick_loop_keeps(GEMMA, "gemma3"))
def test_gemma_bfloat16_agrees_with_transformers_bfloat16(name, tiny_checkpoint):
    """A bfloat16 load (the embedding scale rounded to bfloat16, norms scaled in float32, as
    transformers does): the same next token as transformers' bfloat16 model for at least 3 of 4
    prompts, logits within bfloat16 noise."""
    import registry

    path = tiny_checkpoint(name)
    loaded = registry.load(str(path), model_impl="jax", dtype="bfloat16")
    runner = PagedRunner(loaded, pad_tokens=32, pad_seqs=1)
    hf = hf_model(path, "bfloat16")
    agree = 0
    for seq, n in enumerate((6, 11, 17, 23)):
        prompt = [random.Random(100 + n).randrange(4, 500) for _ in range(n)]
        ours, ref = runner.run([(seq, 0, prompt)])[0], hf_logits(hf, prompt)[-1]
        assert np.abs(ours - ref).max() < 0.25
        agree += int(ours.argmax() == ref.argmax())
    assert agree >= 3


def test_gemma_bidirectional_attention_is_refused(tmp_path):
    from app import LLM
    from registry.errors import ModelLoadError
    from registry.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("gemma3", tmp_path / "bidirectional", use_bidirectional_attention=True)
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        LLM(str(path), model_impl="jax", **ENGINE)


@pytest.mark.slow
def test_gemma_tensor_parallel_matches_one_device(servax_cache):
    """Gemma 2 and Gemma 3 (4 heads, 2 KV heads): tensor parallel 2 and 4 give one device's greedy
    tokens (tp 4 stores each KV head twice); nothing compiles while serving."""
    from test_spmd import run_worker

    runs = run_worker(dict(model_impl="jax", runs=[
        dict(model=f"servax-tiny/{name}", name=name, tp=[1, 2, 4], params={"q": "layers.q", "embed": "embed"})
        for name in GEMMA
    ]), servax_cache)
    for name in GEMMA:
        ref = runs[(name, 1)]
        for tp in (2, 4):
            run = runs[(name, tp)]
            for field in ("batched", "alone", "pair"):
                assert run[field] == ref[field], f"{name} tp {tp}: {field}"
            assert run["compilations_since_warmup"] == 0
        # layer 0 of the per-layer weights: q [D, 4 heads, 16] split by head, the tied embedding by vocab
        assert runs[(name, 4)]["params"]["q"]["shard_shape"] == [64, 1, 16]
        assert runs[(name, 4)]["params"]["embed"]["shard_shape"] == [128, 64]
