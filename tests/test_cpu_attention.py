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
from runtime.ops.attention_common import write_kv
from runtime.ops.attention_cpu import cpu_ragged_paged_attention, cpu_rotated_paged_attention
from runtime.ops.cpu_kernels import kernel_status
from test_attention import MIXED, TOL, build_batch, check_per_shard_against_xla, oracle

# (heads, kv_heads, block_size, head_dim, window, soft cap): the first three take the
# kernel's compiled-in shapes (block 16 with head_dim 64 / 128, block 32), the soft cap the
# generic loops, the next two (other head dims) the tiled products (RunItemTiled: tiles of 4
# rows, and single rows past them; values in tiles of 16 dims and one of 8), the last two
# compiled-in shapes with groups of 8 and 5 query heads (with AVX-512 a decode's group goes in
# passes of 4 rows, and of 1).
CASES = [
    (9, 3, 16, 64, None, None), (8, 2, 16, 128, 20, None), (4, 4, 32, 64, None, None),
    (4, 4, 4, 8, None, None), (6, 3, 4, 8, 10, None), (4, 1, 4, 16, None, 5.0),
    (8, 1, 16, 72, None, None), (6, 1, 16, 40, 12, None),
    (16, 2, 32, 128, 24, None), (10, 2, 16, 64, None, None),
]
CASE_IDS = ["gqa-16x64", "window-16x128", "mha-32x64", "mha-generic", "sliding-generic", "softcap-generic",
            "mqa-tiled-16x72", "mqa-window-tiled-16x40", "gqa8-window-32x128", "gqa5-16x64"]


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    status = kernel_status("paged_attention")
    assert status == "ok", f"the CPU attention kernel must build on the test machine: {status}"


def _case(rng, specs, *, heads, kv_heads, block_size, head_dim, pad_tokens=128, pad_seqs=8, num_blocks=96,
          layout="shuffled"):
    max_blocks = max(24, -(-64 // block_size) + 2)
    batch, seqs, n = build_batch(rng, specs, block_size=block_size, num_blocks=num_blocks, max_blocks=max_blocks,
                                 pad_tokens=pad_tokens, pad_seqs=pad_seqs, layout=layout)
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


@pytest.mark.parametrize("layout", ["ascending", "descending"])
@pytest.mark.parametrize("heads,kv_heads,block_size,head_dim,window,soft_cap",
                         [CASES[0], CASES[5], CASES[6]], ids=["gqa-16x64", "softcap-generic", "mqa-tiled-16x72"])
def test_decodes_over_blocks_in_and_out_of_memory_order(layout, heads, kv_heads, block_size, head_dim, window,
                                                        soft_cap):
    """The AVX-512 decode form fetches its next block whole where it follows the current one in the
    cache and a share at a time where it does not, the generic form a share at a time either way, the
    tiled form whole either way: each gives the oracle's results over blocks in and out of order."""
    rng = np.random.default_rng(7)
    specs = [(80, 1), (60, 1), (40, 1), (17, 1)]
    batch, seqs, n, q, k, v = _case(rng, specs, heads=heads, kv_heads=kv_heads, block_size=block_size,
                                    head_dim=head_dim, pad_tokens=8, layout=layout)
    got = np.asarray(jax.jit(lambda q, k, v, b: cpu_ragged_paged_attention(
        q, k, v, 0, b, scale=0.35, sliding_window=window, logit_soft_cap=soft_cap))(q, k[None], v[None], batch))
    want = oracle(q, k, v, seqs, scale=0.35, sliding_window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(got[:n], want[:n], atol=TOL, rtol=0)
    tables = np.asarray(batch.block_tables)[0, :-(-81 // block_size)]  # the first sequence's blocks
    assert np.all(np.diff(tables) == (-1 if layout == "descending" else 1)), tables


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("heads,kv_heads,block_size,head_dim,window,soft_cap",
                         [CASES[0], CASES[1], CASES[3], CASES[5], CASES[6], CASES[8]],
                         ids=[CASE_IDS[0], CASE_IDS[1], CASE_IDS[3], CASE_IDS[5], CASE_IDS[6], CASE_IDS[8]])
def test_half_precision_caches_read_as_stored(dtype, heads, kv_heads, block_size, head_dim, window, soft_cap):
    """A bfloat16 or float16 cache (no scales) is widened block by block as the kernel reads it
    (a decode's keys and values in place, as their loads feed the products): the oracle's attention
    over the same values in float32, in every form (compiled-in shapes, generic loops with a soft
    cap, tiled products), prefills and decodes together."""
    rng = np.random.default_rng(heads + block_size + head_dim + (dtype == jnp.float16))
    for specs in (MIXED, [(40, 1)]):
        batch, seqs, n, q, k, v = _case(rng, specs, heads=heads, kv_heads=kv_heads, block_size=block_size,
                                        head_dim=head_dim)
        k16, v16 = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
        # Two layers; the kernel reads layer 1 (layer 0 is noise it must not touch).
        noise = jnp.asarray(rng.standard_normal(k.shape), dtype)
        attend = jax.jit(lambda q, k, v, b: cpu_ragged_paged_attention(
            q, k, v, jnp.int32(1), b, scale=0.35, sliding_window=window, logit_soft_cap=soft_cap))
        got = np.asarray(attend(q, jnp.stack([noise, k16]), jnp.stack([noise, v16]), batch))
        widened = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
        want = oracle(q, widened(k16), widened(v16), seqs, scale=0.35, sliding_window=window, soft_cap=soft_cap)
        np.testing.assert_allclose(got[:n], want[:n], atol=TOL, rtol=0)
        assert np.all(got[n:] == 0), "padding tokens must produce zeros"
        # The same values' bits as uint16 (how servax keeps a 16-bit cache on CPU): the same result.
        bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)  # noqa: E731
        by_bits = jax.jit(lambda q, k, v, b: cpu_ragged_paged_attention(
            q, k, v, jnp.int32(1), b, scale=0.35, sliding_window=window, logit_soft_cap=soft_cap,
            half_bits=jnp.dtype(dtype).name))
        got_bits = np.asarray(by_bits(q, bits(jnp.stack([noise, k16])), bits(jnp.stack([noise, v16])), batch))
        np.testing.assert_array_equal(got_bits, got)
    # The values kept in the keys (a latent cache: v_cache is the key cache, value_dims leading dims).
    batch, seqs, n, q, k, _ = _case(rng, MIXED, heads=heads, kv_heads=1, block_size=block_size, head_dim=head_dim)
    k16 = jnp.asarray(k, dtype)
    got = np.asarray(jax.jit(lambda q, k, b: cpu_ragged_paged_attention(
        q, k, k, 0, b, scale=0.35, value_dims=head_dim // 2))(q, k16[None], batch))
    kf = np.asarray(k16.astype(jnp.float32))
    values = np.where(np.arange(head_dim) < head_dim // 2, kf, 0.0)  # the oracle's values: the keys' leading dims
    want = oracle(q, kf, values, seqs, scale=0.35)[..., :head_dim // 2]
    assert got.shape == want.shape
    np.testing.assert_allclose(got[:n], want[:n], atol=TOL, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_a_16_bit_cache_kept_as_bits_is_written_in_place(dtype, tokens):
    """A 16-bit cache kept as its bits (uint16, KVCache.half_bits) gets each token's rows rounded to
    the dtype where a cache of that dtype gets them: one token (a lone decode) and several, the
    layer traced, padding (negative) slots and slots past the cache writing nowhere; and XLA:CPU
    updates the donated cache in place (a 16-bit float array it would widen whole)."""
    rng = np.random.default_rng(tokens)
    cache = jnp.asarray(rng.standard_normal((3, 10, 2, 4, 8)), dtype)
    new = jnp.asarray(rng.standard_normal((tokens, 2, 8)), jnp.float32)
    slots = np.array([13, -1, 39, 0, 40, 7, 22][:tokens] if tokens > 1 else [17], np.int32)
    name = jnp.dtype(dtype).name
    as_bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)  # noqa: E731
    for layer in (0, 2):
        want = jax.jit(lambda c, n, s, layer: write_kv(c, c, n, n, s, layer)[0])(cache, new, slots, jnp.int32(layer))
        got = jax.jit(lambda c, n, s, layer: write_kv(c, c, n, n, s, layer, half_bits=name)[0])(
            as_bits(cache), new, slots, jnp.int32(layer))
        assert got.dtype == jnp.uint16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(as_bits(want)))
        assert not np.array_equal(np.asarray(want.astype(jnp.float32)), np.asarray(cache.astype(jnp.float32)))
    donated = jax.jit(lambda c, n, s: write_kv(c, c, n, None, s, 1, half_bits=name)[0], donate_argnums=0)
    before = as_bits(cache)
    pointer = before.unsafe_buffer_pointer()
    after = donated(before, new, slots)
    assert after.unsafe_buffer_pointer() == pointer, "the write must update the donated cache in place"


def _rope(positions, head_dim):
    """cos, sin [T, head_dim] of the rotary angles at `positions` (HF's layout: the half repeated)."""
    inv = 1.0 / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    angles = np.asarray(positions)[:, None] * inv[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


ROTATED = [(c[:5], i) for c, i in zip(CASES, CASE_IDS) if c[5] is None][:6]


@pytest.mark.parametrize("half", [None, "bfloat16", "float16"])
@pytest.mark.parametrize("heads,kv_heads,block_size,head_dim,window", [c for c, _ in ROTATED],
                         ids=[i for _, i in ROTATED])
def test_rotated_attention_matches_rope_write_then_attend(heads, kv_heads, block_size, head_dim, window, half):
    """The one-call form (rotate q and k, write the step's K/V, attend) against apply_rope, write_kv
    and the kernel's attention op by op: the same outputs, the same cache (layer 0 untouched,
    padding tokens writing nowhere; a 16-bit cache kept as its bits gets each row rounded as
    XLA rounds it), and the donated cache updated in place."""
    from models_jax.layers import apply_rope

    rng = np.random.default_rng(heads + 7 * head_dim + block_size)
    batch, seqs, n, _, k, v = _case(rng, MIXED, heads=heads, kv_heads=kv_heads, block_size=block_size,
                                    head_dim=head_dim)
    stored = (lambda x: jnp.asarray(x, jnp.float32)) if half is None else (  # noqa: E731
        lambda x: jax.lax.bitcast_convert_type(jnp.asarray(x, half), jnp.uint16))
    k2 = stored(np.stack([rng.standard_normal(k.shape), k]))
    v2 = stored(np.stack([rng.standard_normal(v.shape), v]))
    t = batch.positions.shape[0]
    qkv = jnp.asarray(rng.standard_normal((t, (heads + 2 * kv_heads) * head_dim)).astype(np.float32))
    cos, sin = _rope(batch.positions, head_dim)

    def op_by_op(qkv, k_cache, v_cache, layer, b):
        q, kk, vv = jnp.split(qkv, [heads * head_dim, (heads + kv_heads) * head_dim], axis=-1)
        q, kk, vv = (x.reshape(t, -1, head_dim) for x in (q, kk, vv))
        q, kk = apply_rope(q, cos, sin), apply_rope(kk, cos, sin)
        k_cache, v_cache = write_kv(k_cache, v_cache, kk, vv, b.slot_mapping, layer, half_bits=half)
        out = cpu_ragged_paged_attention(q, k_cache, v_cache, layer, b, scale=0.35, sliding_window=window,
                                         half_bits=half)
        return out, k_cache, v_cache

    def one_call(qkv, k_cache, v_cache, layer, b):
        return cpu_rotated_paged_attention(qkv, cos, sin, k_cache, v_cache, layer, b, num_heads=heads, scale=0.35,
                                           sliding_window=window, half_bits=half)

    want = jax.jit(op_by_op)(qkv, k2, v2, jnp.int32(1), batch)
    got = jax.jit(one_call)(qkv, k2, v2, jnp.int32(1), batch)
    np.testing.assert_allclose(np.asarray(got[0])[:n], np.asarray(want[0])[:n], atol=TOL, rtol=0)
    assert np.all(np.asarray(got[0])[n:] == 0), "padding tokens must produce zeros"
    if half is None:
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-6, rtol=1e-6)
    else:  # the rotation's float rounding may move a value across a 16-bit rounding boundary: one ulp at most
        ulps = np.abs(np.asarray(got[1]).astype(np.int32) - np.asarray(want[1]).astype(np.int32))
        assert ulps.max() <= 1 and (ulps > 0).mean() < 0.01, (ulps.max(), (ulps > 0).mean())
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    np.testing.assert_array_equal(np.asarray(got[1])[0], np.asarray(k2)[0])
    assert not np.array_equal(np.asarray(got[2])[1], np.asarray(v2)[1]), "the step's values must be written"
    donated = jax.jit(one_call, donate_argnums=(1, 2))
    k_in, v_in = jnp.array(k2), jnp.array(v2)
    pointers = k_in.unsafe_buffer_pointer(), v_in.unsafe_buffer_pointer()
    out, k_out, v_out = donated(qkv, k_in, v_in, jnp.int32(1), batch)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == pointers, "the cache is written in place"
    np.testing.assert_array_equal(np.asarray(v_out), np.asarray(want[2]))


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


@pytest.mark.parametrize("specs", [[(40, 1)], [(70, 1), (5, 1)], [(300, 1)], [(250, 1), (130, 1), (9, 1)]],
                         ids=["one-decode", "two-decodes", "one-long-decode", "three-long-decodes"])
@pytest.mark.parametrize("heads,kv_heads,block_size,head_dim,window,soft_cap",
                         CASES[:3] + [(8, 1, 16, 64, None, None)], ids=CASE_IDS[:3] + ["mqa-16x64"])
def test_few_decodes_split_by_kv_heads_match_the_oracle(specs, heads, kv_heads, block_size, head_dim, window,
                                                         soft_cap):
    """One or a few decoding sequences alone: the kernel shares each one's KV heads among the
    threads (each share reading its heads' part of every block), or with one KV head (multi-query,
    or a latent cache) its query heads; a long context is also split into parts whose results
    are merged (split-KV; the sliding window's too)."""
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
from runtime.ops.attention_common import write_kv
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
# on a CPU without AVX-512), and on AVX-512 also without the rows-in-lanes prefill form and the
# 512-bit decode form (RunItem for every item).
_FORMS = ["-mno-avx512f"] + (["-DSERVAX_ATTENTION_NO_LANES -DSERVAX_ATTENTION_NO_DECODE_LANES"]
                             if "avx512f" in cpu_kernels.cpu_flags() else [])


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


def test_cache_dtypes_the_engine_gives_the_kernel():
    """What cache each setting gets: a bfloat16 model caches bfloat16 K/V (computing in float32 on
    packed weights, the layered default; or in bfloat16 in one program, layered=False), kept on CPU
    as its bits (uint16, KVCache.half_bits: XLA:CPU moves those in place); kv_cache_dtype names the
    cache's dtype whatever the model's, on either backend; an int8 cache comes with its scales.
    Greedy tokens: those of the same weights with a float32 cache (the tiny model's margins are
    wide), and nothing leaks."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for settings, dtype, half_bits, backend in [
        (dict(), jnp.float32, None, "cpu"),
        (dict(kv_cache_dtype="float16"), jnp.uint16, "float16", "cpu"),
        (dict(kv_cache_dtype="bfloat16"), jnp.uint16, "bfloat16", "cpu"),
        (dict(kv_cache_dtype="bfloat16", attention_backend="xla"), jnp.uint16, "bfloat16", "xla"),
        (dict(dtype="bfloat16", kv_cache_dtype="float32"), jnp.float32, None, "cpu"),
        (dict(dtype="bfloat16"), jnp.uint16, "bfloat16", "cpu"),
        (dict(dtype="bfloat16", layered=False), jnp.uint16, "bfloat16", "cpu"),
        (dict(dtype="bfloat16", attention_backend="xla"), jnp.uint16, "bfloat16", "xla"),
        (dict(kv_cache_dtype="int8", attention_backend="cpu"), jnp.int8, None, "cpu"),
    ]:
        llm = LLM(model="servax-tiny/llama", max_model_len=128, show_progress=False, enforce_eager=True, **settings)
        cache = llm.engine.programs.kv_cache
        assert (cache.k.dtype, cache.half_bits, cache.attention_backend) == (jnp.dtype(dtype), half_bits, backend)
        assert (cache.k_scale is not None) == (dtype == jnp.int8)
        assert llm.engine.plan.compute_float32 == (settings.get("dtype") == "bfloat16"
                                                   and settings.get("layered", True)), settings
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        tokens[str(settings)] = [o.outputs[0].token_ids for o in outs]
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_usable_blocks  # nothing leaked
        weights = settings.get("dtype", "float32")
        reference = str(dict() if weights == "float32" else dict(dtype=weights, kv_cache_dtype="float32"))
        if settings.get("kv_cache_dtype") != "int8":
            assert tokens[str(settings)] == tokens[reference], settings
    # Attention sinks (gpt-oss) and latent attention (DeepSeek) read a 16-bit cache through XLA's
    # gathers on either backend; the torchax path writes and reads it as the native one does. A
    # float16 cache keeps the float32 cache's tokens (bfloat16's coarser rounding flips a near tie
    # of the tiny DeepSeek's); each 16-bit cache gives the same tokens on both backends.
    for model, backends in [("servax-tiny/gpt_oss", ("auto",)), ("servax-tiny/deepseek_v3", ("auto", "xla")),
                            ("servax-tiny/gpt2", ("auto",))]:
        runs = {}
        for kv, backend in [("auto", "auto")] + [(kv, b) for kv in ("float16", "bfloat16") for b in backends]:
            llm = LLM(model=model, kv_cache_dtype=kv, attention_backend=backend, max_model_len=128,
                      show_progress=False, enforce_eager=True)
            assert llm.engine.programs.kv_cache.half_bits == (None if kv == "auto" else kv)
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
            runs[kv, backend] = [o.outputs[0].token_ids for o in outs]
            assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_usable_blocks
            llm.shutdown()
        for (kv, backend), got in runs.items():
            assert got == runs["auto" if kv == "float16" else kv, "auto"], (model, kv, backend)


# A prompt longer than the tiny Mistral's 24-token window, one chunked over two steps
# (32-token budget), and short ones decoding beside them.
PROMPTS = [[(7 * i + 3) % 500 + 4 for i in range(n)] for n in (40, 5, 17, 2)]


def _tokens_by_backend(model: str, monkeypatch, **engine) -> tuple[dict, dict]:
    """Greedy tokens of PROMPTS on the xla and cpu attention backends, and for each backend whether
    its programs took the one-call rotated attention (runtime.ops.attention.rotated_paged_attention,
    counted as it is traced)."""
    import models_jax.llama as llama

    traced = []
    real = llama.rotated_paged_attention
    monkeypatch.setattr(llama, "rotated_paged_attention", lambda *a, **k: traced.append(a[0].shape) or real(*a, **k))
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens, one_call = {}, {}
    for backend in ("xla", "cpu"):
        llm = LLM(model=model, attention_backend=backend, max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=32, num_kv_blocks=48, block_size=16, enforce_eager=True,
                  show_progress=False, compilation_cache_dir="", **engine)
        assert llm.engine.programs.kv_cache.attention_backend == backend
        assert llm.engine.programs.kv_cache.half_bits == engine.get("kv_cache_dtype")
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
        one_call[backend] = bool(traced)
        traced.clear()
    return tokens, one_call


@pytest.mark.parametrize("model", quick_loop_keeps(["servax-tiny/llama", "servax-tiny/mistral", "servax-tiny/gpt2"],
                                                   "servax-tiny/mistral"))
def test_greedy_tokens_equal_xla_end_to_end(model, servax_cache, monkeypatch):
    """The engine with attention_backend="cpu" gives the XLA backend's tokens: native models
    (Llama; Mistral's sliding window), whose decode steps take the one-call rotated attention,
    and the torchax path (GPT-2)."""
    tokens, one_call = _tokens_by_backend(model, monkeypatch)
    assert one_call == {"xla": False, "cpu": "gpt2" not in model}
    assert tokens["cpu"] == tokens["xla"]


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_a_16_bit_cache_decodes_through_the_one_call_form(kv, servax_cache, monkeypatch):
    """With a float16 / bfloat16 cache (kept as its bits), the tiny Llama's decode steps take the
    one-call rotated attention on the CPU backend and give the XLA backend's tokens with that cache."""
    tokens, one_call = _tokens_by_backend("servax-tiny/llama", monkeypatch, kv_cache_dtype=kv)
    assert one_call == {"xla": False, "cpu": True}
    assert tokens["cpu"] == tokens["xla"]
