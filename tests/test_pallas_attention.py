"""The Pallas attention backend (runtime/ops/attention_pallas.py), in Pallas' TPU interpret mode.

On this CPU the kernel runs interpreted: the same kernel a TPU compiles, checked here
against the NumPy oracle of tests/test_attention.py, against the XLA backend through
`paged_attention`, per shard on a mesh of fake devices, and end to end (greedy tokens of
the tiny models equal with attention_backend="pallas" and "xla").
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from app import LLM, SamplingParams
from runtime.ops.attention import resolve_attention_backend
from runtime.engine.config import EngineConfig
from runtime.ops.attention_pallas import pallas_ragged_paged_attention
from conftest import quick_loop_keeps
from test_attention import MIXED, TOL, build_batch, check_per_shard_against_xla, oracle

# (heads, kv_heads, block_size, window, soft cap)
CASES = [(4, 4, 4, None, None), (8, 2, 16, None, None), (6, 3, 4, 10, None), (4, 1, 4, None, 5.0)]
CASE_IDS = ["mha", "gqa", "sliding", "softcap"]


def _cache_case(rng, specs, *, heads, kv_heads, block_size, pad_tokens=64, pad_seqs=8, head_dim=8):
    num_blocks = 96
    batch, seqs, n = build_batch(rng, specs, block_size=block_size, num_blocks=num_blocks, max_blocks=24,
                                 pad_tokens=pad_tokens, pad_seqs=pad_seqs)
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    q = rng.standard_normal((pad_tokens, heads, head_dim)).astype(np.float32)
    return batch, seqs, n, q, k, v


@pytest.mark.parametrize("heads,kv_heads,block_size,window,soft_cap", quick_loop_keeps(CASES, CASES[1], CASE_IDS))
def test_kernel_matches_numpy_oracle(heads, kv_heads, block_size, window, soft_cap):
    """Prefills, chunks starting mid-sequence and decodes in one batch, shuffled block tables."""
    rng = np.random.default_rng(heads * 10 + block_size)
    batch, seqs, n, q, k, v = _cache_case(rng, MIXED, heads=heads, kv_heads=kv_heads, block_size=block_size,
                                          pad_tokens=128)
    # Two layers; the kernel reads layer 1 (layer 0 is noise it must not touch).
    k2, v2 = np.stack([rng.standard_normal(k.shape), k]), np.stack([rng.standard_normal(v.shape), v])
    attend = jax.jit(lambda q, k, v, b: pallas_ragged_paged_attention(
        q, k, v, 1, b, scale=0.35, sliding_window=window, logit_soft_cap=soft_cap))
    got = np.asarray(attend(q, k2.astype(np.float32), v2.astype(np.float32), batch))
    want = oracle(q, k, v, seqs, scale=0.35, sliding_window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(got[:n], want[:n], atol=TOL, rtol=0)
    assert np.all(got[n:] == 0), "padding tokens must produce zeros"


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize(
    "specs",
    [[(5, 1), (60, 33), (0, 20)], [(3, 1), (32, 10), (48, 20), (0, 4), (16, 5), (8, 1)]],
    ids=["long-chunk", "prefix-hits"],
)
def test_kernel_long_chunks_and_prefix_hits_with_traced_window(specs, window):
    """Query tiles of long chunks, prefix-cache hits; a window passed as a traced int32 (as
    the models' layer loop passes it when layers differ) masks the same as a static one."""
    rng = np.random.default_rng(7)
    batch, seqs, n, q, k, v = _cache_case(rng, specs, heads=4, kv_heads=2, block_size=4, pad_tokens=100)
    traced = jax.jit(lambda q, k, v, b, w: pallas_ragged_paged_attention(q, k, v, 0, b, scale=0.35,
                                                                         sliding_window=w))
    w = np.int32(1 << 30) if window is None else np.int32(window)
    got = np.asarray(traced(q, k[None], v[None], batch, w))
    want = oracle(q, k, v, seqs, scale=0.35, sliding_window=window)
    np.testing.assert_allclose(got[:n], want[:n], atol=TOL, rtol=0)


@pytest.mark.slow
@pytest.mark.slow
def test_kernel_runs_per_shard_on_a_mesh_of_fake_devices():
    """Under tensor parallelism each device attends with its own KV heads (shard_map): the
    result equals the XLA backend's on the same sharded cache."""
    check_per_shard_against_xla("pallas", block_size=4, head_dim=8)


def test_backend_resolution():
    assert resolve_attention_backend("auto", "cpu") == "cpu"  # the C++ kernel (tests/test_cpu_attention.py)
    assert resolve_attention_backend("auto", "gpu") == "xla"
    assert resolve_attention_backend("auto", "tpu") == "pallas"
    assert resolve_attention_backend("pallas", "cpu") == "pallas"
    assert resolve_attention_backend("xla", "tpu") == "xla"
    with pytest.raises(ValueError, match="TPU"):
        resolve_attention_backend("pallas", "gpu")
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model="servax-tiny/llama", attention_backend="flash")


# A prompt longer than the tiny Mistral's 24-token window, one chunked over two steps
# (32-token budget), and short ones decoding beside them.
PROMPTS = [[(7 * i + 3) % 500 + 4 for i in range(n)] for n in (40, 5, 17, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("model", quick_loop_keeps(["servax-tiny/mistral", "servax-tiny/gpt2"], "servax-tiny/mistral"))
def test_greedy_tokens_equal_xla_end_to_end(model, servax_cache):
    """The engine with attention_backend="pallas" (interpreted) gives the XLA backend's tokens:
    the native path (Mistral: Llama's layers with a sliding window, which the short prompts stay
    within) and the torchax path (GPT-2)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens = {}
    for backend in ("xla", "pallas"):
        llm = LLM(model=model, attention_backend=backend, max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=32, num_kv_blocks=48, block_size=4, enforce_eager=True,
                  show_progress=False, compilation_cache_dir="")
        assert llm.engine.programs.kv_cache.attention_backend == backend
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    assert tokens["pallas"] == tokens["xla"]
