"""Packed layers stacked for the kernels (runtime/ops/stacked.py, runtime/ops/kernels/panels.h).

Each kernel form reads a stacked PackedWeight at a (traced) layer exactly as it reads that
layer's own matrix; a layer outside the stack is refused, not read past the buffer; what is
stacked and what is not (large plain arrays, LoRA slots); and a packed engine's step takes its
layers as a few stacked arrays while generating transformers' tokens (tests/test_cpu_matmul.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.ops.cpu_kernels import kernel_status
from runtime.ops.matmul import PackedWeight
from runtime.ops.stacked import SMALL_BYTES, StackedLayers, stack, stackable


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    for name in ("matmul", "matmul_formats", "matmul_dot"):
        assert kernel_status(name) == "ok", kernel_status(name)


def _matrix(form: str, d_in: int, d_out: int, seed: int) -> PackedWeight:
    rng = np.random.default_rng(seed)
    if form in ("float32", "bfloat16"):
        return PackedWeight.pack(jnp.asarray(rng.standard_normal((d_in, d_out)), form))
    scales = jnp.asarray(rng.uniform(0.001, 0.02, (d_in // 32, d_out)), jnp.float32)
    if form.startswith("int8"):
        w = PackedWeight.pack_int8(jnp.asarray(rng.integers(-127, 128, (d_in, d_out)), jnp.int8), scales)
    else:
        offsets = jnp.asarray(rng.uniform(-0.2, 0.0, (d_in // 32, d_out)), jnp.float32)
        w = PackedWeight.pack_uint4(jnp.asarray(rng.integers(0, 16, (d_in, d_out)), jnp.uint8), scales, offsets)
    return w.for_int8_activations() if form.endswith("dot") else w


FORMS = ["float32", "bfloat16", "int8", "uint4", "int8 dot", "uint4 dot"]


@pytest.mark.parametrize("form", FORMS)
def test_a_stacked_matrix_is_read_at_its_layer_as_the_layer_alone(form):
    layers = [{"w": _matrix(form, 64, 40, seed), "norm": jnp.full((64,), float(seed))} for seed in range(3)]
    alone = [jax.tree.map(jnp.copy, layer) for layer in layers]  # stack() frees the layers it stacks
    assert stackable(layers)
    stacked = stack(layers)
    assert isinstance(stacked, StackedLayers) and len(stacked) == 3
    assert stacked.params["w"].panels.shape[0] == 3 and stacked.params["norm"].shape == (3, 64)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((5, 64)), jnp.float32)

    @jax.jit
    def at(stacked, i, rows):
        layer = stacked.layer(i)
        return layer["w"].matmul(x, rows) + layer["norm"][:40]

    for i, layer in enumerate(alone):
        assert stacked[i]["w"].shape == (64, 40)
        for rows in (5, 2):
            want = layer["w"].matmul(x, rows) + layer["norm"][:40]
            np.testing.assert_array_equal(np.asarray(at(stacked, jnp.int32(i), jnp.int32(rows))), np.asarray(want))


def test_a_layer_outside_the_stack_is_refused():
    stacked = stack([{"w": _matrix("uint4 dot", 64, 16, seed)} for seed in range(2)])
    x = jnp.ones((1, 64), jnp.float32)
    with pytest.raises(Exception, match="layer < L"):
        jax.block_until_ready(jax.jit(lambda s, i: s.layer(i)["w"].matmul(x))(stacked, jnp.int32(2)))
    with pytest.raises(IndexError):
        stacked[2]


def test_only_packed_matrices_and_small_arrays_are_stacked():
    packed = lambda seed: _matrix("float32", 32, 16, seed)  # noqa: E731
    big = SMALL_BYTES // 4 + 1  # float32 values: one past the size that is sliced per step
    assert stackable([{"w": packed(0), "b": jnp.zeros(8)}, {"w": packed(1), "b": jnp.ones(8)}])
    assert not stackable([{"w": packed(0), "e": jnp.zeros(big)}, {"w": packed(1), "e": jnp.zeros(big)}])
    assert not stackable([{"w": packed(0), "lora": {}}, {"w": packed(1), "lora": {}}])  # written per layer
    assert not stackable([{"w": packed(0)}, {"w": _matrix("float32", 32, 32, 1)}])  # shapes differ
    assert not stackable([{"w": packed(0)}, {"v": packed(1)}])  # structures differ
    assert not stackable([])
