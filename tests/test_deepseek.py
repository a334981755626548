"""Native DeepSeek-V2 and DeepSeek-V3 against transformers: latent attention over a paged cache
that keeps one latent per token, DeepSeek's routing and shared experts, dense first layers.

Greedy tokens identical to transformers' and prompt logprobs within 1e-4, through the engine:
chunked prefill, prefix-cache hits, preemption; the cache's bytes per token against full
per-head K/V; tensor and expert parallelism on fake devices give one device's tokens.
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from conftest import (
    ENGINE_PROMPTS as PROMPTS, assert_prefix_hits_keep_their_tokens, assert_prompt_logprobs_match_hf, greedy,
    hf_greedy, hf_logits, hf_model, NEW_TOKENS,
    output_tokens as tokens, PagedRunner, quick_loop_keeps, SMALL_ENGINE as ENGINE, tiny_llm,
)

DEEPSEEK = ["deepseek_v2", "deepseek_v3"]


# (model, EngineConfig.mla_prefill): each model as served, and with the expanded form forced on
# the tokens after each step's decodes (the prefills, chunked and after prefix hits)
SERVED = [("deepseek_v2", "auto"), ("deepseek_v3", "auto"), ("deepseek_v2", "expanded"), ("deepseek_v3", "expanded")]


@pytest.fixture(scope="module", params=quick_loop_keeps([(x,) for x in SERVED], (("deepseek_v3", "auto"),),
                                                        ids=[f"{n}-{f}" for n, f in SERVED]))
def deepseek_model(request, tiny_checkpoint):
    name = request.param[0]
    with tiny_llm(name, mla_prefill=request.param[1]) as llm:
        yield name, llm, tiny_checkpoint(name)


def full_kv_bytes_per_token(cfg, itemsize: int) -> int:
    """What a cache of every head's keys (nope + rope dims) and values would take per token."""
    head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    return cfg.num_hidden_layers * cfg.num_attention_heads * head * itemsize


def test_deepseek_runs_natively_on_a_latent_cache(deepseek_model):
    name, llm, _ = deepseek_model
    cfg = llm.engine.model.hf_config
    assert llm.engine.model.impl == "jax"
    cache = llm.engine.programs.kv_cache
    assert cache.k.shape[2:] == (1, 8, cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # one latent "head" per token
    assert cache.v.size == 0  # the values are the latent's first kv_lora_rank dims
    assert llm.engine.plan.kv_spec.value_dims == cfg.kv_lora_rank
    assert llm.engine.plan.attention_backend == "cpu"  # the C++ kernel reads the values from the keys
    assert cache.mla_prefill == llm.engine.plan.mla_prefill  # the prefills' form, as the engine was asked
    # Stepped a few layers per call, a program per stack (dense layers, then MoE), on packed weights
    layered = llm.engine.programs.layered
    assert {key: len(layers) for key, layers in layered.stacks.items()} == {
        "dense_layers": cfg.first_k_dense_replace, "layers": cfg.num_hidden_layers - cfg.first_k_dense_replace}
    assert layered.packed


FORMS = [("deepseek_v2", "absorbed"), ("deepseek_v2", "expanded"), ("deepseek_v3", "expanded")]


@pytest.mark.parametrize("name, form", quick_loop_keeps(FORMS, ("deepseek_v2", "expanded"),
                                                       ids=[f"{n}-{f}" for n, f in FORMS]))
def test_deepseek_scanned_step_matches_transformers_logits(name, form, tiny_checkpoint):
    """The whole step in one program (each stack of layers under a scan, as under `layered:
    false`) over a shuffled paged cache, on the XLA path: every decode step's logits within 1e-4
    of transformers' on the full sequence, and the same greedy tokens; the prompt's tokens after
    the decodes' slots absorbed or expanded."""
    import dataclasses

    import registry

    path = tiny_checkpoint(name)
    loaded = registry.load(str(path), model_impl="jax", dtype="float32")
    runner = PagedRunner(loaded, jax.jit(loaded.step_fn, donate_argnames="kv_cache"), pad_tokens=32)
    runner.cache = dataclasses.replace(runner.cache, mla_prefill=form)
    prompt = PROMPTS[1]
    got, logits = runner.greedy(prompt, 16)
    hf = hf_model(path)
    assert got == hf_greedy(hf, prompt, 16)
    np.testing.assert_allclose(logits, hf_logits(hf, prompt + got[:-1])[len(prompt) - 1:], atol=1e-4)


@pytest.mark.parametrize("backend", quick_loop_keeps(["xla", "cpu"], "cpu"))
def test_values_in_keys_attend_as_the_keys_first_dims(backend):
    """paged_attention with value_dims over a latent cache equals dense causal attention whose
    values are the keys' first dims: a prompt in two chunks (the second reads the first from the
    cache, per token and per sequence), then a decode; on the XLA path and in the C++ kernel,
    which reads the keys as values in place."""
    import jax.numpy as jnp

    from runtime.ops.attention import paged_attention
    from runtime.ops.step import KVCacheSpec, allocate_kv_cache, make_step_input

    rng = np.random.default_rng(0)
    heads, dims, value_dims, block_size, n = 4, 12, 8, 4, 11
    q = rng.standard_normal((n, heads, dims)).astype(np.float32)
    k = rng.standard_normal((n, 1, dims)).astype(np.float32)
    cache = allocate_kv_cache(KVCacheSpec(2, 1, dims, jnp.float32, value_dims=value_dims), 8, block_size,
                              attention_backend=backend)
    table = [3, 5, 6, 0]
    outs = []
    for start, end in ((0, 6), (6, 10), (10, 11)):
        t = end - start
        batch = make_step_input(
            input_ids=np.full(t, 7), positions=np.arange(start, end),
            slot_mapping=np.array([table[p // block_size] * block_size + p % block_size for p in range(start, end)]),
            block_tables=np.array([table]), seq_lens=np.array([end]), query_start_loc=np.array([0, t]),
            logits_indices=np.array([t - 1]), num_seqs=1, num_tokens=t,
        )
        out, cache = paged_attention(q[start:end], k[start:end], None, cache, batch, layer=1, scale=0.3,
                                     value_dims=value_dims)
        outs.append(np.asarray(out))
    want = []
    for i in range(n):
        s = 0.3 * q[i] @ k[: i + 1, 0].T  # [H, i + 1]
        p = np.exp(s - s.max(-1, keepdims=True))
        want.append((p / p.sum(-1, keepdims=True)) @ k[: i + 1, 0, :value_dims])
    np.testing.assert_allclose(np.concatenate(outs), np.stack(want), atol=1e-5)
    assert cache.v.size == 0 and np.abs(np.asarray(cache.k[0])).max() == 0  # layer 0 untouched


@pytest.mark.parametrize("backend", quick_loop_keeps(["xla", "cpu"], "cpu"))
def test_expanded_form_equals_absorbed_and_dense_attention(backend, monkeypatch):
    """latent_attention on a mixed step (two decodes, a prefill chunk after 7 cached tokens, a
    fresh prompt, padding), each form against per-head attention over the expanded context
    (keys [c W_UK_h, k_rope], values c W_UV_h): absorbed, expanded after the decodes' slots, and
    auto on each side of its threshold; on the XLA path and with the C++ kernel's decodes."""
    import jax.numpy as jnp

    from models_jax import mla
    from runtime.ops.step import KVCacheSpec, allocate_kv_cache, make_step_input

    rng = np.random.default_rng(0)
    heads, nope, rope, rank, v, block_size, scale = 4, 6, 4, 10, 5, 4, 0.3
    seqs = {"decode a": (9, 1, [1, 2, 3]), "decode b": (5, 1, [4, 5]), "chunk": (7, 9, [6, 7, 8, 9]),
            "fresh": (0, 6, [10, 11])}  # cached tokens, new tokens, blocks
    latent, q_nope, q_rope = ({name: rng.standard_normal((c + n, h, d)).astype(np.float32)
                               for name, (c, n, _) in seqs.items()}
                              for h, d in ((1, rank + rope), (heads, nope), (heads, rope)))
    w_uk = (0.3 * rng.standard_normal((rank, heads, nope))).astype(np.float32)
    w_uv = rng.standard_normal((rank, heads, v)).astype(np.float32)

    def step(cache, cached: bool):
        """One step of every sequence's tokens (cached: the new ones; else the cached ones),
        padded to 24 tokens and 4 sequence slots."""
        spans = {name: (c, c + n) if cached else (0, c) for name, (c, n, _) in seqs.items()}
        spans = {name: span for name, span in spans.items() if span[1] > span[0]}
        pos = np.concatenate([np.arange(*span) for span in spans.values()])
        slots = np.concatenate([[seqs[name][2][p // block_size] * block_size + p % block_size for p in range(*span)]
                                for name, span in spans.items()])
        pad = 24 - len(pos)
        tables = [seqs[name][2] + [0] * (6 - len(seqs[name][2])) for name in spans] + [[0] * 6] * (4 - len(spans))
        starts = np.cumsum([0] + [end - start for start, end in spans.values()])
        batch = make_step_input(
            input_ids=np.zeros(24), positions=np.pad(pos, (0, pad)),
            slot_mapping=np.pad(slots, (0, pad), constant_values=-1),
            block_tables=np.array(tables), seq_lens=np.pad([end for _, end in spans.values()], (0, 4 - len(spans))),
            query_start_loc=np.pad(starts, (0, 4 - len(spans)), mode="edge"), logits_indices=np.zeros(4),
            num_seqs=len(spans), num_tokens=len(pos))
        rows = lambda x: jnp.asarray(np.pad(np.concatenate([x[name][slice(*span)] for name, span in spans.items()]),
                                            ((0, pad), (0, 0), (0, 0))))
        fn = jax.jit(lambda c, b, *a: mla.latent_attention(*a[:3], c, jnp.int32(1), b, *a[3:], scale=scale))
        out, cache = fn(cache, batch, rows(q_nope), rows(q_rope), rows(latent), jnp.asarray(w_uk), jnp.asarray(w_uv))
        return np.asarray(out)[:len(pos)], cache

    def expanded_attention(name: str, p: int) -> np.ndarray:  # [H, v]
        c = latent[name][:p + 1, 0]
        k = np.concatenate([np.einsum("cr,rhn->hcn", c[:, :rank], w_uk),
                            np.broadcast_to(c[None, :, rank:], (heads, p + 1, rope))], -1)
        s = scale * np.einsum("hd,hcd->hc", np.concatenate([q_nope[name][p], q_rope[name][p]], -1), k)
        w = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("hc,hcv->hv", w / w.sum(-1, keepdims=True), np.einsum("cr,rhv->hcv", c[:, :rank], w_uv))

    want = np.concatenate([np.stack([expanded_attention(name, p) for p in range(c, c + n)])
                           for name, (c, n, _) in seqs.items()])
    for form, threshold in (("absorbed", 0), ("expanded", 0), ("auto", 1), ("auto", 100)):
        monkeypatch.setitem(mla.EXPANDED_MIN_TOKENS, backend, threshold)
        cache = allocate_kv_cache(KVCacheSpec(2, 1, rank + rope, jnp.float32, value_dims=rank), 16, block_size,
                                  attention_backend=backend, mla_prefill=form)
        _, cache = step(cache, cached=False)
        got, cache = step(cache, cached=True)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{form}, threshold {threshold}")
    assert np.abs(np.asarray(cache.k[0])).max() == 0  # layer 0 untouched


def test_latent_cache_bytes_per_token_against_full_kv(deepseek_model):
    """The allocated cache per token slot is the latent alone; on the tiny model a quarter of
    per-head K/V, on DeepSeek-V3's own dimensions (61 layers, 128 heads) under 1/70."""
    import jax.numpy as jnp
    from transformers import DeepseekV3Config

    from models_jax.deepseek import DeepseekArgs, kv_spec

    name, llm, _ = deepseek_model
    cfg = llm.engine.model.hf_config
    cache = llm.engine.programs.kv_cache
    slots = cache.k.shape[1] * cache.k.shape[3]
    latent = (cache.k.nbytes + cache.v.nbytes) / slots
    assert latent == cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert latent == llm.engine.plan.kv_spec.bytes_per_block(8) / 8
    assert latent / full_kv_bytes_per_token(cfg, 4) == 0.25

    v3 = DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"])
    per_token = kv_spec(DeepseekArgs.from_hf(v3), jnp.bfloat16).bytes_per_block(1)
    assert per_token == 61 * 576 * 2
    assert per_token / full_kv_bytes_per_token(v3, 2) < 1 / 70


def test_deepseek_greedy_tokens_match_transformers(deepseek_model):
    """Batched, with the 70-token prompt prefilled in chunks of the 32-token budget."""
    name, llm, path = deepseek_model
    hf = hf_model(path)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert tokens(llm.generate(PROMPTS, greedy())) == want
    assert llm.engine.stats().compilations_since_warmup == 0


def test_deepseek_prompt_logprobs_match_transformers(deepseek_model):
    name, llm, path = deepseek_model
    assert_prompt_logprobs_match_hf(llm, hf_model(path), PROMPTS[2])


def test_deepseek_prefix_hits_keep_their_tokens(deepseek_model):
    name, llm, _ = deepseek_model
    assert_prefix_hits_keep_their_tokens(llm, PROMPTS[2])


@pytest.mark.slow
def test_deepseek_preemption_recomputes_the_same_tokens(tiny_checkpoint):
    """A latent cache too small for every sequence at once: requests are preempted and recomputed."""
    from app import LLM

    path = tiny_checkpoint("deepseek_v3")
    want = [hf_greedy(hf_model(path), p, 24) for p in PROMPTS]
    llm = LLM("servax-tiny/deepseek_v3", **{**ENGINE, "max_model_len": 128, "num_kv_blocks": 24})
    try:
        assert tokens(llm.generate(PROMPTS * 2, greedy(max_tokens=24))) == want * 2
        assert llm.engine.stats().num_preemptions > 0
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_an_int8_latent_cache_keeps_one_scale_per_token(deepseek_model):
    """kv_cache_dtype='int8' on a latent cache: int8 latents with a float32 scale per token and
    layer (no values, no value scales), served on the XLA path. Its tokens are not compared: the
    tiny models' random weights turn int8 rounding into other greedy picks within a few tokens."""
    from app import LLM

    name, llm, _ = deepseek_model
    cfg = llm.engine.model.hf_config
    quantized = LLM(f"servax-tiny/{name}", **ENGINE, kv_cache_dtype="int8")
    try:
        cache = quantized.engine.programs.kv_cache
        assert cache.k.dtype == np.int8 and cache.v.size == 0 and cache.v_scale.size == 0
        per_token = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim + 4)
        assert quantized.engine.plan.kv_spec.bytes_per_block(8) == 8 * per_token
        assert [len(t) for t in tokens(quantized.generate(PROMPTS, greedy(max_tokens=8)))] == [8] * len(PROMPTS)
        assert quantized.engine.stats().compilations_since_warmup == 0
    finally:
        quantized.shutdown()


@pytest.mark.slow
def test_v3_correction_bias_chooses_experts_but_does_not_weight_them(tiny_checkpoint, tmp_path):
    """A V3 checkpoint with non-zero e_score_correction_bias (transformers initialises it to
    zeros): the tokens still equal transformers', and differ from the unbiased model's."""
    import torch

    from app import LLM

    path = tiny_checkpoint("deepseek_v3")
    hf = hf_model(path)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in hf.model.layers[hf.config.first_k_dense_replace:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape, generator=generator) * 0.5)
    biased = tmp_path / "biased"
    shutil.copytree(path, biased)
    hf.save_pretrained(biased)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    llm = LLM(str(biased), **ENGINE)
    try:
        got = tokens(llm.generate(PROMPTS, greedy()))
    finally:
        llm.shutdown()
    assert got == want
    assert got != [hf_greedy(hf_model(path), p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("name", quick_loop_keeps(DEEPSEEK, "deepseek_v3"))
def test_router_matches_transformers(name, tiny_checkpoint):
    """DeepSeek's routers alone: the same experts and weights as transformers' for random tokens
    (V2 group-limited greedy over softmax scores; V3 sigmoid scores, a random correction bias,
    groups ranked by their best two, renormalized, scaled)."""
    import jax.numpy as jnp
    import torch

    from models_jax.deepseek import DeepseekArgs
    from models_jax.moe import route

    hf = hf_model(tiny_checkpoint(name))
    router = hf.model.layers[1].mlp.gate
    generator = torch.Generator().manual_seed(1)
    params = {"router": jnp.asarray(router.weight.detach().numpy().T)}
    if name == "deepseek_v3":
        with torch.no_grad():
            router.e_score_correction_bias.copy_(torch.randn(router.e_score_correction_bias.shape,
                                                             generator=generator) * 0.5)
        params["correction_bias"] = jnp.asarray(router.e_score_correction_bias.numpy())
    x = torch.randn(32, hf.config.hidden_size, generator=generator)
    with torch.no_grad():
        _, want_weights, want_ids = router(x)
    weights, ids = route(jnp.asarray(x.numpy()), params, DeepseekArgs.from_hf(hf.config).moe)
    order, want_order = np.argsort(np.asarray(ids), -1), np.argsort(want_ids.numpy(), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, -1),
                                  np.take_along_axis(want_ids.numpy(), want_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(want_weights.numpy(), want_order, -1), rtol=1e-5)


@pytest.mark.slow
def test_deepseek_tensor_and_expert_parallel_match_one_device(servax_cache):
    """DeepSeek-V3: tensor parallel 2 and 4 (heads, kv_b, MLP features and expert features split;
    the latent cache whole on each device), expert parallel 2, and tensor parallel 2 with the
    prefills' expanded form forced give one device's greedy tokens. (V2 lays its attention and
    experts out as V3 does; only its router differs, which runs whole on every device.) Programs compile
    on first use (enforce_eager): the buckets of five engines would not compile within the
    worker's time on a small machine; the one-device tests count compilations after warmup."""
    from test_spmd import run_worker

    params = {"kv_b": "layers.kv_b", "gate": "layers.mlp.experts.gate"}
    eager = dict(enforce_eager=True)
    runs = run_worker(dict(model_impl="jax", runs=[
        dict(model="servax-tiny/deepseek_v3", name="v3", tp=[1, 2, 4], params=params, engine=eager),
        dict(model="servax-tiny/deepseek_v3", name="v3-ep", tp=[2], params=params,
             engine=dict(eager, enable_expert_parallel=True)),
        dict(model="servax-tiny/deepseek_v3", name="v3-expanded", tp=[2], engine=dict(eager, mla_prefill="expanded")),
    ]), servax_cache)
    for key, ref in [(("v3", 2), "v3"), (("v3", 4), "v3"), (("v3-ep", 2), "v3"), (("v3-expanded", 2), "v3")]:
        run, ref = runs[key], runs[(ref, 1)]
        for field in ("batched", "alone", "pair"):
            assert run[field] == ref[field], f"{key}: {field}"
    tp = runs[("v3", 2)]
    assert tp["kv"]["shard_shape"] == tp["kv"]["shape"]  # one latent head: replicated, not split
    # Layer 0's of each (the layers are stepped a few per call, each with arrays of its own)
    assert tp["params"]["kv_b"]["shard_shape"] == [32, 2, 32]  # [r, heads / 2, nope + v]
    assert tp["params"]["gate"]["shard_shape"] == [8, 64, 16]  # every expert, half its features
    assert runs[("v3-ep", 2)]["params"]["gate"]["shard_shape"] == [4, 64, 32]  # half the experts, whole
