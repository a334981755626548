"""Native JAX Llama-family models against transformers on the same tiny checkpoints.

Spec (float32 unless stated):
- prefill logits match transformers (eager attention) to max abs diff < 1e-4;
- greedy decoding of 40 tokens through the paged cache (shuffled block tables, block_size 4,
  two prompts of different lengths decoded together) is token-identical to
  `generate(do_sample=False)`, and every step's logits match to < 1e-4;
- a prompt prefilled in two chunks over two steps gives the same last logits;
- a bfloat16 load runs and agrees on the first greedy token for most prompts (>= 3 of 4).
Mistral's sliding window (24 in the tiny config) is crossed: prompts + 40 tokens > 24.
The weight table alone (no checkpoint) makes random params that load back unchanged from
a safetensors folder and match transformers on those weights.
The layers run as one loop (jax.lax.scan): the step program does not grow with depth, and
layers with different sliding windows (Qwen2's `max_window_layers`) share that loop.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types

import jax
import ml_dtypes
import numpy as np
import pytest
import torch

import registry
from conftest import hf_logits, quick_loop_keeps
from models_jax import layers
from runtime.ops.step import allocate_kv_cache, make_step_input

MODELS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]
TOL = 1e-4
NEW_TOKENS = 40
# Fixed padded shapes so that each model compiles its step once.
T_PAD, S_PAD, BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 64, 2, 4, 40, 16

_rng = np.random.RandomState(0)
PROMPTS = [_rng.randint(4, 500, size=17).tolist(), _rng.randint(4, 500, size=11).tolist()]
EXTRA_PROMPTS = [_rng.randint(4, 500, size=9).tolist(), _rng.randint(4, 500, size=23).tolist()]
# Shuffled physical blocks: each sequence's pages are scattered over the pool.
BLOCK_ROWS = _rng.permutation(NUM_BLOCKS)[: S_PAD * MAX_BLOCKS].reshape(S_PAD, MAX_BLOCKS)


def step_input(chunks: list[tuple[list[int], int]]):
    """StepInput for sequence i getting tokens chunks[i][0] at positions from chunks[i][1]."""
    ids, pos, slots, starts, seq_lens, last = [], [], [], [0], [], []
    for (tokens, start), row in zip(chunks, BLOCK_ROWS):
        p = start + np.arange(len(tokens))
        ids += tokens
        pos += p.tolist()
        slots += (row[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE).tolist()
        starts.append(len(ids))
        seq_lens.append(start + len(tokens))
        last.append(len(ids) - 1)
    n, s = len(ids), len(chunks)
    pad_t, pad_s = T_PAD - n, S_PAD - s
    tables = np.where(np.arange(S_PAD)[:, None] < s, BLOCK_ROWS, 0)
    return make_step_input(
        input_ids=np.array(ids + [0] * pad_t), positions=np.array(pos + [0] * pad_t),
        slot_mapping=np.array(slots + [-1] * pad_t), block_tables=tables,
        seq_lens=np.array(seq_lens + [0] * pad_s), query_start_loc=np.array(starts + [n] * pad_s),
        logits_indices=np.array(last + [0] * pad_s), num_seqs=s, num_tokens=n,
    )


def greedy(model, step, prompts, num_tokens):
    """Prefill all prompts in one step, then decode them together. Returns (tokens [S, n], logits [n, S, V])."""
    cache = allocate_kv_cache(model.kv_spec, NUM_BLOCKS, BLOCK_SIZE)
    logits, cache = step(model.params, cache, step_input([(p, 0) for p in prompts]))
    tokens, all_logits = [], []
    for i in range(num_tokens):
        logits = np.asarray(logits)[: len(prompts)]
        all_logits.append(logits)
        tokens.append(logits.argmax(-1))
        if i + 1 < num_tokens:
            chunks = [([int(t)], len(p) + i) for p, t in zip(prompts, tokens[-1])]
            logits, cache = step(model.params, cache, step_input(chunks))
    return np.stack(tokens, axis=1), np.stack(all_logits)


@dataclasses.dataclass
class Family:
    name: str
    model: object  # LoadedModel, float32
    step: object  # jitted step_fn, cache donated
    hf: object  # transformers model, eager attention
    hf_tokens: list  # per prompt, [NEW_TOKENS]
    hf_logits: list  # per prompt, [NEW_TOKENS, V]


@pytest.fixture(scope="module", params=[pytest.param(m, marks=pytest.mark.slow) for m in MODELS])
def family(request, tiny_checkpoint) -> Family:
    from transformers import AutoModelForCausalLM

    name = request.param
    path = tiny_checkpoint(name)
    model = registry.load(str(path), model_impl="jax", dtype="float32")
    step = jax.jit(model.step_fn, donate_argnames="kv_cache")
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # always 40 tokens; servax's loop ignores EOS too
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = hf.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                output_logits=True, return_dict_in_generate=True,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )
            tokens.append(out.sequences[0, len(prompt):].numpy())
            logits.append(torch.cat(out.logits).numpy())
    assert all(len(t) == NEW_TOKENS for t in tokens)
    return Family(name, model, step, hf, tokens, logits)


def hf_last_logits(hf, prompt) -> np.ndarray:  # [V]
    return hf_logits(hf, prompt)[-1]


def test_prefill_logits_match_transformers(family):
    cache = allocate_kv_cache(family.model.kv_spec, NUM_BLOCKS, BLOCK_SIZE)
    logits, _ = family.step(family.model.params, cache, step_input([(p, 0) for p in PROMPTS]))
    assert logits.dtype == np.float32 and logits.shape == (S_PAD, 512)
    for i, prompt in enumerate(PROMPTS):
        diff = np.abs(np.asarray(logits[i]) - hf_last_logits(family.hf, prompt)).max()
        print(f"{family.name} prefill prompt {i}: max abs logit diff {diff:.2e}")
        assert diff < TOL


def test_greedy_decode_matches_transformers_generate(family):
    tokens, logits = greedy(family.model, family.step, PROMPTS, NEW_TOKENS)
    for i in range(len(PROMPTS)):
        np.testing.assert_array_equal(tokens[i], family.hf_tokens[i], err_msg=f"{family.name} prompt {i}")
        diff = np.abs(logits[:, i] - family.hf_logits[i]).max()
        print(f"{family.name} decode prompt {i}: max abs logit diff over {NEW_TOKENS} steps {diff:.2e}")
        assert diff < TOL
    if family.name == "mistral":
        assert len(PROMPTS[1]) + NEW_TOKENS > 2 * family.hf.config.sliding_window


def test_chunked_prefill_gives_same_last_logits(family):
    prompt = PROMPTS[0]
    cache = allocate_kv_cache(family.model.kv_spec, NUM_BLOCKS, BLOCK_SIZE)
    whole, _ = family.step(family.model.params, cache, step_input([(prompt, 0)]))
    cut = 7  # not a block boundary
    cache = allocate_kv_cache(family.model.kv_spec, NUM_BLOCKS, BLOCK_SIZE)
    _, cache = family.step(family.model.params, cache, step_input([(prompt[:cut], 0)]))
    chunked, _ = family.step(family.model.params, cache, step_input([(prompt[cut:], cut)]))
    np.testing.assert_allclose(np.asarray(chunked[0]), np.asarray(whole[0]), atol=1e-5, rtol=0)
    assert np.abs(np.asarray(chunked[0]) - hf_last_logits(family.hf, prompt)).max() < TOL


def test_bfloat16_load_agrees_on_first_greedy_token(family):
    model = registry.load(family.model.model_id, model_impl="jax", dtype="bfloat16")
    assert all(p.dtype == jax.numpy.bfloat16 for p in jax.tree.leaves(model.params))
    assert model.kv_spec.dtype == jax.numpy.bfloat16
    step = jax.jit(model.step_fn, donate_argnames="kv_cache")
    agree = 0
    for prompts in (PROMPTS, EXTRA_PROMPTS):
        f32, _ = family.step(family.model.params, allocate_kv_cache(family.model.kv_spec, NUM_BLOCKS, BLOCK_SIZE),
                             step_input([(p, 0) for p in prompts]))
        bf16, _ = step(model.params, allocate_kv_cache(model.kv_spec, NUM_BLOCKS, BLOCK_SIZE),
                       step_input([(p, 0) for p in prompts]))
        assert bf16.dtype == np.float32 and np.isfinite(np.asarray(bf16)).all()
        agree += int((np.asarray(f32).argmax(-1) == np.asarray(bf16).argmax(-1)).sum())
    print(f"{family.name} bfloat16: first greedy token agrees for {agree}/4 prompts")
    assert agree >= 3


@pytest.mark.slow
@pytest.mark.parametrize("rope", [
    dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
    dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0),
    # YaRN with its attention factor from `factor` (gpt-oss) and from DeepSeek's mscale pair
    dict(rope_type="yarn", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=16),
    dict(rope_type="yarn", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=16, mscale=0.707,
         mscale_all_dim=1.0, beta_fast=16.0, beta_slow=2.0),
])
def test_rope_scaling_variants_match_transformers(tmp_path, rope):
    """Linear, dynamic NTK and YaRN rope on a 40-token prompt, past max_position_embeddings=32."""
    from registry.tiny import make_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint("llama", tmp_path / "ckpt", rope_parameters=rope, max_position_embeddings=32)
    model = registry.load(str(path), model_impl="jax")
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    prompt = np.random.RandomState(1).randint(4, 500, size=40).tolist()
    logits, _ = jax.jit(model.step_fn)(model.params, allocate_kv_cache(model.kv_spec, NUM_BLOCKS, BLOCK_SIZE),
                                       step_input([(prompt, 0)]))
    assert np.abs(np.asarray(logits[0]) - hf_last_logits(hf, prompt)).max() < TOL


def test_unknown_rope_type_is_rejected():
    cfg = types.SimpleNamespace(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        layers.RopeConfig.from_hf(cfg, head_dim=16)


def test_weight_table_is_megatron_sharded(tiny_checkpoint):
    model = registry.load(str(tiny_checkpoint("qwen2")), model_impl="jax")
    P = jax.sharding.PartitionSpec
    layer = model.param_shardings["layers"]  # stacked: a leading layers axis, never split
    assert layer["q"] == P(None, None, "model", None) and layer["k"] == P(None, None, "model", None)
    assert layer["o"] == P(None, "model", None, None)
    assert layer["mlp"]["gate"] == P(None, None, "model") and layer["mlp"]["down"] == P(None, "model", None)
    assert layer["q_bias"] == P(None, "model", None) and layer["input_norm"] == P()
    assert model.param_shardings["embed"] == P("model", None)
    assert model.param_shardings["lm_head"] == P(None, "model")
    assert jax.tree.structure(model.params) == jax.tree.structure(
        model.param_shardings, is_leaf=lambda x: isinstance(x, P))


def _hf_layout(w, native: np.ndarray) -> dict[str, np.ndarray]:
    """The inverse of WeightSpec.to_native for a weight without repeated heads: its checkpoint tensors."""
    assert w.repeat is None
    per_layer = native if w.num_layers else [native]
    hf = [x.transpose(np.argsort(w.perm)) if w.perm else x for x in per_layer]
    return {name: np.ascontiguousarray(x.reshape(w.hf_shape)) for name, x in zip(w.hf_names, hf)}


@pytest.mark.slow
def test_random_params_from_the_weight_table_load_back_and_match_transformers(tmp_path):
    """init_params needs only a config; written as a checkpoint, the same weights load back
    unchanged and give transformers' logits (so init and load agree on every layout)."""
    import transformers
    from safetensors.numpy import save_file

    from models_jax.llama import ENTRY
    from models_jax.weights import init_params, is_weight_spec
    from runtime.ops.mesh import make_mesh

    config = transformers.Qwen3Config(  # head_dim 32 != hidden / heads: exercises every reshape
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.2,
        architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False,
    )
    args = ENTRY.config_from_hf(config)
    table = ENTRY.weight_table(args)
    params, specs = init_params(table, make_mesh(), np.float32, jax.random.key(7))
    assert jax.tree.structure(params) == jax.tree.structure(table, is_leaf=is_weight_spec)
    layer = params["layers"]
    assert layer["q"].shape == (2, 64, 4, 32) and specs["layers"]["q"] == jax.sharding.PartitionSpec(
        None, None, "model", None)  # [layers, hidden, heads, head_dim]
    np.testing.assert_array_equal(np.asarray(layer["input_norm"]), np.ones((2, 64), np.float32))  # norms: ones
    assert abs(float(np.asarray(layer["mlp"]["up"]).std()) - 0.2) < 0.02  # normal(initializer_range)

    out = tmp_path / "random-qwen3"
    config.save_pretrained(out)
    flat = jax.tree.leaves(table, is_leaf=is_weight_spec)
    tensors = {}
    for w, p in zip(flat, jax.tree.leaves(params)):
        tensors.update(_hf_layout(w, np.asarray(p)))
    save_file(tensors, str(out / "model.safetensors"))

    loaded = registry.load(str(out), model_impl="jax")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    prompt = PROMPTS[0]
    logits, _ = jax.jit(loaded.step_fn)(params, allocate_kv_cache(loaded.kv_spec, NUM_BLOCKS, BLOCK_SIZE),
                                        step_input([(prompt, 0)]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert np.abs(np.asarray(logits[0]) - hf_last_logits(hf, prompt)).max() < TOL


def _lowered_llama_step(num_layers: int) -> jax.stages.Lowered:
    """The native step of a random Llama of `num_layers` layers, lowered for one prefill bucket."""
    import transformers

    from models_jax.llama import ENTRY
    from models_jax.weights import init_params
    from runtime.ops.mesh import make_mesh
    from runtime.ops.step import KVCacheSpec

    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
    )
    args = ENTRY.config_from_hf(config)
    params, _ = init_params(ENTRY.weight_table(args), make_mesh(), np.float32, jax.random.key(0))
    cache = allocate_kv_cache(KVCacheSpec(num_layers, 2, 16, np.float32), NUM_BLOCKS, BLOCK_SIZE)
    step = jax.jit(functools.partial(ENTRY.forward, args=args), donate_argnums=1)
    return step.lower(params, cache, step_input([(PROMPTS[0], 0)]))


def test_layers_run_as_one_loop_whatever_the_depth():
    """2 and 8 layers lower to the same program (up to the sizes in its shapes); compiled, the
    8-layer step has one while loop over the layers, run 8 times."""
    shallow, deep = _lowered_llama_step(2), _lowered_llama_step(8)
    assert abs(len(deep.as_text()) - len(shallow.as_text())) < 0.01 * len(shallow.as_text())
    compiled = deep.compile().as_text()
    loops = [line for line in compiled.splitlines()
             if re.search(r"= .*\swhile\(", line) and 'op_name="jit(forward)/layers/while"' in line]
    assert len(loops) == 1 and '"known_trip_count":{"n":"8"}' in loops[0], loops


@pytest.mark.slow
def test_layers_with_different_sliding_windows_match_transformers(tmp_path):
    """Qwen2 with max_window_layers=1: layer 0 attends to everything, layer 1 through a window of 8.
    Both run in one scan (the window is a per-layer array); greedy decode crosses the window."""
    from registry.tiny import make_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    from models_jax.llama import layer_windows

    path = make_tiny_checkpoint("qwen2", tmp_path / "ckpt", use_sliding_window=True, sliding_window=8,
                                max_window_layers=1)
    model = registry.load(str(path), model_impl="jax")
    args = model.step_fn.keywords["args"]
    assert args.sliding_windows == (None, 8)
    static, per_layer = layer_windows(args)
    assert static is None and per_layer.tolist()[1] == 8 and per_layer.tolist()[0] > 10_000
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None
    tokens, _ = greedy(model, jax.jit(model.step_fn, donate_argnames="kv_cache"), PROMPTS, 16)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        np.testing.assert_array_equal(tokens[i], want.numpy(), err_msg=f"prompt {i}")
    # and the window matters: with it ignored, the last layer's logits change
    unwindowed = dataclasses.replace(model, step_fn=functools.partial(
        model.step_fn.func, args=dataclasses.replace(args, sliding_windows=(None, None))))
    cache = lambda: allocate_kv_cache(model.kv_spec, NUM_BLOCKS, BLOCK_SIZE)  # noqa: E731
    batch = step_input([(PROMPTS[0], 0)])
    windowed = np.asarray(jax.jit(model.step_fn)(model.params, cache(), batch)[0][0])
    full = np.asarray(jax.jit(unwindowed.step_fn)(model.params, cache(), batch)[0][0])
    assert np.abs(windowed - full).max() > 1e-3
    assert np.abs(windowed - hf_last_logits(hf, PROMPTS[0])).max() < TOL


@pytest.mark.parametrize("family", quick_loop_keeps(["llama", "llama-biases", "qwen2-windows", "qwen3"], "qwen2-windows"))
def test_layer_by_layer_step_equals_the_scan(tmp_path, family):
    """runtime.ops.layered runs the same LayerStages a few layers per call, with per-layer weight
    arrays, q/k/v and gate/up joined (biases too: qwen2, llama with attention and MLP biases;
    q/k norms: qwen3): logits and every
    layer's cache equal the one-program scan over the weights as loaded (prefill, then decode)."""
    from registry.tiny import make_tiny_checkpoint
    from runtime.ops.layered import LayeredStep
    from runtime.ops.mesh import make_mesh

    windows = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    kwargs = {"llama": {}, "llama-biases": dict(attention_bias=True, mlp_bias=True)}.get(family, windows)
    path = make_tiny_checkpoint(family.split("-")[0], tmp_path / "ckpt", **kwargs)
    scan_model, layered_model = registry.load(str(path)), registry.load(str(path))
    for model in (scan_model, layered_model):  # checkpoints start with zero biases: give them values
        rng = np.random.default_rng(0)
        is_bias = lambda keys: str(getattr(keys[-1], "key", "")).endswith("_bias")  # noqa: E731
        model.params = jax.tree_util.tree_map_with_path(
            lambda keys, x: x + rng.normal(0, 0.5, x.shape).astype(x.dtype) if is_bias(keys) else x, model.params)
    mesh = make_mesh()
    scan_step = jax.jit(scan_model.step_fn, donate_argnums=1)
    cache = lambda: allocate_kv_cache(scan_model.kv_spec, NUM_BLOCKS, BLOCK_SIZE)  # noqa: E731
    kv_sharding = jax.sharding.NamedSharding(mesh, layered_model.kv_partition_spec)
    layered = LayeredStep(layered_model, mesh, kv_sharding)
    assert isinstance(layered_model.params["layers"], list) and len(layered.layers) == scan_model.kv_spec.num_layers
    layer = layered.layers[0]
    assert "qkv" in layer and "q" not in layer and "gate_up" in layer["mlp"] and "gate" not in layer["mlp"]
    assert ("qkv_bias" in layer) == (family in ("qwen2-windows", "llama-biases"))
    assert ("gate_up_bias" in layer["mlp"]) == (family == "llama-biases") and ("q_norm" in layer) == (family == "qwen3")
    scan_cache, layered_cache = cache(), cache()
    prompt = PROMPTS[1]
    for batch in (step_input([(prompt, 0)]), step_input([(prompt + [7], len(prompt))])):
        want, scan_cache = scan_step(scan_model.params, scan_cache, batch)
        got, layered_cache = layered(layered_cache, batch)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    # joined matmuls sum in another order: float32 rounding apart, not more
    np.testing.assert_allclose(np.asarray(layered_cache.k), np.asarray(scan_cache.k), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(layered_cache.v), np.asarray(scan_cache.v), atol=1e-5, rtol=1e-5)
    # The model left behind computes the same whole, from its per-layer weights.
    whole, _ = jax.jit(layered_model.step_fn)(layered_model.params, cache(), step_input([(prompt, 0)]))
    first, _ = jax.jit(scan_model.step_fn)(scan_model.params, cache(), step_input([(prompt, 0)]))
    np.testing.assert_allclose(np.asarray(whole), np.asarray(first), atol=1e-5, rtol=1e-5)


def test_layers_load_as_a_list_of_the_stacks_slices(tiny_checkpoint):
    """registry.load(..., layered=True), the form the layered runtime takes: each
    layer's weights equal the stacked arrays' slices, their specs drop the layer axis, and
    the model's step_fn gives the scan's logits."""
    P = jax.sharding.PartitionSpec
    path = str(tiny_checkpoint("qwen2"))
    stacked, listed = registry.load(path), registry.load(path, layered=True)
    layers = listed.params["layers"]
    assert isinstance(layers, list) and len(layers) == stacked.kv_spec.num_layers
    for i, layer in enumerate(layers):
        jax.tree.map(lambda s, x, i=i: np.testing.assert_array_equal(np.asarray(s)[i], np.asarray(x)),
                     stacked.params["layers"], layer)
    spec = listed.param_shardings["layers"][0]
    assert spec["q"] == P(None, "model", None) and spec["mlp"]["down"] == P("model", None)
    assert {k: v for k, v in listed.params.items() if k != "layers"}.keys() == {
        k for k in stacked.params if k != "layers"}
    batch = step_input([(PROMPTS[1], 0)])
    cache = lambda: allocate_kv_cache(stacked.kv_spec, NUM_BLOCKS, BLOCK_SIZE)  # noqa: E731
    want, _ = jax.jit(stacked.step_fn)(stacked.params, cache(), batch)
    got, _ = jax.jit(listed.step_fn)(listed.params, cache(), batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_layers_per_call_divide_the_depth():
    from runtime.ops.layered import MAX_LAYERS_PER_CALL, layers_per_call

    assert MAX_LAYERS_PER_CALL == 6
    assert [layers_per_call(n) for n in (1, 2, 7, 8, 12, 28, 30, 32)] == [1, 2, 1, 4, 6, 4, 6, 4]


def test_layers_in_interleaved_stacks_equal_the_scan(tmp_path):
    """A model whose layers lie in two stacks that interleave (LayerStages.stacks: runs of 2, 1
    and 2 layers, stack "a" then "b" then "a" again, as Gemma 4's sliding and global layers would):
    LayeredStep runs each layer with its own weights and index, one program per (stack, layers
    per call) shared by the runs; the same logits and cache as the one-program scan."""
    from registry.tiny import make_tiny_checkpoint
    from runtime.ops.layered import LayeredStep
    from runtime.ops.mesh import make_mesh

    path = make_tiny_checkpoint("llama", tmp_path / "ckpt", num_hidden_layers=5)
    scan_model, model = registry.load(str(path)), registry.load(str(path))
    in_a, in_b = [0, 1, 3, 4], [2]
    stacked = model.params.pop("layers")
    specs = model.param_shardings.pop("layers")
    for key, rows in (("a", in_a), ("b", in_b)):
        model.params[key] = jax.tree.map(lambda w, rows=rows: w[np.asarray(rows)], stacked)
        model.param_shardings[key] = specs
    model.stages = dataclasses.replace(model.stages, stacks=(("a", 2), ("b", 1), ("a", 2)))
    assert model.stages.stack_sizes == {"a": 4, "b": 1}
    layered = LayeredStep(model, make_mesh(), jax.tree.map(
        lambda a: a.sharding, allocate_kv_cache(model.kv_spec, NUM_BLOCKS, BLOCK_SIZE)))
    assert [(c.key, c.start, c.per_call, int(c.first)) for c in layered.calls] == [
        ("a", 0, 2, 0), ("b", 0, 1, 2), ("a", 2, 2, 3)]
    assert len({id(c.program) for c in layered.calls}) == 2
    scan_step = jax.jit(scan_model.step_fn, donate_argnums=1)
    scan_cache = allocate_kv_cache(scan_model.kv_spec, NUM_BLOCKS, BLOCK_SIZE)
    layered_cache = allocate_kv_cache(model.kv_spec, NUM_BLOCKS, BLOCK_SIZE)
    prompts = PROMPTS[:2]
    for batch in (step_input([(p, 0) for p in prompts]), step_input([(p + [7], len(p)) for p in prompts])):
        want, scan_cache = scan_step(scan_model.params, scan_cache, batch)
        got, layered_cache = layered(layered_cache, batch)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(layered_cache.k), np.asarray(scan_cache.k), atol=1e-4, rtol=1e-4)
    assert len(layered.lower(layered_cache, batch)) == 4  # prologue, the two layer programs, epilogue


def test_layers_of_one_stack_in_different_forms_equal_the_scan(tmp_path):
    """A stack whose layers' weights differ in form (here layers 2, 4 and 5's MLP in bfloat16, as a
    GGUF file keeps some layers' ffn_down Q6_K and the others Q4_K): LayeredStep holds it as
    MixedLayers (a stack per form) and runs the pattern of forms in one program; the logits (prefill,
    then a one-token step: the whole-step program) and cache equal the scan over the same values."""
    from registry.tiny import make_tiny_checkpoint
    from runtime.ops.layered import LayeredStep
    from runtime.ops.mesh import make_mesh
    from runtime.ops.stacked import MixedLayers

    bf16 = lambda tree: jax.tree.map(lambda w: w.astype(jax.numpy.bfloat16), tree)  # noqa: E731
    path = make_tiny_checkpoint("llama", tmp_path / "ckpt", num_hidden_layers=6)
    scan_model, model = registry.load(str(path)), registry.load(str(path), layered=True)
    half = [2, 4, 5]
    for i in half:
        model.params["layers"][i]["mlp"] = bf16(model.params["layers"][i]["mlp"])
    rows = np.isin(np.arange(6), half)[:, None, None]
    scan_model.params["layers"]["mlp"] = jax.tree.map(
        lambda w: np.where(rows, np.asarray(w).astype(ml_dtypes.bfloat16).astype(w.dtype), w),
        scan_model.params["layers"]["mlp"])
    layered = LayeredStep(model, make_mesh(), jax.tree.map(
        lambda a: a.sharding, allocate_kv_cache(model.kv_spec, NUM_BLOCKS, BLOCK_SIZE)))
    layers = model.params["layers"]
    assert isinstance(layers, MixedLayers) and layers.where == ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (1, 2))
    assert [(c.start, c.per_call) for c in layered.calls] == [(0, 6)]  # one call, one program
    assert layers[4]["mlp"]["gate_up"].dtype == ml_dtypes.bfloat16 and layers[3]["mlp"]["gate_up"].dtype == np.float32
    scan_step = jax.jit(scan_model.step_fn, donate_argnums=1)
    scan_cache = allocate_kv_cache(scan_model.kv_spec, NUM_BLOCKS, BLOCK_SIZE)
    layered_cache = allocate_kv_cache(model.kv_spec, NUM_BLOCKS, BLOCK_SIZE)
    prompt = PROMPTS[0]
    for batch in (step_input([(prompt, 0)]), step_input([([7], len(prompt))])):
        want, scan_cache = scan_step(scan_model.params, scan_cache, batch)
        got, layered_cache = layered(layered_cache, batch)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(layered_cache.k), np.asarray(scan_cache.k), atol=1e-4, rtol=1e-4)
    # The model left behind computes the same as one program (as the whole-step program reads its layers)
    cache = lambda: allocate_kv_cache(model.kv_spec, NUM_BLOCKS, BLOCK_SIZE)  # noqa: E731
    whole, _ = jax.jit(model.step_fn)(model.params, cache(), step_input([(prompt, 0)]))
    first, _ = jax.jit(scan_model.step_fn)(scan_model.params, cache(), step_input([(prompt, 0)]))
    np.testing.assert_allclose(np.asarray(whole), np.asarray(first), atol=1e-4, rtol=1e-4)


def test_mixed_layers_take_fewer_per_call_where_their_patterns_would_compile_more():
    """MixedLayers.per_call: the most layers per call (dividing the uniform count) whose distinct
    patterns of forms trace no more layers than one program per form would: a Q4_K_M-like
    pattern of 30 layers (forms by llama.cpp's use_more_bits) runs 3 a call (2 patterns), not 6
    (3 patterns of 6); 16 layers 2 a call; a stack of one form in each half keeps 4."""
    from runtime.ops.stacked import MixedLayers

    def mixed(forms):
        taken = [0, 0]
        where = []
        for f in forms:
            where.append((f, taken[f]))
            taken[f] += 1
        return MixedLayers(([], []), tuple(where))

    more_bits = lambda i, n: int(i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2)  # noqa: E731
    demo, one_b = mixed([more_bits(i, 30) for i in range(30)]), mixed([more_bits(i, 16) for i in range(16)])
    assert demo.per_call(0, 30, 6) == 3 and len({demo.pattern(i, 3) for i in range(0, 30, 3)}) == 2
    assert one_b.per_call(0, 16, 4) == 2
    assert mixed([0] * 8 + [1] * 8).per_call(0, 16, 4) == 4


def test_layers_in_several_calls_with_wide_sequences_equal_the_scan(tmp_path):
    """8 layers, 4 per call (two calls of the layer program), attention in the C++ kernel with the
    prologue and layers taking the batch widened to 8 sequence slots: the same logits and cache
    as the one-program scan; and the bucket's shared programs are lowered once."""
    from registry.tiny import make_tiny_checkpoint
    from runtime.ops.cpu_kernels import kernel_status
    from runtime.ops.layered import LayeredStep, widen_seqs
    from runtime.ops.mesh import make_mesh

    assert kernel_status("paged_attention") == "ok", kernel_status("paged_attention")
    path = make_tiny_checkpoint("llama", tmp_path / "ckpt", num_hidden_layers=8)
    scan_model, layered_model = registry.load(str(path)), registry.load(str(path))
    mesh = make_mesh()
    cache = lambda backend: allocate_kv_cache(scan_model.kv_spec, NUM_BLOCKS, BLOCK_SIZE,  # noqa: E731
                                              attention_backend=backend)
    layered_cache = cache("cpu")
    layered = LayeredStep(layered_model, mesh, jax.tree.map(lambda a: a.sharding, layered_cache), wide_seqs=8)
    assert layered.per_call == 4 and len(layered.layers) == 8
    scan_step = jax.jit(scan_model.step_fn, donate_argnums=1)
    scan_cache = cache("xla")
    prompts = PROMPTS[:2]
    first = step_input([(p, 0) for p in prompts])
    wide = widen_seqs(first, 8)
    assert wide.block_tables.shape[0] == wide.seq_lens.shape[0] == wide.logits_indices.shape[0] == 8
    assert wide.query_start_loc.tolist() == first.query_start_loc.tolist() + [first.query_start_loc[-1]] * (8 - S_PAD)
    for batch in (first, step_input([(p + [7], len(p)) for p in prompts])):
        want, scan_cache = scan_step(scan_model.params, scan_cache, batch)
        got, layered_cache = layered(layered_cache, batch)
        assert got.shape == want.shape
        # 8 layers of two attention implementations and joined (on AVX-512, packed) matmuls:
        # float32 rounding apart (measured up to 1.3e-5 on an Intel Xeon with AVX-512)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(layered_cache.k), np.asarray(scan_cache.k), atol=1e-4, rtol=1e-4)
    seen: set = set()
    assert len(layered.lower(layered_cache, first, seen)) == 3
    narrower = step_input([(prompts[0], 0)])
    assert len(layered.lower(layered_cache, narrower, seen)) == 1  # the same bucket: its epilogue only
    assert len(layered.lower(layered_cache, dataclasses.replace(
        narrower, **{f: getattr(narrower, f)[:1] for f in ("block_tables", "seq_lens", "logits_indices")},
        query_start_loc=narrower.query_start_loc[:2]), seen)) == 1  # another sequence bucket, same wide shapes
