"""The torchax fallback serves Hugging Face causal LMs through the step contract.

Each architecture is a tiny random checkpoint (registry.tiny). Our side runs the jitted
step function with a paged KV cache of 4-token blocks taken in shuffled order, so every
sequence spans several non-contiguous blocks; the reference is transformers' eager model.
Every step uses one padded shape (16 tokens, 2 sequences), so each model compiles once.
"""

from __future__ import annotations

import dataclasses

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from registry.tiny import make_tiny_checkpoint, make_tokenizer
from registry.torchax_model import load_torchax
from registry.errors import ModelLoadError
from conftest import PagedRunner, hf_greedy, hf_logits
from runtime.ops.step import allocate_kv_cache, make_step_input

# conftest.PagedRunner's default shape: 4-token blocks (48 of them, 16 per sequence = 64
# tokens), every step padded to 16 tokens and 2 sequences.
PROMPT_LEN = 11
NEW_TOKENS = 32
# Max |ours - transformers| on float32 logits (measured: a few 1e-6 on these models).
LOGITS_ATOL = 1e-4

# name -> (tiny checkpoint name, config overrides), or (transformers config class, kwargs)
# for architectures registry.tiny does not make. "mistral_sw" has a sliding window shorter
# than the context; "gemma2" adds attention and final logit soft-capping and alternates
# sliding and global layers.
ARCHITECTURES = {
    "gpt2": ("gpt2", {}),
    "gpt_neox": ("gpt_neox", {}),
    "opt": ("opt", {}),
    "phi": ("phi", {}),
    "phi3": ("phi3", {}),
    "gemma": ("gemma", {}),
    "stablelm": ("stablelm", {}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "mistral_sw": ("mistral", {"sliding_window": 6}),
    "gemma2": ("Gemma2Config", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=6,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, query_pre_attn_scalar=16,
        initializer_range=0.2, bos_token_id=0, eos_token_id=0, pad_token_id=3,
    )),
    # GPT-J: partial rotary (rotary_dim < head_dim), parallel attention and MLP; it routes
    # through the AttentionInterface since transformers 5.24.
    "gptj": ("GPTJConfig", dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=512, n_positions=1024,
                                bos_token_id=0, eos_token_id=0)),
}
QUICK = "gpt2"  # the one architecture of the quick loop (pytest -m "not slow")


def resolved_for(path: Path, **extra) -> types.SimpleNamespace:
    """A ResolvedModel-like object: the only attributes load_torchax reads."""
    config = transformers.AutoConfig.from_pretrained(path)
    return types.SimpleNamespace(
        model_id=str(path), path=path, hf_config=config, architecture=config.architectures[0], **extra
    )



def make_prompt(seed: int = 0, length: int = PROMPT_LEN) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(4, 500, size=length)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchax_ckpt")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            base, overrides = ARCHITECTURES.get(name, (name, {}))
            if base.endswith("Config"):
                made[name] = _save_random_model(getattr(transformers, base)(**overrides), root / name)
            else:
                made[name] = make_tiny_checkpoint(base, root / name, **overrides)
        return made[name]

    return get


def joined(loaded):
    """The model with each decoder layer's Linear weights joined by input and stored [in, out]
    (LayerStages.fuse), as runtime/ops/layered.py serves it on one device."""
    if loaded.stages is None or loaded.stages.fuse is None:
        return loaded
    layers = [loaded.stages.fuse(p) for p in loaded.params["layers"]]
    return dataclasses.replace(loaded, params={**loaded.params, "layers": layers})


@pytest.fixture(scope="module")
def served(checkpoints):
    """name -> (LoadedModel, jitted step, transformers eager model), loaded and jitted once;
    the layers' weights joined as serving joins them (`joined`)."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            path = checkpoints(name)
            loaded = joined(load_torchax(resolved_for(path)))
            step = jax.jit(loaded.step_fn, donate_argnums=1)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            ).eval()
            cache[name] = (loaded, step, hf)
        return cache[name]

    return get


@pytest.mark.parametrize("name", [n if n == QUICK else pytest.param(n, marks=pytest.mark.slow) for n in ARCHITECTURES])
def test_fallback_prefill_logits_match_transformers(served, name):
    loaded, step, hf = served(name)
    assert loaded.impl == "torchax"
    prompt = make_prompt(1)
    ours = PagedRunner(loaded, step).run([(0, 0, prompt)])[0]
    ref = hf_logits(hf, prompt)[-1]
    np.testing.assert_allclose(ours, ref, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_fallback_matches_transformers_greedy(served, name):
    loaded, step, hf = served(name)
    prompt = make_prompt(2)
    # min_new_tokens keeps transformers from stopping at EOS; our loop never picks EOS either.
    ref = hf_greedy(hf, prompt, NEW_TOKENS)
    ours, logits = PagedRunner(loaded, step, seed=3).greedy(prompt, NEW_TOKENS)
    assert ours == ref
    # Every decode step through the paged cache matches a full forward over the sequence.
    full = hf_logits(hf, prompt + ours)[len(prompt) - 1: -1]
    np.testing.assert_allclose(logits, full, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.slow
def test_mixed_prefill_and_decode_batch_matches_each_alone(served):
    loaded, step, _ = served("mistral_sw")
    first, second = make_prompt(3, 9), make_prompt(4, 7)

    alone = PagedRunner(loaded, step, seed=5)
    alone.run([(0, 0, first)])
    decode_alone = alone.run([(0, len(first), [42])])[0]
    prefill_alone = alone.run([(1, 0, second)])[0]

    mixed = PagedRunner(loaded, step, seed=6)
    mixed.run([(0, 0, first)])
    decode_mixed, prefill_mixed = mixed.run([(0, len(first), [42]), (1, 0, second)])
    np.testing.assert_allclose(decode_mixed, decode_alone, atol=1e-5, rtol=0)
    np.testing.assert_allclose(prefill_mixed, prefill_alone, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kv_repeat", [2, 4])
def test_repeated_kv_heads_attend_like_grouped_query_attention(kv_repeat):
    """Each KV head stored kv_repeat times (as under tensor parallelism) changes no output.

    8 query heads on 2 KV heads: query head h must still read a copy of KV head h // 4.
    """
    from registry.torchax_attention import StepContext, paged_attention_interface, step_context
    from registry.torchax_compat import import_torchax

    import_torchax()
    from torchax.interop import jax_view, torch_view

    from runtime.ops.step import KVCacheSpec

    num_tokens, heads, kv_heads, head_dim = 5, 8, 2, 16
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (  # [1, heads, T, head_dim], as transformers passes them
        jax.random.normal(key, (1, n, num_tokens, head_dim)) for key, n in zip(keys, (heads, kv_heads, kv_heads))
    )
    batch = make_step_input(
        input_ids=np.zeros(num_tokens), positions=np.arange(num_tokens), slot_mapping=np.arange(num_tokens),
        block_tables=np.arange(2)[None], seq_lens=np.array([num_tokens]), query_start_loc=np.array([0, num_tokens]),
        logits_indices=np.array([num_tokens - 1]), num_seqs=1, num_tokens=num_tokens,
    )
    layer = types.SimpleNamespace(layer_idx=0)

    def attend(repeat: int) -> tuple[np.ndarray, np.ndarray]:
        spec = KVCacheSpec(num_layers=1, num_kv_heads=kv_heads * repeat, head_dim=head_dim, dtype=jnp.float32)
        ctx = StepContext(batch, allocate_kv_cache(spec, 4, 4), kv_repeat=repeat)
        with step_context(ctx):
            out, _ = paged_attention_interface(layer, *(torch_view(x) for x in (q, k, v)), None)
        return np.asarray(jax_view(out)), np.asarray(ctx.collect().k[0])  # layer 0's K [blocks, kv, bs, D]

    out, _ = attend(1)
    out_repeated, k_cache = attend(kv_repeat)
    np.testing.assert_allclose(out_repeated, out, rtol=1e-6, atol=1e-6)
    # cache head j holds KV head j // kv_repeat: a head's copies are adjacent
    stored = k_cache.swapaxes(1, 2).reshape(-1, kv_heads * kv_repeat, head_dim)[:num_tokens]  # [T, kv * r, D]
    expected = np.repeat(np.asarray(k)[0].swapaxes(0, 1), kv_repeat, axis=1)
    np.testing.assert_array_equal(stored, expected)


@pytest.mark.parametrize("num_tokens", [1, 4])  # N*k below / above the number of experts
def test_static_moe_experts_match_transformers_eager(num_tokens):
    from registry.torchax_attention import static_experts_forward
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = MixtralExperts(config)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x = torch.randn(num_tokens, 16)
    top_k_index = torch.stack([torch.randperm(4)[:2] for _ in range(num_tokens)])
    top_k_weights = torch.rand(num_tokens, 2)
    with torch.no_grad():
        torch.testing.assert_close(
            static_experts_forward(experts, x, top_k_index, top_k_weights),
            experts(x, top_k_index, top_k_weights), atol=1e-4, rtol=1e-5,
        )


@pytest.mark.slow
def test_weights_are_read_from_the_checkpoint_by_slice_not_loaded_whole(checkpoints):
    """A checkpoint whose tensors are the model's own (by name and shape, tied ones under one
    name) is never loaded whole: the transformers model is built with parameters on the meta
    device and each parameter's source is a memory-mapped view of the file, read per device
    slice (what a process of a multi-process engine relies on)."""
    from registry.torchax_attention import ATTN_IMPLEMENTATION, register_implementations
    from registry.torchax_model import _build_model, _model_class

    register_implementations()
    resolved = resolved_for(checkpoints("phi"))
    model, sources = _build_model(resolved, _model_class(resolved, False),
                                  dict(dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION))
    names = [n for n, _ in model.named_parameters()]
    assert names and all(p.device.type == "meta" for p in model.parameters())
    assert set(names) <= set(sources) and all(isinstance(sources[n], np.memmap) for n in names)
    assert all(b.device.type == "cpu" for b in model.buffers())  # computed buffers stay real


def test_decoder_layer_linears_are_joined_by_input(checkpoints):
    """Linear layers reading one input are joined (q/k/v, gate/up), each stored [in, out]; biases
    joined alike (Qwen2's q/k/v); joining again changes nothing."""
    loaded = load_torchax(resolved_for(checkpoints("qwen2")))
    groups = {g.members: g for g in loaded.stages.fuse.__self__.groups}
    assert set(groups) == {("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                           ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)}
    layer = loaded.params["layers"][1]
    fused = loaded.stages.fuse(layer)
    qkv = groups[("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")]
    names = [f"self_attn.{n}_proj" for n in "qkv"]
    np.testing.assert_array_equal(fused[qkv.weight_key],
                                  np.concatenate([np.asarray(layer[n + ".weight"]) for n in names]).T)
    np.testing.assert_array_equal(fused[qkv.bias_key], np.concatenate([np.asarray(layer[n + ".bias"]) for n in names]))
    assert not any(n + ".weight" in fused for n in names) and "input_layernorm.weight" in fused
    assert jax.tree.structure(loaded.stages.fuse(fused)) == jax.tree.structure(fused)
    prompt = make_prompt(9)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints("qwen2"), dtype=torch.float32).eval()
    served = joined(loaded)
    ours = PagedRunner(served, jax.jit(served.step_fn)).run([(0, 0, prompt)])[0]
    np.testing.assert_allclose(ours, hf_logits(hf, prompt)[-1], atol=LOGITS_ATOL, rtol=0)


def test_loaded_model_fields(served):
    loaded, _, hf = served("mixtral")
    config = hf.config
    assert loaded.kv_spec.num_layers == config.num_hidden_layers
    assert loaded.kv_spec.num_kv_heads == config.num_key_value_heads
    assert loaded.kv_spec.head_dim == config.hidden_size // config.num_attention_heads
    assert loaded.kv_spec.dtype == jnp.float32
    assert loaded.max_model_len == config.max_position_embeddings
    assert loaded.vocab_size == config.vocab_size
    assert loaded.eos_token_ids == (config.eos_token_id,)
    assert loaded.tokenizer is not None and loaded.tokenizer.eos_token == "<|endoftext|>"
    assert set(loaded.param_shardings) == set(loaded.params)
    # Uniform decoder layers: stepped a few per call (registry.torchax_layers), their weights
    # per layer under "layers" by their names within the layer.
    assert loaded.stages is not None and loaded.stages.num_layers == config.num_hidden_layers
    layers = loaded.params["layers"]
    assert len(layers) == config.num_hidden_layers and set(layers[0]) == set(layers[-1])
    assert not any(name.startswith("model.layers.") for name in loaded.params)
    # specs follow the rules on any mesh; on one device they split nothing
    assert loaded.param_shardings["layers"][0]["self_attn.q_proj.weight"] == jax.sharding.PartitionSpec("model", None)
    assert loaded.param_shardings["model.norm.weight"] == jax.sharding.PartitionSpec()
    assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(loaded.params))
    assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(loaded.params))


@pytest.mark.slow
def test_bfloat16_weights_and_cache(checkpoints):
    path = checkpoints("llama")
    loaded = load_torchax(resolved_for(path), dtype=jnp.bfloat16)
    assert loaded.kv_spec.dtype == jnp.bfloat16
    # transformers keeps the rotary inverse frequencies in float32 on purpose.
    named = jax.tree_util.tree_flatten_with_path(loaded.params)[0]
    assert all(a.dtype == jnp.bfloat16 for path, a in named if "rotary" not in jax.tree_util.keystr(path))
    runner = PagedRunner(loaded, jax.jit(loaded.step_fn, donate_argnums=1))
    prompt = make_prompt(7)
    ours = runner.run([(0, 0, prompt)])[0]
    # kept as its bits on CPU (XLA:CPU moves 16-bit integers in place), bfloat16 elsewhere
    cache = runner.cache
    assert (cache.k.dtype, cache.v.dtype, cache.half_bits) in [(jnp.uint16, jnp.uint16, "bfloat16"),
                                                                (jnp.bfloat16, jnp.bfloat16, None)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = hf_logits(hf, prompt)[-1]
    # bfloat16 keeps ~3 significant digits; compare against the float32 model.
    assert np.abs(ours - ref).max() <= 0.05 * np.abs(ref).max()
    assert int(np.argmax(ours)) == int(np.argmax(ref))


@pytest.mark.slow
def test_torchax_and_native_llama_agree(checkpoints):
    """Guards both paths: a native path that cannot load Llama fails here, it does not skip."""
    import registry

    path = checkpoints("llama")
    native = registry.load(str(path), model_impl="jax")
    assert native.impl == "jax"
    fallback = load_torchax(resolved_for(path))
    prompt = make_prompt(8)
    ours = PagedRunner(fallback, jax.jit(fallback.step_fn)).greedy(prompt, 4)
    theirs = PagedRunner(native, jax.jit(native.step_fn)).greedy(prompt, 4)
    assert ours[0] == theirs[0]
    np.testing.assert_allclose(ours[1], theirs[1], atol=1e-4, rtol=0)


def _save_random_model(config, path: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("config_class, kwargs", [
    ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)),
    ("BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=512)),
])
def test_architecture_without_attention_interface_fails_readably(tmp_path, config_class, kwargs):
    path = _save_random_model(getattr(transformers, config_class)(**kwargs), tmp_path / config_class)
    resolved = resolved_for(path)
    with pytest.raises(ModelLoadError, match=f"{resolved.architecture} cannot be served.*AttentionInterface"):
        load_torchax(resolved)


def test_model_without_causal_lm_head_fails_readably(tmp_path):
    config = transformers.T5Config(d_model=64, num_layers=1, num_heads=4, d_ff=128, d_kv=16, vocab_size=512)
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="no causal-LM head"):
        load_torchax(resolved_for(tmp_path))


def test_custom_code_is_refused_without_trust_remote_code(checkpoints):
    resolved = resolved_for(checkpoints("llama"))
    resolved.hf_config.auto_map = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    with pytest.raises(ModelLoadError, match="custom code"):
        load_torchax(resolved)


_SHARDED_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import jax, numpy as np
    sys.path[:0] = [{root!r}, {tests!r}]
    from test_torchax import PagedRunner, make_prompt, resolved_for
    from registry.torchax_model import load_torchax
    from runtime.ops.mesh import make_mesh
    out = {{}}
    for path in sys.argv[1:]:
        logits = []
        for size in (1, 2):
            mesh = make_mesh(size, devices=jax.devices()[:size])
            loaded = load_torchax(resolved_for(Path(path)), mesh=mesh)
            cache_sharding = jax.sharding.NamedSharding(mesh, loaded.kv_partition_spec)
            runner = PagedRunner(loaded, jax.jit(loaded.step_fn, donate_argnums=1))
            runner.cache = jax.device_put(runner.cache, cache_sharding)
            logits.append(runner.greedy(make_prompt(9), 6)[1])
        specs = {{n: s for n, s in loaded.param_shardings.items() if n != "layers"}}
        for i, layer in enumerate(loaded.param_shardings.get("layers", [])):  # stepped per layer
            specs.update({{f"layers.{{i}}.{{r}}": s for r, s in layer.items()}})
        split = sorted({{n for n, s in specs.items() if "model" in tuple(s)}})
        out[path] = dict(diff=float(np.abs(logits[0] - logits[1]).max()), split=split,
                         kv=str(loaded.kv_partition_spec))
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_tensor_parallel_rules_shard_weights_and_keep_logits(checkpoints, tmp_path):
    paths = [str(checkpoints(name)) for name in ("gpt2", "mixtral")]
    script = tmp_path / "sharded.py"
    root = str(Path(__file__).resolve().parents[1])
    script.write_text(_SHARDED_SCRIPT.format(root=root, tests=str(Path(__file__).parent)))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script), *paths], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    gpt2, mixtral = result[paths[0]], result[paths[1]]
    assert {"layers.0.attn.c_proj.weight", "transformer.wte.weight", "layers.0.mlp.c_fc.bias"} <= set(gpt2["split"])
    # c_attn is [in, q | k | v]: a column split would cut blocks, not heads, so it stays whole
    assert not {"layers.0.attn.c_attn.weight", "layers.0.attn.c_attn.bias"} & set(gpt2["split"])
    assert {"layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj",
            "layers.0.self_attn.o_proj.weight", "lm_head.weight"} <= set(mixtral["split"])
    assert mixtral["kv"] == str(jax.sharding.PartitionSpec(None, None, "model", None, None))
    assert gpt2["diff"] < 1e-4 and mixtral["diff"] < 1e-4
