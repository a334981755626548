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
import numpy as np

from runtime.ops.quantization import QuantizedWeight, quantize_int8
from runtime.ops.cpu_kernels import (BF16_MATMUL_TARGET, GROUPED_MATMUL_TARGET, INT8_DOT_TARGET, INT8_MATMUL_TARGET,
                                     MATMUL_TARGET, UINT4_DOT_TARGET, UINT4_MATMUL_TARGET, cpu_flags, kernel_available,
                                     kernel_library, kernel_status)

PANEL = 16  # output columns per packed panel (runtime/ops/kernels/matmul.cc kPanel)


def packed_matmul_available() -> bool:
    """Whether the packed matmul kernel is built, registered and fast on this CPU."""
    return kernel_available("matmul") and {"avx2", "fma"} <= cpu_flags()


def bfloat16_products_round_activations() -> bool:
    """Whether the kernel multiplies bfloat16 weights with the activations rounded to bfloat16:
    where the CPU has AVX-512 BF16 (AMD Zen 4, Intel Cooper Lake and Sapphire Rapids) it takes
    vdpbf16ps, products of bfloat16 pairs summed in float32, for every batch size (a bfloat16
    model's activations in bfloat16, as other servers compute them; float32 accumulation);
    elsewhere it widens the weights and multiplies x in float32."""
    library = kernel_library("matmul_formats")
    return bool(library is not None and library.ServaxBf16RoundsActivations())


@flax.struct.dataclass
class PackedWeight:
    """A matrix w [in, out] in the kernel's layout, panels [ceil(out / 16), in, 16], its values
    kept in the format they were stored in:

    - float32 or bfloat16 panels: the weights themselves;
    - int8 panels with `scales` [panels, G, 16]: w = q * scale, one scale per column and group
      of in / G consecutive inputs (G = 1: per output channel, `quantization="int8"`; groups of
      32: GGUF's Q8_0 as stored);
    - uint8 panels [.., in, 8] holding two 4-bit values a byte (column j in the low nibble of
      byte j, column j + 8 in its high one) with `scales` and `offsets`: w = q * scale + offset
      (GGUF's Q4_0, Q4_1 and Q4_K as stored);
    - uint8 panels [.., in, 16] of 5-bit values, one a byte, with `scales` and `offsets` likewise
      (GGUF's Q5_0, Q5_1 and Q5_K as stored): only laid out for int8 activations they multiply;
    - uint8 panels [.., in, 16] of 6-bit values q, one a byte, with `scales` and no offsets:
      w = (q - 32) * scale, a scale per 16 inputs (GGUF's Q6_K as stored), likewise.

    GGUF's K-quants (Q4_K, Q5_K, Q6_K) also keep the super-scales their scales (and offsets) are
    integer multiples of, `super_scales` (`super_offsets`) [panels, G / per, 16] for `per` groups a
    super-block of 256 inputs.

    With `dot` (`for_int8_activations`), int8, 4- and 5-bit panels are laid out for products with
    the activations quantized to int8 (runtime/ops/kernels/matmul_dot.cc): their inputs in
    quads, panels [.., in / 4, 64] int8 (16 columns x 4 inputs, column-major), [.., in / 4, 32]
    uint8 (columns 0-7 in the low nibbles, 8-15 in the high ones), [.., in / 4, 40] uint8 (those
    32 bytes, then the values' fifth bits, 32 for the low nibbles' and 32 for the high ones') or
    [.., in / 4, 48] uint8 (then their sixth bits likewise), the same scales and offsets; K-quants'
    scales and offsets become their codes, uint8 (int8 for Q6_K) [.., G / per * (per + 2), 16]: each
    super-block's `per` rows of 16 codes, then its 16 float16 super-scales as 32 bytes
    (matmul_dot.cc CodedScales; `group_scales` decodes them).

    Stacked (runtime/ops/stacked.py), panels, scales and offsets have a leading layer axis
    [L, ...], and `at_layer(i)` is the matrix of layer i: `layer` set, which the kernels read
    in place.
    """

    panels: jax.Array
    out_features: int = flax.struct.field(pytree_node=False)
    scales: jax.Array | None = None
    offsets: jax.Array | None = None
    dot: bool = flax.struct.field(pytree_node=False, default=False)
    layer: jax.Array | None = None  # of stacked panels: the layer this matrix is (int32 scalar)
    super_scales: jax.Array | None = None  # K-quants' until laid out for int8 activations
    super_offsets: jax.Array | None = None

    @classmethod
    def pack(cls, w: jax.Array) -> "PackedWeight":
        """w [in, out] in the packed layout: bfloat16 as it is, any other float as float32."""
        dtype = jnp.bfloat16 if w.dtype == jnp.bfloat16 else jnp.float32
        return cls(_panels(w.astype(dtype)), w.shape[1])

    @classmethod
    def pack_int8(cls, q: jax.Array, scales: jax.Array) -> "PackedWeight":
        """q [in, out] int8 with scales [G, out] (G dividing in): w = q * scale of its group."""
        return cls(_panels(q), q.shape[1], _panels(scales.astype(jnp.float32)))

    @classmethod
    def pack_uint5(cls, q: jax.Array, scales: jax.Array, offsets: jax.Array, super_scales: jax.Array | None = None,
                   super_offsets: jax.Array | None = None) -> "PackedWeight":
        """q [in, out] holding values 0..31 (any integer dtype) with scales and offsets [G, out]:
        w = q * scale + offset of its group (GGUF's Q5_0, Q5_1 and Q5_K as stored; Q5_K's
        super-scales [in / 256, out], see the class). One value a byte until laid out for int8
        activations (`for_int8_activations`), the only products 5-bit values have;
        `for_float_activations` requantizes them to int8 blocks of 32."""
        return cls(_panels(q.astype(jnp.uint8)), q.shape[1], _panels(scales.astype(jnp.float32)),
                   _panels(offsets.astype(jnp.float32)), **_super_panels(super_scales, super_offsets))

    @classmethod
    def pack_uint6(cls, q: jax.Array, scales: jax.Array, super_scales: jax.Array | None = None) -> "PackedWeight":
        """q [in, out] holding values -32..31 (any integer dtype) with scales [G, out]: w = q * scale
        of its group (GGUF's Q6_K as stored, groups of 16, super-scales [in / 256, out]), kept as q +
        32. Multiplied as 5-bit values are (`pack_uint5`); `for_float_activations` gives them as
        int8 panels."""
        values = (q.astype(jnp.int16) + 32).astype(jnp.uint8)
        return cls(_panels(values), q.shape[1], _panels(scales.astype(jnp.float32)), **_super_panels(super_scales))

    @classmethod
    def pack_uint4(cls, q: jax.Array, scales: jax.Array, offsets: jax.Array, super_scales: jax.Array | None = None,
                   super_offsets: jax.Array | None = None) -> "PackedWeight":
        """q [in, out] holding values 0..15 (any integer dtype) with scales and offsets [G, out]:
        w = q * scale + offset of its group (Q4_K's super-scales [in / 256, out], see the class)."""
        panels = _panels(q.astype(jnp.uint8))
        nibbles = panels[..., :PANEL // 2] | (panels[..., PANEL // 2:] << 4)
        return cls(nibbles, q.shape[1], _panels(scales.astype(jnp.float32)), _panels(offsets.astype(jnp.float32)),
                   **_super_panels(super_scales, super_offsets))

    def for_int8_activations(self) -> "PackedWeight":
        """The same weights laid out for products with int8-quantized activations (`dot`), where
        they are int8, 4- or 5-bit values whose groups are whole blocks of 32 inputs (6-bit ones:
        of 16), or per-channel scales on inputs in quads; else self.

        Grouped scales and offsets (GGUF's blocks: Q8_0, Q4 and Q5 types per 32 inputs, Q6_K per
        16) are kept in float16, as the file stores them, or where they come with super-scales
        (K-quants, inputs a multiple of 256) as the file's codes under them (exactly); per-channel
        scales stay float32."""
        assert self.panels.ndim == 3, "lay out each layer's matrices before stacking them"
        d_in = self.shape[0]
        group = d_in // self.scales.shape[1] if self.scales is not None else 0
        fmt = self.format
        if self.dot or self.scales is None or d_in % 4 or (group % (16 if fmt == "uint6" else 32)
                                                             and self.scales.shape[1] != 1):
            return self
        half_scales = self.scales.shape[1] > 1  # grouped: GGUF's blocks
        scaled = {"super_scales": None, "super_offsets": None}  # into the codes' rows below, or not read
        if half_scales:
            scaled["scales"] = self.scales.astype(jnp.float16)
            if self.offsets is not None:
                scaled["offsets"] = self.offsets.astype(jnp.float16)
        per_code = 16 if fmt == "uint6" else 32  # inputs a K-quant's code scales (matmul_dot.cc CodedScales)
        if self.super_scales is not None and group == per_code and self.super_scales.shape[1] * SUPER_BLOCK == d_in:
            scaled["scales"] = _coded(self.scales, self.super_scales, jnp.int8 if fmt == "uint6" else jnp.uint8)
            if self.offsets is not None:
                scaled["offsets"] = _coded(self.offsets, self.super_offsets, jnp.uint8)
        values = _nibbles(self.panels) if fmt == "uint4" else self.panels  # [P, in, 16]
        quads = values.reshape(values.shape[0], d_in // 4, 4, PANEL).transpose(0, 1, 3, 2)  # [P, in/4, 16, 4]
        if fmt == "int8":
            return self.replace(panels=quads.reshape(quads.shape[0], d_in // 4, 4 * PANEL), dot=True, **scaled)
        half = PANEL // 2
        low, high = (quads[:, :, :half].reshape(quads.shape[0], d_in // 4, 4 * half),
                     quads[:, :, half:].reshape(quads.shape[0], d_in // 4, 4 * half))
        # after the nibbles, each higher bit of the quad's values: bit b of 32 little-endian ones, low values then high
        planes = [jnp.sum(((half_values >> bit) & 1).astype(jnp.int32).reshape(*half_values.shape[:2], 4, 8)
                          << jnp.arange(8, dtype=jnp.int32), axis=-1).astype(jnp.uint8)
                  for bit in range(4, {"uint4": 4, "uint5": 5, "uint6": 6}[fmt]) for half_values in (low, high)]
        return self.replace(panels=jnp.concatenate([(low & 15) | ((high & 15) << 4), *planes], axis=-1), dot=True,
                            **scaled)

    def for_float_activations(self) -> "PackedWeight":
        """A matrix the float-activation kernels take: 5-bit values (which only the int8-activation
        products read) requantized to int8 blocks of 32 inputs (a float32 scale each, the block's
        largest |weight| / 127: each weight within 1/254 of it), 6-bit ones as int8 values (exactly);
        any other as it is."""
        if self.super_scales is not None and not self.dot:  # read by the int8-activation products only
            return self.replace(super_scales=None, super_offsets=None).for_float_activations()
        if self.format not in ("uint5", "uint6") or self.dot:
            return self
        assert self.panels.ndim == 3, "lay out each layer's matrices before stacking them"
        if self.format == "uint6":
            return self.replace(panels=(self.panels.astype(jnp.int16) - 32).astype(jnp.int8))
        d_in = self.shape[0]
        group = d_in // self.scales.shape[1]
        w = (self.panels.astype(jnp.float32) * jnp.repeat(self.scales, group, axis=1)
             + jnp.repeat(self.offsets, group, axis=1))  # [P, in, 16]
        blocks = quantize_int8(w.reshape(w.shape[0], d_in // 32, 32, PANEL), reduce_axes=(2,))
        return self.replace(panels=blocks.q.reshape(w.shape), scales=blocks.scale[:, :, 0], offsets=None)

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the matrix it packs, [in, out] (of one layer, where stacked)."""
        return self.panels.shape[-2] * (4 if self.dot else 1), self.out_features

    def at_layer(self, layer: int | jax.Array) -> "PackedWeight":
        """Layer `layer`'s matrix of a stacked one (panels [L, ...]), read in place by the kernels."""
        assert self.panels.ndim == 4, "not a stack of layers' matrices"
        return self.replace(layer=jnp.asarray(layer, jnp.int32))

    @property
    def format(self) -> str:
        """"float32", "bfloat16", "int8", "uint4", "uint5" or "uint6" (5-bit values have offsets and
        panels wider than 4-bit ones', 6-bit ones uint8 panels and no offsets)."""
        if self.offsets is None:
            return "uint6" if self.panels.dtype == jnp.uint8 else str(self.panels.dtype)
        return "uint5" if self.panels.shape[-1] == (40 if self.dot else PANEL) else "uint4"

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        """x [M, in] @ w -> [M, out] in x's dtype, by the C++ kernel."""
        return self.matmul(x)

    def matmul(self, x: jax.Array, valid_rows: jax.Array | int | None = None, dtype: jnp.dtype | None = None
               ) -> jax.Array:
        """x [M, in] @ w -> [M, out] in `dtype` (default x's; float32 accumulation), by the C++
        kernel; with `valid_rows` (a traced int: a step's real tokens or sequences) only that
        many leading rows are multiplied and the rest of the result is zeros.

        Raises:
            RuntimeError: the kernel is not available (`kernel_status(...)` says why).
        """
        kernel = "matmul_dot" if self.dot else "matmul" if self.format == "float32" else "matmul_formats"
        if self.format in ("uint5", "uint6") and not self.dot:
            raise ValueError("5- and 6-bit values are multiplied with int8 activations only: lay them out with "
                             "for_int8_activations(), or convert them with for_float_activations()")
        if not kernel_available(kernel):
            raise RuntimeError(f"the CPU {kernel} kernel is not available: {kernel_status(kernel)}")
        meta = kernel_meta(x, valid_rows, self.layer)
        target = ({"int8": INT8_DOT_TARGET, "uint4": UINT4_DOT_TARGET, "uint5": UINT4_DOT_TARGET,
                   "uint6": UINT4_DOT_TARGET} if self.dot else
                  {"float32": MATMUL_TARGET, "bfloat16": BF16_MATMUL_TARGET, "int8": INT8_MATMUL_TARGET,
                   "uint4": UINT4_MATMUL_TARGET})[self.format]
        quantized = [a for a in (self.scales, self.offsets) if a is not None]
        if self.format == "uint6":  # the 4-bit call's offsets operand, unread
            quantized.append(jnp.zeros((0,), jnp.float32))
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], self.panels.shape[-3] * PANEL), jnp.float32))
        y = call(x.astype(jnp.float32), self.panels, *quantized, meta)
        return (y if y.shape[1] == self.out_features else y[:, :self.out_features]).astype(dtype or x.dtype)

    def columns(self, ids: jax.Array) -> jax.Array:
        """Columns `ids` of w, as rows: [len(ids), in] (a tied embedding's rows, w = table.T), in
        the panels' float dtype (float32 for quantized panels)."""
        assert self.panels.ndim == 3, "the columns of a stack of layers' matrices"
        p, j = ids // PANEL, ids % PANEL
        if self.scales is None:
            return self.panels[p, :, j]
        fmt, upper = self.format, (j >= PANEL // 2)[:, None]
        if not self.dot:  # one value a byte (two for 4-bit ones)
            byte = self.panels[p, :, j % (PANEL // 2) if fmt == "uint4" else j]
            q = jnp.where(upper, byte >> 4, byte & 15) if fmt == "uint4" else byte
        else:  # column j's 4 bytes of each quad: [len(ids), in / 4, 4] -> [len(ids), in]
            quads = self.panels[p]
            at = (j if fmt == "int8" else j % (PANEL // 2))[:, None, None] * 4 + jnp.arange(4)

            def gather(a: jax.Array, at: jax.Array) -> jax.Array:
                return jnp.take_along_axis(a, jnp.broadcast_to(at, (len(ids), quads.shape[1], 4)), axis=2).reshape(
                    len(ids), -1)

            byte = gather(quads, at)
            q = byte if fmt == "int8" else jnp.where(upper, byte >> 4, byte & 15)
            if fmt in ("uint5", "uint6"):  # their higher bits, 64 a bit: the low values' 32, then the high ones'
                bits = (quads[:, :, 32:, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
                bits = bits.reshape(len(ids), quads.shape[1], -1)
                for plane in range(bits.shape[-1] // 64):
                    q = q | (gather(bits, at + 32 * upper[:, :, None] + 64 * plane) << (4 + plane))
        q = q.astype(jnp.float32) - (32 if fmt == "uint6" else 0)
        scales, offsets = self.group_scales()
        group = self.shape[0] // scales.shape[1]
        scale = jnp.repeat(scales[p, :, j], group, axis=1)
        if offsets is None:
            return q * scale
        return q * scale + jnp.repeat(offsets[p, :, j], group, axis=1)

    def group_scales(self) -> tuple[jax.Array, jax.Array | None]:
        """The scales and offsets (None where there are none) as float32 [(L,) panels, G, 16],
        K-quant codes multiplied out."""
        return tuple(None if a is None else _decoded(a, self.shape[0]) for a in (self.scales, self.offsets))


def kernel_meta(x: jax.Array, valid_rows: jax.Array | int | None, layer: jax.Array | None) -> jax.Array:
    """The kernels' int32 operand `meta` (here and in runtime/ops/layer_fusions.py): [valid rows]
    (x's rows where None), and the layer of a stacked operand after it (runtime/ops/kernels/panels.h
    ViewLayer)."""
    rows = jnp.reshape(jnp.asarray(x.shape[0] if valid_rows is None else valid_rows, jnp.int32), (1,))
    return rows if layer is None else jnp.concatenate([rows, jnp.reshape(layer, (1,))])


def is_packed(x: object) -> bool:
    """Whether x is a PackedWeight (an `is_leaf` for tree functions that treat one as a whole)."""
    return isinstance(x, PackedWeight)


SUPER_BLOCK = 256  # inputs per K-quant super-scale (matmul_dot.cc kSuperBlock)


def _super_panels(super_scales: jax.Array | None, super_offsets: jax.Array | None = None) -> dict:
    """K-quants' super-scales (and offsets') [in / 256, out] as PackedWeight's fields (panels)."""
    return {name: _panels(a.astype(jnp.float32)) for name, a in
            (("super_scales", super_scales), ("super_offsets", super_offsets)) if a is not None}


def _coded(scales: jax.Array, supers: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Scales [P, G, 16] that are integer multiples of their super-scales [P, S, 16] (a super-block
    of per = G / S groups) as matmul_dot.cc's CodedScales: [P, S * (per + 2), 16] of `dtype`, each
    super-block's per rows of codes, then its float16 super-scales' 32 bytes."""
    p, groups, _ = scales.shape
    blocks = supers.shape[1]
    per, under = groups // blocks, supers.reshape(p, blocks, 1, PANEL)
    codes = jnp.round(scales.reshape(p, blocks, per, PANEL) / jnp.where(under == 0, 1, under))
    halves = jax.lax.bitcast_convert_type(supers.astype(jnp.float16), dtype)  # [P, S, 16, 2]: the bytes in order
    return jnp.concatenate([codes.astype(dtype), halves.reshape(p, blocks, 2, PANEL)], axis=2).reshape(
        p, blocks * (per + 2), PANEL)


def _decoded(scales: jax.Array, d_in: int) -> jax.Array:
    """Scales or offsets [.., rows, 16] as float32 [.., G, 16]: K-quant codes (`_coded`) multiplied
    out, any other as it is."""
    if scales.dtype not in (jnp.uint8, jnp.int8):
        return scales.astype(jnp.float32)
    lead, blocks = scales.shape[:-2], d_in // SUPER_BLOCK
    per = scales.shape[-2] // blocks - 2
    rows = scales.reshape(*lead, blocks, per + 2, PANEL)
    supers = jax.lax.bitcast_convert_type(rows[..., per:, :].reshape(*lead, blocks, PANEL, 2), jnp.float16)
    return (rows[..., :per, :].astype(jnp.float32) * supers[..., None, :].astype(jnp.float32)).reshape(
        *lead, blocks * per, PANEL)


def _nibbles(packed: jax.Array) -> jax.Array:
    """4-bit panels [P, in, 8] (two columns a byte) as their values [P, in, 16] uint8."""
    return jnp.concatenate([packed & 15, packed >> 4], axis=-1)


def _panels(w: jax.Array) -> jax.Array:
    """w [in, out] as panels [ceil(out / 16), in, 16] (zero columns pad the last panel)."""
    w = jnp.pad(w, ((0, 0), (0, -w.shape[1] % PANEL)))
    return w.reshape(w.shape[0], -1, PANEL).transpose(1, 0, 2)


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
    """Whether the kernels take w as it is: a float32 array (the matmul kernel), a bfloat16 one, or
    a QuantizedWeight with scales per output channel or per group of its last input axis (the
    formats kernel); not what is packed already."""
    if isinstance(w, QuantizedWeight):
        return kernel_available("matmul_formats") and _input_groups(w) is not None
    return isinstance(w, jax.Array) and (
        w.dtype == jnp.float32 or (w.dtype == jnp.bfloat16 and kernel_available("matmul_formats")))


def pack_matrix(w: object, inputs: int = 1) -> object:
    """w [*in, out] (its first `inputs` axes the inputs) packed as the matrix [prod(in), out] when
    the kernels take it; anything else as it is."""
    if not packable(w) or len(w.shape) != inputs + 1:
        return w
    if not isinstance(w, QuantizedWeight):
        return PackedWeight.pack(w.reshape(-1, w.shape[-1]))
    q, groups = w.q.reshape(-1, w.shape[-1]), _input_groups(w)
    scale = w.scale.reshape(groups, w.shape[-1])
    supers = [None if a is None else a.reshape(-1, w.shape[-1]) for a in (w.super_scale, w.super_offset)]
    if w.offset is None:
        return PackedWeight.pack_uint6(q, scale, supers[0]) if w.bits == 6 else PackedWeight.pack_int8(q, scale)
    pack = PackedWeight.pack_uint5 if w.bits == 5 else PackedWeight.pack_uint4
    return pack(q, scale, w.offset.reshape(groups, w.shape[-1]), *supers)


def _input_groups(w: QuantizedWeight) -> int | None:
    """How many groups of inputs w's scales cover, flattening its input axes (all but the last):
    1 for per-channel scales; None where its scales do not group the flattened inputs (grouped
    along another axis, or int8 values that are not int8)."""
    if w.q.dtype != (jnp.int8 if w.offset is None else jnp.uint8):
        return None
    inputs = w.q.shape[:-1]
    if not w.group_size:
        return 1 if all(n == 1 for n in w.scale.shape[:-1]) and w.offset is None else None
    if w.group_axis % w.q.ndim != w.q.ndim - 2 or w.q.shape[-2] % w.group_size:
        return None
    return int(np.prod(inputs)) // w.group_size
