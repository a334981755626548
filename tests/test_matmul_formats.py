"""Matmuls on weights kept as stored (runtime/ops/matmul.py, runtime/ops/kernels/matmul_formats.cc).

bfloat16, int8 with per-channel and grouped scales and 4-bit values with scales and offsets,
each packed once and multiplied by the C++ kernel, against NumPy in float64 on the weights
the format stands for (the dequantized values, exactly): row counts across the row blocks,
output widths that pad their last panel, padding rows past `valid_rows`, the column gather
of a tied head, and `pack_matrix` on QuantizedWeights as the models hold them.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.ops.cpu_kernels import EXTRA_FLAGS_ENV, cpu_flags, kernel_status
from runtime.ops.matmul import (PANEL, PackedWeight, bfloat16_products_round_activations, pack_matrix,
                                packable)
from runtime.ops.quantization import QuantizedWeight, quantize_int8

from conftest import run_in_fresh_kernel_build


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    assert kernel_status("matmul_formats") == "ok", kernel_status("matmul_formats")


def _as_multiplied(fmt: str, x: np.ndarray) -> np.ndarray:
    """x in float64 as the kernel multiplies it by format `fmt`: rounded to bfloat16 first where
    the bfloat16 products take vdpbf16ps (runtime/ops/matmul.py bfloat16_products_round_activations)."""
    if fmt == "bfloat16" and bfloat16_products_round_activations():
        x = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    return x.astype(np.float64)


def _case(fmt: str, d_in: int, d_out: int, groups: int, seed: int):
    """(packed weight, the float64 matrix it stands for)."""
    rng = np.random.default_rng(seed)
    if fmt == "bfloat16":
        w = jnp.asarray(rng.standard_normal((d_in, d_out)), jnp.bfloat16)
        return PackedWeight.pack(w), np.asarray(w.astype(jnp.float32), np.float64)
    q = rng.integers(-127, 128, (d_in, d_out)) if fmt == "int8" else rng.integers(0, 16, (d_in, d_out))
    scales = rng.uniform(0.001, 0.02, (groups, d_out)).astype(np.float32)
    dense = q * np.repeat(scales, d_in // groups, axis=0).astype(np.float64)
    if fmt == "int8":
        return PackedWeight.pack_int8(jnp.asarray(q, jnp.int8), jnp.asarray(scales)), dense
    offsets = rng.uniform(-0.2, 0.0, (groups, d_out)).astype(np.float32)
    dense = dense + np.repeat(offsets, d_in // groups, axis=0)
    return PackedWeight.pack_uint4(jnp.asarray(q, jnp.uint8), jnp.asarray(scales), jnp.asarray(offsets)), dense


@pytest.mark.parametrize("rows", [1, 4, 5, 8, 11, 32])
@pytest.mark.parametrize("fmt,d_in,d_out,groups", [
    ("bfloat16", 72, 1000, 1),
    ("int8", 64, 1000, 1),  # per output channel
    ("int8", 96, 33, 3),  # groups of 32 inputs (GGUF Q8_0)
    ("uint4", 64, 50, 2),  # groups of 32 with offsets (GGUF Q4_0 / Q4_1 / Q4_K)
    ("uint4", 48, 16, 3),  # groups of 16, one panel
])
def test_each_format_matches_numpy(fmt, d_in, d_out, groups, rows):
    packed, w = _case(fmt, d_in, d_out, groups, seed=rows + d_out)
    assert packed.format == fmt and packed.shape == (d_in, d_out)
    assert packed.panels.shape == (-(-d_out // PANEL), d_in, PANEL // 2 if fmt == "uint4" else PANEL)
    x = np.random.default_rng(rows).standard_normal((rows, d_in)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, p: x @ p)(jnp.asarray(x), packed))
    assert got.shape == (rows, d_out) and got.dtype == np.float32
    np.testing.assert_allclose(got, _as_multiplied(fmt, x) @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "uint4"])
def test_rows_past_valid_rows_are_zeros_and_the_result_keeps_x_dtype(fmt):
    packed, w = _case(fmt, 64, 40, 2, seed=7)
    x = np.random.default_rng(1).standard_normal((9, 64)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, p, n: p.matmul(x, n))(jnp.asarray(x), packed, jnp.int32(4)))
    np.testing.assert_allclose(got[:4], _as_multiplied(fmt, x[:4]) @ w, rtol=1e-4, atol=1e-4)
    assert not got[4:].any()
    y = jax.jit(lambda x, p: x @ p)(jnp.asarray(x, jnp.bfloat16), packed)
    assert y.dtype == jnp.bfloat16  # a bfloat16 model's activations stay bfloat16


@pytest.mark.skipif(bool(os.environ.get(EXTRA_FLAGS_ENV)), reason="kernels built with other flags than -march=native")
def test_bfloat16_products_take_vdpbf16ps_where_the_cpu_has_it():
    """With AVX-512 BF16 the bfloat16 products round x to bfloat16 (x rounded: the products
    agree with NumPy on the rounded x to float32 accumulation, and not to 1e-4 with x exact);
    elsewhere they multiply x exactly. An odd K pads its last pair."""
    assert bfloat16_products_round_activations() == ({"avx512_bf16", "avx512vl"} <= cpu_flags())
    packed, w = _case("bfloat16", 63, 48, 1, seed=5)
    x = np.random.default_rng(2).standard_normal((13, 63)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, p: x @ p)(jnp.asarray(x), packed))
    np.testing.assert_allclose(got, _as_multiplied("bfloat16", x) @ w, rtol=1e-5, atol=1e-5)
    exact = np.abs(got - x.astype(np.float64) @ w).max()
    assert (exact > 1e-3) if bfloat16_products_round_activations() else exact < 1e-4


_FORMAT_TESTS = """
import pytest
from runtime.ops.matmul import bfloat16_products_round_activations
assert not bfloat16_products_round_activations()
code = pytest.main(["-q", "-p", "no:cacheprovider", "tests/test_matmul_formats.py", "-k",
                    "(matches_numpy or valid_rows) and not bf16_machine"])
print("ok" if code == 0 else f"pytest exit code {code}")
"""


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="no AVX-512 BF16: the other tests run the float32 form")
@pytest.mark.slow
def test_the_float32_form_on_a_bf16_machine(tmp_path):
    """The tests above run vdpbf16ps on this machine: the form that widens bfloat16 weights and
    multiplies in float32 (CPUs without AVX-512 BF16), built with it off, must pass them too."""
    run_in_fresh_kernel_build(tmp_path, "-mno-avx512bf16", _FORMAT_TESTS)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "uint4"])
def test_columns_gather_the_dequantized_columns(fmt):
    packed, w = _case(fmt, 64, 40, 2, seed=3)
    ids = jnp.asarray([0, 7, 8, 15, 16, 39, 8], jnp.int32)
    got = np.asarray(jax.jit(lambda p, i: p.columns(i))(packed, ids), np.float64)
    np.testing.assert_allclose(got, w[:, np.asarray(ids)].T, rtol=1e-6, atol=1e-7)


def test_pack_matrix_takes_quantized_weights_as_the_models_hold_them():
    """Per-channel int8 (quantization="int8") of a [heads, head_dim, D] projection, flattened
    over its inputs; Q8_0-style groups along the last input axis; groups along another axis
    and 3-D experts are left as they are."""
    rng = np.random.default_rng(0)
    o = jnp.asarray(rng.standard_normal((4, 16, 40)), jnp.float32)
    per_channel = quantize_int8(o, reduce_axes=(0, 1))
    packed = pack_matrix(per_channel, inputs=2)
    assert isinstance(packed, PackedWeight) and packed.format == "int8" and packed.scales.shape[1] == 1
    x = rng.standard_normal((3, 64)).astype(np.float32)
    want = x.astype(np.float64) @ np.asarray(per_channel.dequantize(), np.float64).reshape(64, 40)
    np.testing.assert_allclose(np.asarray(jnp.asarray(x) @ packed), want, rtol=1e-4, atol=1e-4)

    q = jnp.asarray(rng.integers(-127, 128, (64, 24)), jnp.int8)
    grouped = QuantizedWeight(q, jnp.asarray(rng.uniform(0.01, 0.02, (2, 24)), jnp.float32), group_size=32,
                              group_axis=-2)
    packed = pack_matrix(grouped)
    assert packed.format == "int8" and packed.scales.shape[1] == 2
    want = x.astype(np.float64) @ np.asarray(grouped.dequantize(), np.float64)
    np.testing.assert_allclose(np.asarray(jnp.asarray(x) @ packed), want, rtol=1e-4, atol=1e-4)

    along_outputs = QuantizedWeight(q, jnp.ones((64, 1), jnp.float32), group_size=24, group_axis=-1)
    experts = quantize_int8(jnp.ones((2, 64, 24)), reduce_axes=(1,))
    assert not packable(along_outputs) and pack_matrix(along_outputs) is along_outputs
    assert pack_matrix(experts) is experts


@pytest.mark.parametrize("kv", ["float32", "auto"])
def test_a_bfloat16_model_keeps_bfloat16_weights_and_computes_in_float32(tmp_path, kv):
    """dtype="bfloat16" on CPU: the layers' and the head's matrices stay bfloat16, packed for the
    kernel; the step computes in float32 on the C++ attention, with a bfloat16 KV cache by default
    (kv_cache_dtype="float32": a float32 one). With the float32 cache it generates what
    transformers in float32 generates on the same bfloat16-rounded weights, greedy tokens and
    logprobs; with the bfloat16 one (K/V rounded too) the same tokens here, where the tiny model's
    margins are wide, and logprobs within that rounding. Where the products round their inputs to
    bfloat16 (vdpbf16ps), so does the reference: every Linear's input. Nothing compiles after warmup."""
    import torch

    from app import LLM, SamplingParams
    from conftest import assert_greedy_and_logprobs_match_hf, hf_greedy, hf_logits, hf_model
    from registry.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("qwen2", tmp_path / "m")
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              show_progress=False, compilation_cache_dir="", kv_cache_dtype=kv)
    plan, params = llm.engine.plan, llm.engine.programs.model.params
    assert plan.compute_float32 and plan.attention_backend == "cpu"
    assert plan.kv_spec.dtype == (jnp.float32 if kv == "float32" else jnp.bfloat16)
    layer = params["layers"][0]
    assert all(w.format == "bfloat16" for w in (layer["qkv"], layer["o"], layer["mlp"]["gate_up"],
                                                 layer["mlp"]["down"], params["lm_head"]))
    prompts = [[(5 * i + 7) % 400 + 3 for i in range(n)] for n in (3, 20)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10, logprobs=1), use_tqdm=False)
    hf = hf_model(path)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    if bfloat16_products_round_activations():
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16).to(torch.float32),))
    if kv == "float32":
        assert_greedy_and_logprobs_match_hf(hf, prompts, outs, 10)
    else:  # K/V rounded to bfloat16: transformers' tokens, logprobs within that rounding
        for prompt, out in zip(prompts, outs):
            tokens = out.outputs[0].token_ids
            assert tokens == hf_greedy(hf, prompt, 10)
            logits = hf_logits(hf, prompt + tokens[:-1])[len(prompt) - 1:].astype(np.float64)
            want = logits[np.arange(10), tokens] - np.log(np.exp(logits).sum(-1))
            np.testing.assert_allclose([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)], want,
                                       atol=3e-2)
    assert llm.engine.stats().compilations_since_warmup == 0
