"""The CPU attention backend (runtime/ops/attention_cpu.py): servax's C++ kernel for XLA:CPU.

The kernel is built here with the machine's compiler, as users get it, and checked against
the NumPy oracle of tests/test_attention.py on the compiled-in fast shapes (block 16, head
dims 64 and 128, grouped heads) and the generic path, against the XLA backend through
`paged_attention` (the write included; in tests/test_attention.py), per shard on a mesh of fake devices, and end to end
(greedy tokens equal with attention_backend="cpu" and "xla", native and torchax models).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime.ops.cpu_kernels as cpu_kernels
from app import LLM, SamplingParams
from conftest import quick_loop_keeps, run_in_fresh_kernel_build
from runtime.ops.attention import resolve_attention_backend
from runtime.ops.attention_cpu import cpu_ragged_paged_attention
from runtime.ops.cpu_kernels import kernel_status
from test_attention import MIXED, TOL, build_batch, check_per_shard_against_xla, oracle

# (heads, kv_heads, block_size, head_dim, window, soft cap): the first three take the
# kernel's compiled-in shapes (block 16 with head_dim 64 / 128, block 32), the soft cap the
# generic loops, the rest (other head dims) the tiled products (RunItemTiled: tiles of 4 rows,
# and single rows past them; values in tiles of 16 dims and one of 8).
CASES = [
    (9, 3, 16, 64, None, None), (8, 2, 16, 128, 20, None), (4, 4, 32, 64, None, None),
    (4, 4, 4, 8, None, None), (6, 3, 4, 8, 10, None), (4, 1, 4, 16, None, 5.0),
    (8, 1, 16, 72, None, None), (6, 1, 16, 40, 12, None),
]
CASE_IDS = ["gqa-16x64", "window-16x128", "mha-32x64", "mha-generic", "sliding-generic", "softcap-generic",
            "mqa-tiled-16x72", "mqa-window-tiled-16x40"]


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    status = kernel_status("paged_attention")
    assert status == "ok", f"the CPU attention kernel must build on the test machine: {status}"


def _case(rng, specs, *, heads, kv_heads, block_size, head_dim, pad_tokens=128, pad_seqs=8, num_blocks=96):
    max_blocks = max(24, -(-64 // block_size) + 2)
    batch, seqs, n = build_batch(rng, specs, block_size=block_size, num_blocks=num_blocks, max_blocks=max_blocks,
                                 pad_tokens=pad_tokens, pad_seqs=pad_seqs)
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    q = rng.standard_normal((pad_tokens, heads, head_dim)).astype(np.float32)
    return batch, seqs, n, q, k, v


@pytest.mark.parametrize("heads,kv_heads,block_size,head_dim,window,soft_cap", CASES, ids=CASE_IDS)
def test_kernel_matches_numpy_oracle(heads, kv_heads, block_size, head_dim, window, soft_cap):
    """Prefills, chunks starting mid-sequence and decodes in one batch, shuffled block tables,
    the layer a traced index into a stacked cache."""
    rng = np.random.default_rng(heads * 10 + block_size + head_dim)
    batch, seqs, n, q, k, v = _case(rng, MIXED, heads=heads, kv_heads=kv_heads, block_size=block_size,
                                    head_dim=head_dim)
    # Two layers; the kernel reads layer 1 (layer 0 is noise it must not touch).
    k2 = np.stack([rng.standard_normal(k.shape), k]).astype(np.float32)
    v2 = np.stack([rng.standard_normal(v.shape), v]).astype(np.float32)
    attend = jax.jit(lambda q, k, v, layer, b: cpu_ragged_paged_attention(
        q, k, v, layer, b, scale=0.35, sliding_window=window, logit_soft_cap=soft_cap))
    got = np.asarray(attend(q, k2, v2, jnp.int32(1), batch))
    want = oracle(q, k, v, seqs, scale=0.35, sliding_window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(got[:n], want[:n], atol=TOL, rtol=0)
    assert np.all(got[n:] == 0), "padding tokens must produce zeros"


@pytest.mark.parametrize("head_dim,row,window", [(64, 128, None), (32, 64, 20), (8, 16, None)])
def test_rows_wider_than_the_heads_read_their_first_dims(head_dim, row, window):
    """A cache whose rows are wider than the layer's heads (Gemma 4's sliding layers in a cache
    shaped for its global ones): the kernel reads each row's first head_dim dims and ignores the
    rest (noise here), against the oracle on the narrow rows."""
    rng = np.random.default_rng(row + head_dim)
    batch, seqs, n, q, k, v = _case(rng, MIXED, heads=6, kv_heads=2, block_size=16, head_dim=row)
    q = q[..., :head_dim]
    attend = jax.jit(lambda q, k, v, b: cpu_ragged_paged_attention(q, k, v, 0, b, scale=0.35, sliding_window=window))
    got = np.asarray(attend(q, k[None], v[None], batch))
    assert got.shape == q.shape
    want = oracle(q, k[..., :head_dim], v[..., :head_dim], seqs, scale=0.35, sliding_window=window)
    np.testing.assert_allclose(got[:n], want[:n], atol=TOL, rtol=0)
    assert np.all(got[n:] == 0)


@pytest.mark.parametrize("specs", [[(40, 1)], [(70, 1), (5, 1)]], ids=["one-decode", "two-decodes"])
@pytest.mark.parametrize("heads,kv_heads,block_size,head_dim,window,soft_cap",
                         CASES[:3] + [(8, 1, 16, 64, None, None)], ids=CASE_IDS[:3] + ["mqa-16x64"])
def test_few_decodes_split_by_kv_heads_match_the_oracle(specs, heads, kv_heads, block_size, head_dim, window,
                                                         soft_cap):
    """One or two decoding sequences alone: the kernel shares each one's KV heads among the
    threads (each share reading its heads' part of every block), or with one KV head (multi-query,
    or a latent cache) its query heads."""
    rng = np.random.default_rng(len(specs) * 100 + kv_heads)
    batch, seqs, n, q, k, v = _case(rng, specs, heads=heads, kv_heads=kv_heads, block_size=block_size,
                                    head_dim=head_dim, pad_tokens=8, pad_seqs=4)
    attend = jax.jit(lambda q, k, v, b: cpu_ragged_paged_attention(
        q, k[None], v[None], jnp.int32(0), b, scale=0.35, sliding_window=window, logit_soft_cap=soft_cap))
    got = np.asarray(attend(q, k, v, batch))
    want = oracle(q, k, v, seqs, scale=0.35, sliding_window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(got[:n], want[:n], atol=TOL, rtol=0)
    assert np.all(got[n:] == 0), "padding tokens must produce zeros"


_FORM_CHECK = """
import sys
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp, numpy as np
from runtime.ops.attention_cpu import cpu_ragged_paged_attention
from runtime.ops.cpu_kernels import kernel_status
from test_attention import MIXED, TOL, build_batch, oracle
assert kernel_status("paged_attention") == "ok", kernel_status("paged_attention")
for heads, kv_heads, bs, d, window in [(9, 3, 16, 64, None), (8, 2, 16, 128, 20), (4, 4, 32, 64, None)]:
    rng = np.random.default_rng(heads + bs + d)
    for specs in (MIXED, [(40, 1)], [(0, 48), (70, 50)]):
        batch, seqs, n = build_batch(rng, specs, block_size=bs, num_blocks=96, max_blocks=24, pad_tokens=128,
                                     pad_seqs=8)
        k = rng.standard_normal((96, kv_heads, bs, d)).astype(np.float32)
        v = rng.standard_normal((96, kv_heads, bs, d)).astype(np.float32)
        q = rng.standard_normal((128, heads, d)).astype(np.float32)
        got = np.asarray(jax.jit(lambda q, k, v, b: cpu_ragged_paged_attention(
            q, k[None], v[None], jnp.int32(0), b, scale=0.35, sliding_window=window))(q, k, v, batch))
        want = oracle(q, k, v, seqs, scale=0.35, sliding_window=window, soft_cap=None)
        np.testing.assert_allclose(got[:n], want[:n], atol=TOL, rtol=0)
print("ok")
"""

# Every form of the kernel this CPU runs, each built in a fresh process and cache: AVX2 (as
# on a CPU without AVX-512), and on AVX-512 also without the rows-in-lanes prefill form.
_FORMS = ["-mno-avx512f"] + (["-DSERVAX_ATTENTION_NO_LANES"] if "avx512f" in cpu_kernels.cpu_flags() else [])


@pytest.mark.parametrize("flags", _FORMS)
@pytest.mark.slow
def test_each_kernel_form_matches_the_oracle(tmp_path, flags):
    """Prefills (whole, chunked, several tiles long), decodes and a sliding window against the
    NumPy oracle, in the kernel built with `flags` (the in-process tests run the default build)."""
    run_in_fresh_kernel_build(tmp_path, flags, _FORM_CHECK)


def test_bfloat16_queries_and_out_of_range_blocks():
    """bfloat16 queries are read as float32 and the result cast back; a block id outside the
    cache (a corrupt table) reads a clamped block instead of memory outside the cache."""
    rng = np.random.default_rng(3)
    batch, seqs, n, q, k, v = _case(rng, MIXED, heads=9, kv_heads=3, block_size=16, head_dim=64)
    attend = jax.jit(lambda q, k, v, b: cpu_ragged_paged_attention(q, k, v, 0, b, scale=0.125))
    got = attend(jnp.asarray(q, jnp.bfloat16), k[None], v[None], batch)
    assert got.dtype == jnp.bfloat16
    want = oracle(np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32)), k, v, seqs, scale=0.125)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32))[:n], want[:n], atol=2e-2, rtol=0)

    tables = np.asarray(batch.block_tables).copy()
    tables[0, :] = 10**6
    tables[1, :] = -(10**6)
    out = np.asarray(attend(jnp.asarray(q), k[None], v[None], batch.replace(block_tables=jnp.asarray(tables))))
    assert np.isfinite(out).all()


@pytest.mark.slow
def test_kernel_runs_per_shard_on_a_mesh_of_fake_devices():
    """Under tensor parallelism each device attends with its own KV heads (shard_map): the
    result equals the XLA backend's on the same sharded cache."""
    check_per_shard_against_xla("cpu", block_size=16, head_dim=16)


def test_backend_resolution_and_a_machine_without_a_compiler(monkeypatch, caplog):
    """auto takes the kernel on CPU; where it cannot be built auto keeps xla (with the reason
    in the log) and an explicit "cpu" is a configuration error that says why."""
    assert resolve_attention_backend("auto", "cpu") == "cpu"
    assert resolve_attention_backend("cpu", "cpu") == "cpu"
    with pytest.raises(ValueError, match="XLA:CPU"):
        resolve_attention_backend("cpu", "tpu")
    monkeypatch.setattr(cpu_kernels, "_status", {})
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    assert resolve_attention_backend("auto", "cpu") == "xla"
    assert "no C++ compiler" in caplog.text
    with pytest.raises(ValueError, match=r"no C\+\+ compiler"):
        resolve_attention_backend("cpu", "cpu")
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "_status", {})  # the next use loads the cached build again
    assert kernel_status("paged_attention") == "ok"


def test_engine_rejects_the_kernel_for_caches_it_cannot_read():
    """A bfloat16 KV cache with attention_backend="cpu" is refused with the way out; with "auto"
    the engine takes xla for it. A bfloat16 model on packed weights (the layered default)
    computes in float32 and caches K/V in float32: the kernel reads that, as it reads an int8
    cache with its scales (on one device; tests/test_quantization.py)."""
    llm = LLM(model="servax-tiny/llama", kv_cache_dtype="int8", attention_backend="cpu", max_model_len=64,
              show_progress=False, enforce_eager=True)
    assert llm.engine.programs.kv_cache.attention_backend == "cpu" and llm.engine.programs.kv_cache.k_scale is not None
    with pytest.raises(ValueError, match="float32 KV cache"):
        LLM(model="servax-tiny/llama", dtype="bfloat16", attention_backend="cpu", layered=False, max_model_len=64,
            show_progress=False, enforce_eager=True)
    llm = LLM(model="servax-tiny/llama", dtype="bfloat16", layered=False, max_model_len=64, show_progress=False,
              enforce_eager=True)
    assert llm.engine.programs.kv_cache.attention_backend == "xla"
    llm = LLM(model="servax-tiny/llama", dtype="bfloat16", attention_backend="cpu", max_model_len=64,
              show_progress=False, enforce_eager=True)
    assert llm.engine.plan.compute_float32 and llm.engine.programs.kv_cache.attention_backend == "cpu"


# A prompt longer than the tiny Mistral's 24-token window, one chunked over two steps
# (32-token budget), and short ones decoding beside them.
PROMPTS = [[(7 * i + 3) % 500 + 4 for i in range(n)] for n in (40, 5, 17, 2)]


@pytest.mark.parametrize("model", quick_loop_keeps(["servax-tiny/llama", "servax-tiny/mistral", "servax-tiny/gpt2"],
                                                   "servax-tiny/mistral"))
def test_greedy_tokens_equal_xla_end_to_end(model, servax_cache):
    """The engine with attention_backend="cpu" gives the XLA backend's tokens: native models
    (Llama; Mistral's sliding window) and the torchax path (GPT-2)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens = {}
    for backend in ("xla", "cpu"):
        llm = LLM(model=model, attention_backend=backend, max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=32, num_kv_blocks=48, block_size=16, enforce_eager=True,
                  show_progress=False, compilation_cache_dir="")
        assert llm.engine.programs.kv_cache.attention_backend == backend
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    assert tokens["cpu"] == tokens["xla"]
