"""Matrix products on pre-packed weights, for XLA:CPU (runtime/ops/kernels/matmul.cc).

A decode step multiplies a few rows (one per sequence) by every weight matrix of the model,
each read once a step: it is bound by how fast the weights stream in. XLA:CPU's GEMM repacks
its weight operand on every call; the kernel reads the weights in the layout it multiplies
in, packed once at load: `PackedWeight.pack(w)` stores w [in, out] as panels of 16 output
columns, `panels[p, k, j] = w[k, 16 p + j]`, shape [ceil(out / 16), in, 16] (zero columns
pad the last panel). On CPUs with full-width AVX-512 the kernel multiplies two panels a pass
in 512-bit registers. The measurements behind these choices are in benchmarks/RESULTS.md
(stops 36 and 38).

`x @ packed` works as with the array it came from (PackedWeight defines `__rmatmul__`), so
model code reads either form; the native models pack their layers' joined projections and
LM head where the runtime runs its CPU kernels (attention backend "cpu"), the weights are
float32 and whole on every device, and the CPU has AVX2 and FMA (elsewhere the kernel's
portable loops would be slower than XLA); see runtime/ops/layered.py.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from runtime.ops.cpu_kernels import GROUPED_MATMUL_TARGET, MATMUL_TARGET, cpu_flags, kernel_available, kernel_status

PANEL = 16  # output columns per packed panel (runtime/ops/kernels/matmul.cc kPanel)


def packed_matmul_available() -> bool:
    """Whether the packed matmul kernel is built, registered and fast on this CPU."""
    return kernel_available("matmul") and {"avx2", "fma"} <= cpu_flags()


@flax.struct.dataclass
class PackedWeight:
    """A float32 matrix w [in, out] in the kernel's layout: panels [ceil(out / 16), in, 16]."""

    panels: jax.Array
    out_features: int = flax.struct.field(pytree_node=False)

    @classmethod
    def pack(cls, w: jax.Array) -> "PackedWeight":
        """w [in, out] (any float dtype; stored float32) in the packed layout."""
        d_in, d_out = w.shape
        w = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, -d_out % PANEL)))
        return cls(w.reshape(d_in, -1, PANEL).transpose(1, 0, 2), d_out)

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the matrix it packs, [in, out]."""
        return self.panels.shape[1], self.out_features

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        """x [M, in] @ w -> [M, out] float32, by the C++ kernel."""
        return self.matmul(x)

    def matmul(self, x: jax.Array, valid_rows: jax.Array | int | None = None) -> jax.Array:
        """x [M, in] @ w -> [M, out] float32, by the C++ kernel; with `valid_rows` (a traced
        int: a step's real tokens or sequences) only that many leading rows are multiplied and
        the rest of the result is zeros.

        Raises:
            RuntimeError: the kernel is not available (`kernel_status("matmul")` says why).
        """
        if not kernel_available("matmul"):
            raise RuntimeError(f"the CPU matmul kernel is not available: {kernel_status('matmul')}")
        rows = x.shape[0] if valid_rows is None else valid_rows
        call = jax.ffi.ffi_call(MATMUL_TARGET, jax.ShapeDtypeStruct((x.shape[0], self.panels.shape[0] * PANEL),
                                                                    jnp.float32))
        y = call(x.astype(jnp.float32), self.panels, jnp.reshape(jnp.asarray(rows, jnp.int32), (1,)))
        return y if y.shape[1] == self.out_features else y[:, :self.out_features]

    def columns(self, ids: jax.Array) -> jax.Array:
        """Columns `ids` of w, as rows: [len(ids), in] (a tied embedding's rows, w = table.T)."""
        return self.panels[ids // PANEL, :, ids % PANEL]


@flax.struct.dataclass
class PackedExperts:
    """Experts' float32 matrices w [E, in, out], each packed as PackedWeight packs one:
    panels [E, ceil(out / 16), in, 16]. `grouped_matmul` multiplies each expert by the rows
    routed to it only (models_jax/moe.py)."""

    panels: jax.Array
    out_features: int = flax.struct.field(pytree_node=False)

    @classmethod
    def pack(cls, w: jax.Array) -> "PackedExperts":
        """w [E, in, out] (any float dtype; stored float32) in the packed layout."""
        e, d_in, d_out = w.shape
        w = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, 0), (0, -d_out % PANEL)))
        return cls(w.reshape(e, d_in, -1, PANEL).transpose(0, 2, 1, 3), d_out)

    @property
    def shape(self) -> tuple[int, int, int]:
        """The shape of the matrices it packs, [E, in, out]."""
        return self.panels.shape[0], self.panels.shape[2], self.out_features

    def grouped_matmul(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """x [M, in] with its rows sorted by expert, group_sizes[e] rows for expert e, ->
        [M, out] float32: each group times its expert's matrix; rows past the groups are zeros.

        Raises:
            RuntimeError: the kernel is not available (`kernel_status("matmul")` says why).
        """
        if not kernel_available("matmul"):
            raise RuntimeError(f"the CPU matmul kernel is not available: {kernel_status('matmul')}")
        call = jax.ffi.ffi_call(GROUPED_MATMUL_TARGET,
                                jax.ShapeDtypeStruct((x.shape[0], self.panels.shape[1] * PANEL), jnp.float32))
        y = call(x.astype(jnp.float32), self.panels, group_sizes.astype(jnp.int32))
        return y if y.shape[1] == self.out_features else y[:, :self.out_features]


def packable(w: object) -> bool:
    """Whether w is weights the kernel takes: a float32 jax.Array (not bfloat16, quantized, or
    packed already)."""
    return isinstance(w, jax.Array) and w.dtype == jnp.float32


def pack_matrix(w: object) -> object:
    """w packed when it is a packable matrix [in, out]; anything else as it is."""
    return PackedWeight.pack(w) if packable(w) and w.ndim == 2 else w
