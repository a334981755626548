"""Products with int8-quantized activations (runtime/ops/kernels/matmul_dot.cc, PackedWeight.dot).

Against a NumPy oracle that quantizes each row of x per block of 32 inputs (d = max|x| / 127,
round to nearest) and multiplies in float64: the kernel's integer dot products give exactly that
product up to float32 rounding, for int8 weights with per-channel and grouped scales, 4- and
5-bit weights with scales and offsets (which multiply the rounded inputs too) and 6-bit ones with
a scale per 16 inputs, across the row blocks, padded panels and `valid_rows`, in each
form of the kernel the machine runs (VNNI's vpdpbusd in 512 or 256 bits where the CPU has it,
AVX2's vpmaddubsw); the quads' column gather; and the engine: int8 activations on by default for
a GGUF model's 4-bit weights, close to the float-activation run, and off when asked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import quick_loop_keeps, run_in_fresh_kernel_build
from runtime.ops.cpu_kernels import cpu_flags, kernel_status
from runtime.ops.matmul import PackedWeight


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    assert kernel_status("matmul_dot") == "ok", kernel_status("matmul_dot")


def quantized_rows(x: np.ndarray, block: int) -> np.ndarray:
    """x as the kernel sees it: each row's blocks of `block` inputs rounded to 255 levels (in
    float32, as the kernel scales them: in float64 an input near a half step could round the other way)."""
    m, k = x.shape
    blocks = x.reshape(m, k // block, block).astype(np.float32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    d = amax / np.float32(127)
    q = np.rint(blocks * np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0))
    return (q.astype(np.float64) * d).reshape(m, k)


def _weights(fmt: str, d_in: int, d_out: int, groups: int, rng) -> tuple[PackedWeight, np.ndarray, np.ndarray | None]:
    """(packed weight, its scaled values without offsets [in, out] float64, offsets per input or None).
    fmt "<format>-k": a K-quant's, scales (and offsets) integer codes times a float16 super-scale per
    256 inputs (Q4_K's and Q5_K's 6-bit codes, Q6_K's int8 ones under a super-scale of either sign)."""
    if fmt.endswith("-k"):
        return _k_quant_weights(fmt[:-2], d_in, d_out, groups, rng)
    scales = rng.uniform(0.001, 0.02, (groups, d_out)).astype(np.float32)
    if groups > 1:  # blocks of 32 inputs, as a GGUF file stores them: half-precision scales
        scales = scales.astype(np.float16).astype(np.float32)
    per_input = lambda a: np.repeat(a, d_in // groups, axis=0).astype(np.float64)  # noqa: E731
    if fmt == "int8":
        q = rng.integers(-128, 128, (d_in, d_out))
        return PackedWeight.pack_int8(jnp.asarray(q, jnp.int8), jnp.asarray(scales)), q * per_input(scales), None
    if fmt == "uint6":  # values -32..31 with a scale per 16 inputs (GGUF Q6_K)
        q = rng.integers(-32, 32, (d_in, d_out))
        return PackedWeight.pack_uint6(jnp.asarray(q, jnp.int8), jnp.asarray(scales)), q * per_input(scales), None
    q = rng.integers(0, 32 if fmt == "uint5" else 16, (d_in, d_out))
    offsets = rng.uniform(-0.2, 0.0, (groups, d_out)).astype(np.float16 if groups > 1 else np.float32)
    offsets = offsets.astype(np.float32)
    pack = PackedWeight.pack_uint5 if fmt == "uint5" else PackedWeight.pack_uint4
    packed = pack(jnp.asarray(q, jnp.uint8), jnp.asarray(scales), jnp.asarray(offsets))
    return packed, q * per_input(scales), per_input(offsets)


def _k_quant_weights(fmt: str, d_in: int, d_out: int, groups: int, rng) -> tuple[PackedWeight, np.ndarray,
                                                                                  np.ndarray | None]:
    supers = d_in // 256
    super_scale = lambda: rng.uniform(2e-4, 1e-3, (supers, d_out)).astype(np.float16)  # noqa: E731
    under = lambda d, codes: np.repeat(d.astype(np.float32), groups // supers, axis=0) * codes  # noqa: E731
    per_input = lambda a: np.repeat(a, d_in // groups, axis=0).astype(np.float64)  # noqa: E731
    if fmt == "uint6":
        d = super_scale() * rng.choice(np.array([-1, 1], np.float16), (supers, d_out))
        q, scales = rng.integers(-32, 32, (d_in, d_out)), under(d, rng.integers(-128, 128, (groups, d_out)))
        packed = PackedWeight.pack_uint6(jnp.asarray(q, jnp.int8), jnp.asarray(scales), jnp.asarray(d))
        return packed, q * per_input(scales), None
    d, dmin = super_scale(), super_scale()
    q = rng.integers(0, 32 if fmt == "uint5" else 16, (d_in, d_out))
    scales, offsets = under(d, rng.integers(0, 64, (groups, d_out))), -under(dmin, rng.integers(0, 64, (groups, d_out)))
    pack = PackedWeight.pack_uint5 if fmt == "uint5" else PackedWeight.pack_uint4
    packed = pack(jnp.asarray(q, jnp.uint8), jnp.asarray(scales), jnp.asarray(offsets), jnp.asarray(d),
                  jnp.asarray(-dmin))
    return packed, q * per_input(scales), per_input(offsets)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20, 70])
@pytest.mark.parametrize("fmt,d_in,d_out,groups", [
    ("int8", 64, 1000, 1),  # per output channel: blocks of 32
    ("int8", 36, 40, 1),  # per output channel, 32 does not divide the inputs: one block of 36
    ("int8", 96, 33, 3),  # groups of 32 (GGUF Q8_0)
    ("uint4", 128, 50, 4),  # groups of 32 with offsets (GGUF Q4_0 / Q4_1 / Q4_K)
    ("uint4", 64, 16, 1),  # one group of 64 (two blocks), one panel
    ("uint5", 160, 50, 5),  # groups of 32 with offsets (GGUF Q5_0 / Q5_1 / Q5_K)
    ("uint5", 64, 16, 1),  # one group of 64 (two blocks), one panel
    ("uint6", 128, 50, 8),  # groups of 16 (GGUF Q6_K): two scales a block of 32
    ("uint6", 48, 20, 3),  # 32 does not divide the inputs: one block of 48, three scales
    ("int8", 1056, 17, 33), ("uint4", 2080, 24, 65), ("uint6", 2112, 20, 132),  # the inputs of real layers
    # K-quants (Q4_K, Q5_K, Q6_K): their scales (offsets) as codes under a super-scale per 256 inputs
    ("uint4-k", 512, 50, 16), ("uint5-k", 768, 33, 24), ("uint6-k", 512, 40, 32), ("uint4-k", 2048, 24, 64),
])
def test_int8_activation_products_match_the_quantized_oracle(fmt, d_in, d_out, groups, rows):
    rng = np.random.default_rng(rows * 7 + d_out)
    packed, scaled, offsets = _weights(fmt, d_in, d_out, groups, rng)
    dot, fmt = packed.for_int8_activations(), fmt.removesuffix("-k")
    assert dot.dot and dot.format == fmt and dot.shape == (d_in, d_out)
    assert dot.panels.shape == (-(-d_out // 16), d_in // 4, {"uint4": 32, "uint5": 40, "uint6": 48, "int8": 64}[fmt])
    # blocks of 32 keep their scales (and offsets) in half precision, per-channel scales in float32, K-quants codes
    half = (jnp.int8 if fmt == "uint6" else jnp.uint8) if packed.super_scales is not None else (
        jnp.float16 if groups > 1 else jnp.float32)
    assert dot.scales.dtype == half and (dot.offsets is None or dot.offsets.dtype == half) and dot.super_scales is None
    for stored, kept in zip(dot.group_scales(), (packed.scales, packed.offsets)):  # exactly, codes or halves
        assert kept is None if stored is None else np.array_equal(np.asarray(stored), np.asarray(kept))
    x = rng.standard_normal((rows, d_in)).astype(np.float32)
    valid = max(rows - 1, 1)
    got = np.asarray(jax.jit(lambda x, w: w.matmul(x, valid))(jnp.asarray(x), dot))
    block = 32 if d_in % 32 == 0 and (d_in // groups) % (16 if fmt == "uint6" else 32) == 0 else d_in
    xq = quantized_rows(x, block)  # offsets too multiply the rounded inputs (their sum per block)
    want = xq @ scaled + (0 if offsets is None else xq @ offsets)
    np.testing.assert_allclose(got[:valid], want[:valid], rtol=1e-4, atol=1e-4)
    assert not got[valid:].any()
    exact = x.astype(np.float64) @ (scaled if offsets is None else scaled + offsets)
    assert np.abs(got[:valid] - exact[:valid]).max() < 0.02 * np.abs(exact).max()  # ~1% of the scale
    # a tied head's embedding rows, gathered from the quads
    rows_of_w = (scaled + (0 if offsets is None else offsets)).T
    np.testing.assert_allclose(np.asarray(dot.columns(jnp.arange(d_out))), np.asarray(packed.columns(jnp.arange(d_out))))
    np.testing.assert_allclose(np.asarray(dot.columns(jnp.arange(d_out))), rows_of_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows", [5, 40])
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("bits", [4, 5, 6])
def test_4_to_6bit_sums_at_their_largest_do_not_saturate(sign, bits, rows):
    """Every weight at its largest (15, 31, or 63 stored: 31 after 6-bit values' centre) and every
    input at the block's maximum: the int16 sums of a 4-bit block (8 quads x 2 x 15 x 127), of a
    5-bit one (4 quads x 2 x 31 x 127) and a 6-bit quad's (2 x 63 x 127) reach their bound and must
    still be exact, in row blocks (DotRows512) and in the many-row form (DotTile: unpacked bytes)."""
    d_in, d_out, top = 256, 32, 2**bits - 1
    groups = d_in // (16 if bits == 6 else 32)
    scales = np.full((groups, d_out), 0.5, np.float32)
    offsets = np.full((groups, d_out), -0.25 if bits < 6 else 0.0, np.float32)
    if bits == 6:
        packed, top = PackedWeight.pack_uint6(jnp.full((d_in, d_out), 31, jnp.int8), jnp.asarray(scales)), 31
    else:
        pack = PackedWeight.pack_uint5 if bits == 5 else PackedWeight.pack_uint4
        packed = pack(jnp.full((d_in, d_out), top, jnp.uint8), jnp.asarray(scales), jnp.asarray(offsets))
    x = np.full((rows, d_in), 3.0 * sign, np.float32)
    got = np.asarray(jax.jit(lambda x, w: w.matmul(x))(jnp.asarray(x), packed.for_int8_activations()))
    np.testing.assert_allclose(got, np.full((rows, d_out), sign * 3.0 * d_in * (top * 0.5 + offsets[0, 0])), rtol=1e-6)


_ORACLE_TESTS = """
import pytest
code = pytest.main(["-q", "-p", "no:cacheprovider", "tests/test_matmul_dot.py", "-m", "not slow",
                    "-k", "oracle or saturate"])
print("ok" if code == 0 else f"pytest exit code {code}")
"""


# The forms -march=native would not pick here: AVX2's vpmaddubsw (AMD Zen 2/3, older Intel; built
# with VNNI off) where the CPU has VNNI, and the 256-bit VNNI form (AVX-VNNI CPUs without AVX-512)
# where it has AVX-512 VNNI, whose 512-bit form (DotRows512) the tests above run.
_FORMS = (["-mno-avx512vnni -mno-avxvnni"] if {"avx512_vnni", "avx_vnni"} & cpu_flags() else []) + (
    ["-DSERVAX_DOT_NO_512"] if {"avx512_vnni", "avx512bw"} <= cpu_flags() else [])


@pytest.mark.skipif(not _FORMS, reason="no VNNI: the other tests run the AVX2 form")
@pytest.mark.parametrize("flags", _FORMS)
@pytest.mark.slow
def test_each_other_form_matches_the_oracle(tmp_path, flags):
    """The tests above run the form -march=native picks; each other form this CPU can run must
    pass them too."""
    run_in_fresh_kernel_build(tmp_path, flags, _ORACLE_TESTS)


def test_weights_the_kernel_cannot_take_keep_their_layout():
    rng = np.random.default_rng(0)
    floats = PackedWeight.pack(jnp.asarray(rng.standard_normal((64, 16)), jnp.float32))
    odd = PackedWeight.pack_int8(jnp.ones((30, 16), jnp.int8), jnp.ones((1, 16)))  # inputs not in quads
    small_groups = PackedWeight.pack_uint4(jnp.ones((48, 16), jnp.uint8), jnp.ones((3, 16)), jnp.zeros((3, 16)))
    for w in (floats, odd, small_groups):  # groups of 16 inputs are not whole blocks of 32
        assert w.for_int8_activations() is w
    dot = PackedWeight.pack_int8(jnp.ones((64, 16), jnp.int8), jnp.ones((2, 16))).for_int8_activations()
    assert dot.for_int8_activations() is dot
    # super-scales whose codes the kernel would not read as such (groups of 64 inputs): float16 scales
    wide_groups = PackedWeight.pack_uint4(jnp.ones((256, 16), jnp.uint8), jnp.ones((4, 16)), jnp.zeros((4, 16)),
                                          jnp.ones((1, 16)), -jnp.ones((1, 16))).for_int8_activations()
    assert wide_groups.scales.dtype == jnp.float16 and wide_groups.super_scales is None


@pytest.mark.parametrize("weight_type", quick_loop_keeps(["Q4_1", "Q8_0"], "Q4_1"))
def test_gguf_model_multiplies_int8_activations_by_default(tiny_checkpoint, tmp_path, weight_type):
    """quantization="gguf" packs its int8/4-bit matrices for int8 activations unless asked not to;
    greedy tokens and logprobs close to the float-activation products of the same weights, and
    nothing compiles while serving."""
    from app import LLM
    from test_gguf import teacher_forced, write_gguf

    gguf_file = write_gguf(tiny_checkpoint("llama"), tmp_path / f"tiny-{weight_type}.gguf", weight_type=weight_type)
    prompt = [(7 * i + 3) % 500 + 4 for i in range(40)]
    runs = {}
    for int8_activations in (None, False):
        llm = LLM(model=str(gguf_file), quantization="gguf", max_model_len=128, max_num_seqs=4, show_progress=False,
                  max_num_batched_tokens=32, compilation_cache_dir="", int8_activations=int8_activations)
        runs[int8_activations] = (llm, *teacher_forced(llm, prompt))  # chunked: 2 prefill steps
        assert llm.engine.stats().compilations_since_warmup == 0
    (llm, lp, top), (float_llm, float_lp, float_top) = runs[None], runs[False]
    assert llm.engine.plan.int8_activations and not float_llm.engine.plan.int8_activations
    assert llm.engine.model.params["layers"][0]["mlp"]["gate_up"].dot
    assert not float_llm.engine.model.params["layers"][0]["mlp"]["gate_up"].dot
    diff = np.abs(lp - float_lp)  # a random model's flat logits: bounds as for int8 weights (test_quantization)
    assert diff.max() < 0.3 and diff.mean() < 0.1, (diff.max(), diff.mean())
    assert np.mean(np.array(top) == np.array(float_top)) >= 0.7  # (a broken product: ~0; the demo: benchmarks)
