"""A decoder layer's small ops fused into its packed products (runtime/ops/matmul.py,
runtime/ops/kernels/layer_fusions.h, in matmul_dot.cc with int8 activations and matmul_formats.cc
with float ones): the input RMSNorm with the qkv product (norm_matmul) against the norm then the
product; the second half of the layer in one call (mlp_block) against the same layer op by op
(each product by PackedWeight.matmul, the residual adds, RMSNorm and SiLU in JAX), for int8 and
4-bit weights laid out for int8 activations and for float ones, bfloat16 and float32 weights,
mixed, stacked by layer and not, with padded rows; and the engine, whose decode steps run every
layer of an int8, a bfloat16 and a float32 Llama through both (its prefills op by op), with the
op-by-op engine's tokens and logprobs within activation rounding (tests/test_gguf.py,
tests/test_quantization.py and tests/test_matmul_formats.py hold those against transformers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.ops.cpu_kernels import kernel_status
from runtime.ops.layer_fusions import mlp_block, mlp_block_fusable, norm_matmul, norm_matmul_fusable
from runtime.ops.matmul import PackedWeight
from runtime.ops.stacked import stack
from test_matmul_dot import _weights


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    for kernel in ("matmul_dot", "matmul_formats"):
        assert kernel_status(kernel) == "ok", kernel_status(kernel)


def op_by_op(attn, x, o, norm, eps, gate_up, down, rows):
    x1 = x + o.matmul(attn, rows)
    xf = x1 * jax.lax.rsqrt(jnp.mean(x1 * x1, axis=-1, keepdims=True) + eps)
    gate, up = jnp.split(gate_up.matmul(norm * xf, rows), 2, axis=-1)
    return x1 + down.matmul(jax.nn.silu(gate) * up, rows)


def _matrix(fmt, d_in, d_out, rng, dot=True):
    """A packed [d_in, d_out] matrix: "bfloat16" or "float32" values, or int8 / 4-bit ones in blocks
    of 32 inputs laid out for int8 activations (`dot`) or for float ones."""
    if fmt in ("bfloat16", "float32"):
        return PackedWeight.pack(jnp.asarray(rng.standard_normal((d_in, d_out)) * 0.05, fmt))
    w = _weights(fmt, d_in, d_out, d_in // 32, rng)[0]
    return w.for_int8_activations() if dot else w


def _layer(formats, d, a, f, rng, dot=True):
    """o [a, d], gate_up [d, 2f], down [f, d], each of its format (see _matrix)."""
    shapes = ((a, d), (d, 2 * f), (f, d))
    return [_matrix(fmt, k, n, rng, dot) for fmt, (k, n) in zip(formats, shapes)]


LAYERS = [  # (formats of o, gate_up and down, laid out for int8 activations)
    (("uint4", "uint4", "uint4"), True), (("int8", "int8", "int8"), True), (("uint4", "int8", "uint4"), True),
    (("bfloat16",) * 3, False), (("int8", "int8", "int8"), False), (("uint4", "bfloat16", "int8"), False),
    (("float32",) * 3, False),
]


@pytest.mark.parametrize("formats,dot", LAYERS)
@pytest.mark.parametrize("rows,valid", [(1, 1), (5, 3)])
def test_block_is_the_layer_op_by_op(formats, dot, rows, valid):
    rng = np.random.default_rng(0)
    d, a, f, eps = 96, 64, 160, 1e-5  # 2f = 320: twenty panels; d = 96: six
    o, gate_up, down = _layer(formats, d, a, f, rng, dot)
    attn = jnp.asarray(rng.standard_normal((rows, a)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
    norm = jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32)
    # (float32 panels take the kernel in one-row steps only: with more, matmul.cc's products are faster)
    assert mlp_block_fusable(x, o, gate_up, down) == (formats[0] != "float32" or rows == 1)
    got = np.asarray(jax.jit(mlp_block, static_argnums=4)(attn, x, o, norm, eps, gate_up, down, valid))
    want = np.asarray(jax.jit(op_by_op, static_argnums=4)(attn, x, o, norm, eps, gate_up, down, valid))
    np.testing.assert_allclose(got[:valid], want[:valid], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[valid:], np.asarray(x)[valid:])  # padded rows: x, as zero products give


@pytest.mark.parametrize("fmt,dot", [("uint4", True), ("int8", True), ("bfloat16", False), ("uint4", False),
                                     ("float32", False)])
@pytest.mark.parametrize("rows,valid", [(1, 1), (6, 4)])
def test_norm_and_product_are_the_norm_then_the_product(fmt, dot, rows, valid):
    rng = np.random.default_rng(3)
    w = _matrix(fmt, 96, 200, rng, dot)  # 200 columns: 13 panels, the last padded
    x = jnp.asarray(rng.standard_normal((rows, 96)) * 3, jnp.float32)
    norm = jnp.asarray(rng.uniform(0.5, 1.5, 96), jnp.float32)
    assert norm_matmul_fusable(x, w) == (fmt != "float32" or rows == 1)
    assert not norm_matmul_fusable(x.astype(jnp.bfloat16), w)
    got = np.asarray(jax.jit(norm_matmul, static_argnums=2)(x, norm, 1e-6, w, valid))
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    want = np.asarray(w.matmul(norm * normed, valid))
    assert got.shape == (rows, 200)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not got[valid:].any()


@pytest.mark.parametrize("formats,dot", [(("uint4", "uint4", "int8"), True), (("bfloat16", "uint4", "int8"), False)])
def test_block_reads_one_layer_of_a_stack_in_place(formats, dot):
    rng = np.random.default_rng(1)
    d, a, f, eps = 64, 64, 48, 1e-6
    layers = [dict(zip(("o", "gate_up", "down"), _layer(formats, d, a, f, rng, dot))) for _ in range(3)]
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
        return mlp_block(attn, x, o, norm, eps, gate_up, down)

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
    bf16_o = PackedWeight.pack(jnp.zeros((64, 64), jnp.bfloat16))
    assert not mlp_block_fusable(x, bf16_o, gate_up, down)  # nor a mix of the two layouts
    o, gate_up, down = _layer(("int8", "bfloat16", "int8"), 64, 64, 32, rng, dot=False)
    assert mlp_block_fusable(x, o, gate_up, down) and mlp_block_fusable(x, bf16_o, gate_up, down)
    floats = _layer(("int8", "int8", "int8"), 64, 64, 32, rng, dot=False)
    float_down, x2 = PackedWeight.pack(jnp.zeros((32, 64), jnp.float32)), jnp.zeros((2, 64), jnp.float32)
    assert mlp_block_fusable(x, *floats[:2], float_down) and norm_matmul_fusable(x, float_o)
    # float32 panels in steps of more rows: matmul.cc's own products
    assert not mlp_block_fusable(x2, *floats[:2], float_down) and not norm_matmul_fusable(x2, float_o)
    assert mlp_block_fusable(x2, *floats) and norm_matmul_fusable(x2, bf16_o)


@pytest.mark.parametrize("settings,targets", [
    ({"quantization": "int8"}, ("servax_dot_norm_matmul", "servax_dot_mlp_block")),  # int8 activations
    ({"dtype": "bfloat16"}, ("servax_norm_matmul", "servax_mlp_block")),
    ({"dtype": "float32"}, ("servax_norm_matmul", "servax_mlp_block")),  # one-token steps
])
def test_engine_runs_each_layer_through_the_block_and_computes_what_the_ops_do(monkeypatch, settings, targets):
    """quantization="int8" (int8 activations, its default on CPU), dtype="bfloat16" and float32:
    every layer of the tiny Llama takes its input norm with qkv in one call and the rest of the
    layer after attention in another in a one-token decode, and the tokens and logprobs are the
    op-by-op engine's."""
    import models_jax.llama as llama
    from app import LLM, SamplingParams

    prompt = [(7 * i + 3) % 500 + 4 for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, prompt_logprobs=0, logprobs=0)
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(llama, "_fusions", lambda *args: (False, False))
        llm = LLM(model="servax-tiny/llama", **settings, max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=32, show_progress=False, compilation_cache_dir="")
        programs = llm.engine.programs
        text = programs.layered.lower(programs.kv_cache, programs.inputs.decode_probe(1, 1, 1, 8))[0].as_text()
        prefill = "".join(p.as_text() for p in programs.layered.lower(programs.kv_cache,
                                                                      programs.inputs.padding_step(32, 4)))
        assert not any(target in prefill for target in targets)  # XLA's ops
        (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        logprobs = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:] + out.outputs[0].logprobs]
        calls = tuple(text.count(target) for target in targets)
        runs.append((calls, out.outputs[0].token_ids, np.array(logprobs)))
        assert llm.engine.stats().compilations_since_warmup == 0
    (blocks, tokens, logprobs), (no_blocks, want_tokens, want_logprobs) = runs
    layers = llm.engine.model.hf_config.num_hidden_layers
    assert (blocks, no_blocks) == ((layers, layers), (0, 0))
    assert tokens == want_tokens
    # The norms sum in another order than XLA's: now and then an activation rounds to the other
    # int8 (bfloat16) step, which moves a logprob by a few hundredths (a wrong norm or product
    # moves it by far more).
    np.testing.assert_allclose(logprobs, want_logprobs, atol=0.05)
    assert np.median(np.abs(logprobs - want_logprobs)) < 1e-3
