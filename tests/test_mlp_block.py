"""The second half of a decoder layer in one kernel call (runtime/ops/matmul.py dot_mlp_block,
runtime/ops/kernels/matmul_dot.cc DotMlpBlock): against the same layer op by op (each product by
PackedWeight.matmul with int8 activations, the residual adds, RMSNorm and SiLU in JAX) for int8
and 4-bit weights, mixed, stacked by layer and not, with padded rows; and in the engine, which
runs every layer of an int8 Llama through it with the op-by-op engine's tokens and logprobs
(tests/test_gguf.py and tests/test_quantization.py hold those against transformers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.ops.cpu_kernels import kernel_status
from runtime.ops.matmul import PackedWeight, dot_mlp_block, mlp_block_fusable
from runtime.ops.stacked import stack
from test_matmul_dot import _weights


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    assert kernel_status("matmul_dot") == "ok", kernel_status("matmul_dot")


def op_by_op(attn, x, o, norm, eps, gate_up, down, rows):
    x1 = x + o.matmul(attn, rows)
    xf = x1 * jax.lax.rsqrt(jnp.mean(x1 * x1, axis=-1, keepdims=True) + eps)
    gate, up = jnp.split(gate_up.matmul(norm * xf, rows), 2, axis=-1)
    return x1 + down.matmul(jax.nn.silu(gate) * up, rows)


def _layer(formats, d, a, f, rng):
    """o [a, d], gate_up [d, 2f], down [f, d], each of its format, laid out for int8 activations."""
    shapes = ((a, d), (d, 2 * f), (f, d))
    return [_weights(fmt, k, n, k // 32, rng)[0].for_int8_activations() for fmt, (k, n) in zip(formats, shapes)]


@pytest.mark.parametrize("formats", [("uint4", "uint4", "uint4"), ("int8", "int8", "int8"), ("uint4", "int8", "uint4")])
@pytest.mark.parametrize("rows,valid", [(1, 1), (5, 3)])
def test_block_is_the_layer_op_by_op(formats, rows, valid):
    rng = np.random.default_rng(0)
    d, a, f, eps = 96, 64, 160, 1e-5  # 2f = 320: twenty panels; d = 96: six
    o, gate_up, down = _layer(formats, d, a, f, rng)
    attn = jnp.asarray(rng.standard_normal((rows, a)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
    norm = jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32)
    assert mlp_block_fusable(x, o, gate_up, down)
    got = np.asarray(jax.jit(dot_mlp_block, static_argnums=4)(attn, x, o, norm, eps, gate_up, down, valid))
    want = np.asarray(jax.jit(op_by_op, static_argnums=4)(attn, x, o, norm, eps, gate_up, down, valid))
    np.testing.assert_allclose(got[:valid], want[:valid], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[valid:], np.asarray(x)[valid:])  # padded rows: x, as zero products give


def test_block_reads_one_layer_of_a_stack_in_place():
    rng = np.random.default_rng(1)
    d, a, f, eps = 64, 64, 48, 1e-6
    layers = [dict(zip(("o", "gate_up", "down"), _layer(("uint4", "uint4", "int8"), d, a, f, rng))) for _ in range(3)]
    attn = jnp.asarray(rng.standard_normal((2, a)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, d)), jnp.float32)
    norm = jnp.ones(d, jnp.float32)
    wants = [np.asarray(op_by_op(attn, x, w["o"], norm, eps, w["gate_up"], w["down"], None)) for w in layers]
    stacked = stack(layers)  # frees the layers' arrays

    @jax.jit
    def block(i, stacked):
        layer = stacked[i]  # each matrix read in place from the stack (PackedWeight.at_layer)
        o, gate_up, down = layer["o"], layer["gate_up"], layer["down"]
        assert o.layer is not None
        return dot_mlp_block(attn, x, o, norm, eps, gate_up, down)

    for i, want in enumerate(wants):
        np.testing.assert_allclose(np.asarray(block(i, stacked)), want, rtol=1e-4, atol=1e-4)


def test_block_takes_only_what_it_computes():
    rng = np.random.default_rng(2)
    o, gate_up, down = _layer(("int8", "int8", "int8"), 64, 64, 32, rng)
    x = jnp.zeros((1, 64), jnp.float32)
    assert mlp_block_fusable(x, o, gate_up, down)
    assert not mlp_block_fusable(x.astype(jnp.bfloat16), o, gate_up, down)  # float32 activations only
    float_o = PackedWeight.pack(jnp.zeros((64, 64), jnp.float32))
    assert not mlp_block_fusable(x, float_o, gate_up, down)  # every product with int8 activations
    assert not mlp_block_fusable(x, o, gate_up, gate_up)  # down must be [F, D]


def test_engine_runs_each_layer_through_the_block_and_computes_what_the_ops_do(monkeypatch):
    """quantization="int8" (int8 activations, its default on CPU): every layer of the tiny Llama
    goes through one block call, and the tokens and logprobs are the op-by-op engine's."""
    import models_jax.llama as llama
    from app import LLM, SamplingParams

    prompt = [(7 * i + 3) % 500 + 4 for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, prompt_logprobs=0, logprobs=0)
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(llama, "_mlp_block", lambda *args: False)
        llm = LLM(model="servax-tiny/llama", quantization="int8", max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=32, show_progress=False, compilation_cache_dir="")
        programs = llm.engine.programs
        text = programs.layered.lower(programs.kv_cache, programs.inputs.decode_probe(1, 1, 1, 8))[0].as_text()
        (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        logprobs = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:] + out.outputs[0].logprobs]
        runs.append((text.count("servax_dot_mlp_block"), out.outputs[0].token_ids, np.array(logprobs)))
        assert llm.engine.stats().compilations_since_warmup == 0
    (blocks, tokens, logprobs), (no_blocks, want_tokens, want_logprobs) = runs
    assert (blocks, no_blocks) == (llm.engine.model.hf_config.num_hidden_layers, 0)
    assert tokens == want_tokens
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)
