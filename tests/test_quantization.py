"""int8 weight quantization (runtime/ops/quantization.py) on both model paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from app import LLM, SamplingParams
from conftest import REPO, quick_loop_keeps
from runtime.ops.quantization import QuantizedWeight, param_bytes, quantize_int8
from runtime.ops.stacked import StackedLayers

PROMPT = [(7 * i + 3) % 500 + 4 for i in range(24)]
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, show_progress=False,
              compilation_cache_dir="")


def test_quantizer_is_symmetric_per_output_channel_and_bounded():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 4, 8)) * np.linspace(0.1, 3, 32).reshape(1, 4, 8), jnp.float32)
    qw = quantize_int8(w, (0,))
    assert qw.q.dtype == jnp.int8 and qw.scale.shape == (1, 4, 8)
    assert int(jnp.max(jnp.abs(qw.q))) == 127  # each channel's largest weight maps to +-127
    err = np.abs(np.asarray(qw.dequantize()) - np.asarray(w))
    assert np.all(err <= np.asarray(qw.scale) / 2 + 1e-7)  # round-to-nearest: half a step at most
    zero = quantize_int8(jnp.zeros((3, 2)), (0,))
    assert np.all(np.asarray(zero.dequantize()) == 0)


def _run(model: str, quantization: str | None, **extra):
    llm = LLM(model=model, quantization=quantization, **ENGINE, **extra)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16,
                                                                    prompt_logprobs=0), use_tqdm=False)[0]
    logprobs = np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
    return llm, out.outputs[0].token_ids, logprobs


@pytest.mark.parametrize("model", quick_loop_keeps(["servax-tiny/llama", "servax-tiny/gpt2"], "servax-tiny/llama",
                                                   ids=["native", "torchax"]))
def test_int8_weights_are_a_quarter_of_the_bytes_and_logits_stay_close(model):
    llm_f, tokens_f, lp_f = _run(model, None, enforce_eager=True)
    warm = model.endswith("llama")  # one int8 engine precompiles its buckets, to check nothing compiles later
    llm_q, tokens_q, lp_q = _run(model, "int8", enforce_eager=not warm)
    ratio = param_bytes(llm_q.engine.model.params) / param_bytes(llm_f.engine.model.params)
    assert ratio <= 0.3, ratio
    leaves = [x for x in _leaves(llm_q.engine.model.params) if isinstance(x, QuantizedWeight)]
    assert leaves and all(x.q.dtype == jnp.int8 for x in leaves)
    diff = np.abs(lp_q - lp_f)
    assert diff.max() < 0.25 and diff.mean() < 0.08, (diff.max(), diff.mean())
    assert len(tokens_q) == 16
    if warm:
        assert llm_q.engine.stats().compilations_since_warmup == 0


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))


_TP = """
import json, sys
from app import LLM, SamplingParams
prompt, models = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {}
for model, quantization, label in models:
    for tp in (1, 2):
        llm = LLM(model=model, quantization=quantization, tensor_parallel_size=tp, max_model_len=128,
                  max_num_seqs=4, max_num_batched_tokens=64, show_progress=False, compilation_cache_dir="",
                  enforce_eager=True, int8_activations=False)  # tp 2's split weights multiply float activations
        o = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16),
                         use_tqdm=False)[0]
        layer = llm.engine.model.params["layers"][0]
        q = layer["q"] if "q" in layer else layer["qkv"]  # joined where the weights are whole (tp 1)
        gate_up = layer["mlp"].get("gate_up")
        out[f"{label} tp{tp}"] = {"tokens": o.outputs[0].token_ids, "joined": "qkv" in layer,
                                        "q": str((q.panels if hasattr(q, "panels") else q.q).sharding.spec),
                                        "scale": str((q.scales if hasattr(q, "scales") else q.scale).sharding.spec),
                                        "gate_up": f"{type(gate_up).__name__}:{getattr(gate_up, 'format', '')}",
                                        "layers": type(llm.engine.model.params["layers"]).__name__}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_int8_under_tensor_parallelism_gives_the_same_tokens(tiny_checkpoint, tmp_path):
    """Per-channel int8, GGUF's Q8_0 kept as int8 (scales per 32 inputs) and Q6_K kept as 6-bit values
    (scales per 16 inputs; a 256-wide Llama, as Q6_K's super-blocks need), each at tp=1 and tp=2; and
    the Q6_K file with layer 0's ffn_down Q4_1 (each layer in its own kind: the layers in two forms)."""
    import gguf
    from safetensors.numpy import load_file

    from registry.tiny import make_tiny_checkpoint
    from test_gguf import write_gguf

    gguf_file = write_gguf(tiny_checkpoint("llama"), tmp_path / "tiny-Q8_0.gguf", weight_type="Q8_0")
    wide = make_tiny_checkpoint("llama", tmp_path / "wide", hidden_size=256, intermediate_size=512,
                                initializer_range=0.1)
    q6_k = write_gguf(wide, tmp_path / "wide-Q6_K.gguf", weight_type="Q6_K")
    down = load_file(wide / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    mixed = write_gguf(wide, tmp_path / "wide-Q6_K-mixed.gguf", weight_type="Q6_K", raw_tensors={  # as Q4_K_M's
        "blk.0.ffn_down.weight": (gguf.quants.quantize(down, gguf.GGMLQuantizationType.Q4_1),
                                  gguf.GGMLQuantizationType.Q4_1)})
    models = [("servax-tiny/llama", "int8", "int8"), (str(gguf_file), "gguf", "Q8_0"), (str(q6_k), "gguf", "Q6_K"),
              (str(mixed), "gguf", "mixed")]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _TP, json.dumps(PROMPT), json.dumps(models)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for quantization in ("int8", "Q8_0", "Q6_K", "mixed"):  # (6-bit values multiply float activations as int8 ones)
        # tp 1 serves q/k/v and gate/up joined and packed for the CPU kernel (still int8), tp 2 split
        # by heads: the same tokens
        assert out[f"{quantization} tp1"]["joined"] and out[f"{quantization} tp1"]["gate_up"] == "PackedWeight:int8"
        assert not out[f"{quantization} tp2"]["joined"]
        assert out[f"{quantization} tp1"]["tokens"] == out[f"{quantization} tp2"]["tokens"], quantization
        # split by heads, as the float weight
        assert "model" in out[f"{quantization} tp2"]["q"] and "model" in out[f"{quantization} tp2"]["scale"]
    assert out["mixed tp1"]["layers"] == out["mixed tp2"]["layers"] == "MixedLayers"


# ---- mixture-of-experts weights -------------------------------------------------------------

MOE_PROMPTS = [[(7 * i + 3 * n) % 500 + 4 for i in range(n)] for n in (5, 9, 12, 17, 24, 31, 40, 50)]


def test_grouped_matmul_takes_int8_experts():
    """models_jax.moe.grouped_matmul on a QuantizedWeight computes what the dequantized experts give."""
    from models_jax.moe import grouped_matmul

    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((4, 32, 16)), jnp.float32)  # [experts, in, out]
    x = jnp.asarray(rng.standard_normal((10, 32)), jnp.float32)
    sizes = jnp.array([3, 0, 5, 1], jnp.int32)  # 9 rows routed, the last row past the groups
    qw = quantize_int8(w, (1,))
    got = np.asarray(grouped_matmul(x, qw, sizes))
    np.testing.assert_array_equal(got, np.asarray(grouped_matmul(x, qw.dequantize(), sizes)))
    want = np.asarray(grouped_matmul(x, w, sizes))
    assert np.linalg.norm(got - want) < 0.01 * np.linalg.norm(want)  # int8 rounding only
    assert np.all(got[9] == 0)


@pytest.mark.slow
def test_int8_moe_experts_are_quantized_per_expert_and_output_and_tokens_stay_close():
    """quantization="int8" on Qwen3-MoE: every expert matrix int8 with one scale per expert and
    output channel (the router float); the first greedy token of each prompt is float's (where
    float's top two are not a near-tie that rounding may flip), and fed float's own greedy
    continuation (teacher forcing), int8's top-1 agrees at >= 90% of positions."""
    import jax

    sampling = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in MOE_PROMPTS]
    float_llm = LLM(model="servax-tiny/qwen3_moe", **ENGINE, enforce_eager=True)
    float_outs = [o.outputs[0] for o in float_llm.generate(prompts, sampling, use_tqdm=False)]
    float_out = [o.token_ids for o in float_outs]
    llm = LLM(model="servax-tiny/qwen3_moe", quantization="int8", **ENGINE, enforce_eager=True)

    layers = llm.engine.model.params["layers"]
    layer = layers[0] if isinstance(layers, (list, StackedLayers)) else jax.tree.map(lambda x: x[0], layers)
    experts = layer["mlp"]["experts"]
    for name in ("gate", "up", "down"):
        w = experts[name]  # [experts, in, out]
        assert isinstance(w, QuantizedWeight) and w.q.dtype == jnp.int8, name
        assert w.scale.shape == (w.q.shape[0], 1, w.q.shape[2]), (name, w.scale.shape)
    assert not isinstance(layer["mlp"]["router"], QuantizedWeight)
    assert param_bytes(llm.engine.model.params) / param_bytes(float_llm.engine.model.params) <= 0.3

    outs = [o.outputs[0] for o in llm.generate(prompts, sampling, use_tqdm=False)]
    margins = [np.diff(sorted(x.logprob for x in o.logprobs[0].values()))[-1] for o in float_outs]
    clear = [i for i, margin in enumerate(margins) if margin > 0.25]
    assert len(clear) >= len(prompts) // 2, clear  # most prompts have a clear first token
    assert [outs[i].token_ids[0] for i in clear] == [float_out[i][0] for i in clear]
    for o, f in zip(outs, float_outs):  # and the first token's logprob is close everywhere
        assert abs(o.logprobs[0][f.token_ids[0]].logprob - f.logprobs[0][f.token_ids[0]].logprob) < 0.2
    forced = llm.generate([{"prompt_token_ids": p + t} for p, t in zip(MOE_PROMPTS, float_out)],
                          SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ranks = [out.prompt_logprobs[i][token].rank
             for out, p, t in zip(forced, MOE_PROMPTS, float_out)
             for i, token in enumerate(t, start=len(p))]
    agreement = np.mean([r == 1 for r in ranks])
    assert agreement >= 0.9, agreement


_MOE_PARALLEL = """
import json, sys
from app import LLM, SamplingParams
prompt, models = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {}
for model, quantization in models:
    for tp, ep in ((1, False), (2, False), (2, True)):
        llm = LLM(model=model, quantization=quantization, tensor_parallel_size=tp, enable_expert_parallel=ep,
                  max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, show_progress=False,
                  compilation_cache_dir="", enforce_eager=True)
        o = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12),
                         use_tqdm=False)[0]
        out.setdefault(quantization, []).append(o.outputs[0].token_ids)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_int8_and_q8_0_experts_give_the_same_tokens_under_tensor_and_expert_parallelism(tiny_checkpoint, tmp_path):
    """int8 Qwen3-MoE and a Q8_0 Qwen2-MoE GGUF (quantization=gguf): one device, the experts' features
    split over 2 devices, and whole experts per device (enable_expert_parallel) give the same tokens."""
    from test_gguf_moe import write_moe_gguf

    gguf_file = write_moe_gguf(tiny_checkpoint("qwen2_moe"), tmp_path / "qwen2_moe-Q8_0.gguf", weight_type="Q8_0")
    models = [("servax-tiny/qwen3_moe", "int8"), (str(gguf_file), "gguf")]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _MOE_PARALLEL, json.dumps(PROMPT), json.dumps(models)], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for quantization, runs in out.items():
        assert runs[0] == runs[1] == runs[2], quantization


def test_unknown_quantization_is_refused():
    from runtime.engine.config import EngineConfig

    with pytest.raises(ValueError, match="supported: int8"):
        EngineConfig(model="servax-tiny/llama", quantization="awq")


# ---- quantized KV cache (kv_cache_dtype) ------------------------------------------------------

def _attend_over_a_quantized_cache(kv_dtype: str, backend: str):
    """paged_attention of a mixed batch (prefills, chunks and decodes, GQA, a window) over an int8 /
    fp8 cache whose every slot earlier steps wrote, quantized, this step rewriting its own tokens'
    slots: (the first n rows of its output, the cache after it, the float oracle over the K/V
    as computed, the float oracle over what the cache holds), n the real tokens."""
    import jax

    from runtime.ops.attention import paged_attention
    from runtime.ops.attention_common import as_stored, write_kv_quantized
    from runtime.ops.step import KVCache
    from test_attention import MIXED, build_batch, oracle

    rng = np.random.default_rng(4)
    kv_heads, block_size, head_dim, num_blocks = 2, 4, 8, 96
    batch, seqs, n = build_batch(rng, MIXED, block_size=block_size, num_blocks=num_blocks, max_blocks=24,
                                 pad_tokens=128, pad_seqs=8)
    k_full = rng.standard_normal((num_blocks, kv_heads, block_size, head_dim)).astype(np.float32)
    v_full = rng.standard_normal(k_full.shape).astype(np.float32)
    q = rng.standard_normal((128, 8, head_dim)).astype(np.float32)
    dtype = getattr(jnp, kv_dtype)
    flat = lambda c: c.swapaxes(1, 2).reshape(-1, kv_heads, head_dim)  # noqa: E731

    def held(c):  # what the cache gives back for every slot
        held = np.asarray(as_stored(jnp.asarray(flat(c)), dtype))
        return held.reshape(num_blocks, block_size, kv_heads, head_dim).swapaxes(1, 2)

    cache = KVCache(jnp.zeros((1, *k_full.shape), dtype), jnp.zeros((1, *k_full.shape), dtype),
                    k_scale=jnp.ones((1, *k_full.shape[:-1]), jnp.float32),
                    v_scale=jnp.ones((1, *k_full.shape[:-1]), jnp.float32), attention_backend=backend)
    all_slots = np.arange(num_blocks * block_size, dtype=np.int32)
    cache = jax.jit(write_kv_quantized)(cache, flat(k_full), flat(v_full), all_slots, 0)
    slots = np.asarray(batch.slot_mapping)[:n]
    k_new = np.zeros((128, kv_heads, head_dim), np.float32)
    v_new = np.zeros_like(k_new)
    k_new[:n], v_new[:n] = flat(k_full)[slots], flat(v_full)[slots]
    step = jax.jit(lambda q, k, v, c, b: paged_attention(q, k, v, c, b, layer=0, scale=0.35, sliding_window=12))
    out, cache = step(q, k_new, v_new, cache, batch)
    want = oracle(q, k_full, v_full, seqs, scale=0.35, sliding_window=12)
    want_held = oracle(q, held(k_full), held(v_full), seqs, scale=0.35, sliding_window=12)
    return np.asarray(out)[:n], cache, want[:n], want_held[:n]


@pytest.mark.parametrize("backend", ["xla", "cpu"])
@pytest.mark.parametrize("kv_dtype, tol", [("int8", 0.03), ("float8_e4m3fn", 0.15)])
def test_quantized_cache_attention_is_close_to_the_float_oracle(kv_dtype, tol, backend):
    """paged_attention on an int8 / fp8 cache (values and per-token-head scales written by the
    step) against the float oracle: mixed prefills, chunks and decodes, GQA, a window; on the
    XLA path and in the C++ kernel (which scales each block as it reads it)."""
    out, cache, want, _ = _attend_over_a_quantized_cache(kv_dtype, backend)
    assert cache.k.dtype == getattr(jnp, kv_dtype) and cache.k_scale.dtype == jnp.float32
    err = np.abs(out - want)
    assert err.max() < tol, err.max()
    assert err.max() > 0  # it really read quantized values


@pytest.mark.parametrize("backend", ["xla", "cpu"])
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_quantized_cache_attention_equals_attention_over_what_the_cache_holds(kv_dtype, backend):
    """Every token, the step's own included, attends with K/V as the quantized cache holds them:
    each backend equals the float oracle over the dequantized cache (not merely close to it), so
    a result does not depend on which step wrote a token's context, nor on the backend."""
    out, _, _, want_held = _attend_over_a_quantized_cache(kv_dtype, backend)
    err = np.abs(out - want_held).max()
    assert err < 2e-5, err


def test_int8_kv_cache_holds_more_tokens_and_keeps_logprobs_close():
    """For one kv_cache_memory_bytes the int8 cache has >= 2x the blocks; prompts chunked over
    several steps (later chunks read earlier ones from the cache) keep their logprobs close."""
    prompt = {"prompt_token_ids": [(5 * i + 1) % 500 + 4 for i in range(60)]}
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0)
    engines, logprobs = {}, {}
    for kv in ("auto", "int8"):
        llm = LLM(model="servax-tiny/llama", kv_cache_dtype=kv, kv_cache_memory_bytes=1_000_000, block_size=4,
                  max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, enforce_eager=True,
                  show_progress=False, compilation_cache_dir="")
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        engines[kv] = llm.engine
        logprobs[kv] = np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
    assert engines["int8"].num_blocks >= 2 * engines["auto"].num_blocks
    assert engines["int8"].programs.kv_cache.k.dtype == jnp.int8
    assert engines["int8"].plan.attention_backend == "cpu"  # the C++ kernel reads the int8 cache
    diff = np.abs(logprobs["int8"] - logprobs["auto"])
    assert diff.max() < 0.15 and diff.mean() < 0.04, (diff.max(), diff.mean())
    assert engines["int8"].kv.num_free_blocks == engines["int8"].kv.num_usable_blocks


def test_quantized_kv_cache_refuses_the_pallas_backend():
    with pytest.raises(ValueError, match="xla"):
        LLM(model="servax-tiny/llama", kv_cache_dtype="int8", attention_backend="pallas", max_model_len=64,
            enforce_eager=True, show_progress=False, compilation_cache_dir="")
