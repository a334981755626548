"""Matmuls on packed weights for XLA:CPU (runtime/ops/matmul.py, runtime/ops/kernels/matmul.cc).

The C++ kernel against NumPy in float64 for row counts that take each of its row blockings
and output widths that are not a multiple of the panel; the packed layout's column gather
(a tied model's embeddings); and end to end: the engine on its CPU kernels packs a native
model's joined projections and its LM head (untied, or the tied embedding table in place of
the table), and generates transformers' greedy tokens with transformers' logprobs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from app import LLM, SamplingParams
from conftest import (assert_greedy_and_logprobs_match_hf, hf_greedy, hf_model, quick_loop_keeps,
                      run_in_fresh_kernel_build)
from runtime.ops.cpu_kernels import cpu_flags
from runtime.ops.matmul import PANEL, PackedWeight, pack_matrix, packed_matmul_available
from runtime.ops.stacked import StackedLayers


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    assert packed_matmul_available(), "the packed matmul kernel must build and run on the test machine"


@pytest.mark.parametrize("rows", [1, 3, 6, 8, 9, 12, 13, 16, 24, 32, 100])
@pytest.mark.parametrize("d_in,d_out", [(72, 1000), (40, 16), (33, 7)])
def test_packed_matmul_matches_numpy(rows, d_in, d_out):
    """Rows in one row block and in several (6 rows a block with AVX2, 8 with AVX-512's 256-bit
    form, 12 for the 512-bit form's panel pairs and 16 for its lone panels); output widths 1000
    and 7 pad their last panel with zero columns that the result leaves out, and 1000's 63
    panels leave a lone one beside pairs."""
    rng = np.random.default_rng(rows * d_out)
    w = rng.standard_normal((d_in, d_out)).astype(np.float32)
    x = rng.standard_normal((rows, d_in)).astype(np.float32)
    packed = PackedWeight.pack(jnp.asarray(w))
    assert packed.panels.shape == (-(-d_out // PANEL), d_in, PANEL) and packed.shape == (d_in, d_out)
    got = np.asarray(jax.jit(lambda x, p: x @ p)(jnp.asarray(x), packed))
    assert got.shape == (rows, d_out) and got.dtype == np.float32
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("valid", [0, 5, 13])
def test_only_valid_rows_are_multiplied(valid):
    """A step padded to its bucket: rows past `valid_rows` (traced) give zeros, the rest as before."""
    rng = np.random.default_rng(valid)
    w = rng.standard_normal((40, 50)).astype(np.float32)
    x = rng.standard_normal((13, 40)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, p, n: p.matmul(x, n))(jnp.asarray(x), PackedWeight.pack(jnp.asarray(w)),
                                                             jnp.int32(valid)))
    np.testing.assert_allclose(got[:valid], x[:valid].astype(np.float64) @ w, rtol=1e-5, atol=1e-4)
    assert not got[valid:].any()


def test_columns_are_the_embedding_rows_and_only_float_matrices_pack():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((50, 24)).astype(np.float32)  # [vocab, D]: packed as the head table.T
    ids = jnp.asarray([0, 15, 16, 49, 17, 17, 3], jnp.int32)
    got = np.asarray(jax.jit(lambda p, i: p.columns(i))(PackedWeight.pack(jnp.asarray(table).T), ids))
    np.testing.assert_array_equal(got, table[np.asarray(ids)])
    ints = jnp.zeros((4, 4), jnp.int32)
    assert pack_matrix(ints) is ints and pack_matrix(jnp.zeros((4, 4))).format == "float32"
    assert pack_matrix(jnp.zeros((4, 4), jnp.bfloat16)).format == "bfloat16"  # kept as stored


@pytest.mark.parametrize("tied", quick_loop_keeps([False, True], False, ids=["untied", "tied"]))
def test_engine_packs_the_weights_and_matches_transformers(tied, tmp_path):
    """The engine on its CPU kernels keeps only the packed matrices (no second copy), its
    layers stacked (one array of each kind for all layers), and
    generates transformers' greedy tokens with its logprobs, prompts of several lengths
    batched together (decode steps of 1-3 rows, a prefill beside them). Padding rows cost
    the kernel nothing, so of the buckets below 16 tokens only 1 is compiled: the other
    small steps run padded to 16, with nothing compiled after warmup."""
    from registry.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("qwen2", tmp_path / "m", tie_word_embeddings=tied)  # q/k/v biases
    llm = LLM(model=str(path), attention_backend="cpu", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, show_progress=False, compilation_cache_dir="")
    params = llm.engine.programs.model.params
    head = params["embed"] if tied else params["lm_head"]
    assert isinstance(head, PackedWeight) and head.shape[1] == llm.engine.programs.model.vocab_size
    assert isinstance(params["embed"], PackedWeight) is tied
    for layer in params["layers"]:
        assert all(isinstance(w, PackedWeight) for w in (layer["qkv"], layer["o"], layer["mlp"]["gate_up"],
                                                         layer["mlp"]["down"]))
        assert isinstance(layer["qkv_bias"], jax.Array)
    # ... stacked (runtime/ops/stacked.py): a step takes each kind of array once, not once per layer
    assert isinstance(params["layers"], StackedLayers) and len(params["layers"]) == 2
    assert len(jax.tree.leaves(params["layers"])) == len(jax.tree.leaves(params["layers"][0])) - 4  # - 4 indices
    prompts = [[(5 * i + 7) % 400 + 3 for i in range(n)] for n in (3, 11, 20)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert_greedy_and_logprobs_match_hf(hf_model(path), prompts, outs, 12)
    assert llm.engine.plan.token_buckets == (1, 16, 32) and llm.engine.plan.seq_buckets == (1, 4)
    assert llm.engine.stats().compilations_since_warmup == 0


@pytest.mark.slow
def test_torchax_path_packs_its_joined_linears_and_matches_transformers(tmp_path):
    """The torchax path's joined Linear groups (q/k/v, gate/up, by input) multiply through the
    kernel too, on the step's real tokens; greedy tokens are transformers'."""
    from registry.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("qwen2", tmp_path / "m")
    llm = LLM(model=str(path), model_impl="torchax", attention_backend="cpu", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, show_progress=False, compilation_cache_dir="")
    layer = llm.engine.programs.model.params["layers"][0]
    packed = [k for k, w in layer.items() if isinstance(w, PackedWeight)]
    assert len(packed) >= 3 and all(k.endswith(".joined_weight") for k in packed), sorted(layer)
    prompts = [[(5 * i + 7) % 400 + 3 for i in range(n)] for n in (3, 11, 20)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    hf = hf_model(path)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


_FORM_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from runtime.ops.matmul import PackedWeight, packed_matmul_available
assert packed_matmul_available()
rng = np.random.default_rng(0)
for rows in (1, 5, 6, 7, 12, 13, 17, 25, 32):
    for d_out in (100, 16):  # 7 panels (pairs and a lone one), 1 panel
        w = rng.standard_normal((40, d_out)).astype(np.float32)
        x = rng.standard_normal((rows, 40)).astype(np.float32)
        packed = PackedWeight.pack(jnp.asarray(w))
        got = np.asarray(jax.jit(lambda x, p: p.matmul(x, rows - 1))(jnp.asarray(x), packed))
        np.testing.assert_allclose(got[:rows - 1], x[:rows - 1].astype(np.float64) @ w, rtol=1e-5, atol=1e-4)
        assert not got[rows - 1:].any()
print("ok")
"""

# Every form of the kernel this machine can run, each built in a fresh cache and process:
# AVX2's 6-row blocks (AMD Zen 2/3, many desktops; on an AVX-512 machine built with
# -mno-avx512f), and on AVX-512 both the 256-bit form (what AMD Zen 4 takes) and the 512-bit
# two-panel form (what Intel takes), whichever this CPU's vendor would not pick.
_FORMS = ["-mno-avx512f"] + (["-DSERVAX_MATMUL_WIDTH=256", "-DSERVAX_MATMUL_WIDTH=512"]
                             if "avx512f" in cpu_flags() else [])


@pytest.mark.parametrize("flags", _FORMS)
@pytest.mark.slow
def test_each_kernel_form_matches_numpy(tmp_path, flags):
    run_in_fresh_kernel_build(tmp_path, flags, _FORM_CHECK)
