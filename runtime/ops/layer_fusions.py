"""A decoder layer's small operations fused into the packed-weight products, for XLA:CPU
(runtime/ops/kernels/layer_fusions.h, whose bodies matmul_formats.cc and matmul_dot.cc compile
for their own products): `norm_matmul`, an RMSNorm and the product after it, and `mlp_block`,
the second half of a pre-norm decoder layer, each one kernel call where a one-token step would
otherwise run a dozen small XLA programs between large products (benchmarks/RESULTS.md, stops 55
and 56). runtime/ops/matmul.py holds the weights (PackedWeight) and the products alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from runtime.ops.cpu_kernels import (DOT_MLP_BLOCK_TARGET, DOT_NORM_MATMUL_TARGET, MLP_BLOCK_TARGET,
                                     NORM_MATMUL_TARGET, kernel_available)
from runtime.ops.matmul import PANEL, PackedWeight, kernel_meta


def _fused_kernel_takes(matrices: tuple, rows: int) -> bool:
    """Whether a kernel's fused calls (`mlp_block`, `norm_matmul`) take these matrices for `rows` rows
    of activations: matmul_dot's where every one is packed for int8 activations (PackedWeight.dot),
    matmul_formats' where every one takes float activations (bfloat16, int8 or 4-bit panels; and
    float32 ones for a single row: with more, matmul.cc's own float32 products, 512-bit where the
    CPU has AVX-512, beat the formats kernel's: benchmarks/RESULTS.md, stop 56); not a mix of the
    two layouts, a matrix not packed, or a kernel not built."""
    if not all(isinstance(m, PackedWeight) for m in matrices):
        return False
    if all(m.dot for m in matrices):
        return kernel_available("matmul_dot")
    if any(m.dot or (m.format == "float32" and rows > 1) or m.format in ("uint5", "uint6") for m in matrices):
        return False
    return kernel_available("matmul_formats")


def _operands(m: PackedWeight) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A packed matrix as the fused calls take it: panels, scales, offsets (empty where it has none)."""
    none = jnp.zeros((0,), jnp.float32)
    return m.panels, none if m.scales is None else m.scales, none if m.offsets is None else m.offsets


def mlp_block_fusable(x: jax.Array, o: object, gate_up: object, down: object) -> bool:
    """Whether `mlp_block` takes this layer: float32 activations, and o, gate_up (gate and up side
    by side) and down packed for one of its kernels (all for int8 activations, or all taking float
    ones; see _fused_kernel_takes) with matching shapes, either all of one stacked layer or none stacked."""
    w = (o, gate_up, down)
    if x.dtype != jnp.float32 or not _fused_kernel_takes(w, x.shape[0]):
        return False
    if len({m.layer is None for m in w}) != 1 or len({m.panels.ndim for m in w}) != 1:
        return False
    d, f = o.shape[1], gate_up.shape[1] // 2
    return x.shape[-1] == d and gate_up.shape == (d, 2 * f) and down.shape == (f, d)


def mlp_block(attn: jax.Array, x: jax.Array, o: PackedWeight, norm: jax.Array, eps: float,
              gate_up: PackedWeight, down: PackedWeight, valid_rows: jax.Array | int | None = None) -> jax.Array:
    """The second half of a pre-norm decoder layer in one call of a C++ kernel
    (runtime/ops/kernels/layer_fusions.h): x1 = x + attn @ o, then x1 + down(silu(gate) * up) with
    [gate, up] = rms_norm(x1) @ gate_up: what the layer computes op by op, each product as
    PackedWeight.matmul computes it (with int8 activations where the matrices are laid out for
    them). attn [M, in of o] and x [M, D] float32; norm [D]; with `valid_rows` only that many
    leading rows are multiplied (the rest come out as x). Only where `mlp_block_fusable`."""
    meta = kernel_meta(x, valid_rows, o.layer)
    operands = [attn.astype(jnp.float32), x, *_operands(o), norm.astype(jnp.float32), *_operands(gate_up),
                *_operands(down), meta]
    target = DOT_MLP_BLOCK_TARGET if o.dot else MLP_BLOCK_TARGET
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, jnp.float32))
    return call(*operands, eps=np.float32(eps), intermediate=np.int64(down.shape[0]))


def norm_matmul_fusable(x: jax.Array, w: object) -> bool:
    """Whether `norm_matmul` takes x and w: float32 x [M, in of w], w packed for one of its kernels
    (see _fused_kernel_takes)."""
    return x.dtype == jnp.float32 and _fused_kernel_takes((w,), x.shape[0]) and x.shape[-1] == w.shape[0]


def norm_matmul(x: jax.Array, norm: jax.Array, eps: float, w: PackedWeight,
                valid_rows: jax.Array | int | None = None) -> jax.Array:
    """rms_norm(x, norm, eps) @ w in one call of a C++ kernel (runtime/ops/kernels/layer_fusions.h):
    what the norm and `w.matmul` compute, without the norm's small programs between. Rows past
    `valid_rows` give zeros. Only where `norm_matmul_fusable`."""
    meta = kernel_meta(x, valid_rows, w.layer)
    target = DOT_NORM_MATMUL_TARGET if w.dot else NORM_MATMUL_TARGET
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w.panels.shape[-3] * PANEL), jnp.float32))
    y = call(x, norm.astype(jnp.float32), *_operands(w), meta, eps=np.float32(eps))
    return y if y.shape[1] == w.out_features else y[:, :w.out_features]
