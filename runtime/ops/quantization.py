"""Weight quantization: `quantization="int8"` and `quantization="gguf"`.

`int8`: every matrix of a loaded model (projections, MLP, a MoE layer's experts, embedding,
LM head; >= 2 dimensions) is stored as symmetric int8 with float scales, `QuantizedWeight(q,
scale)`: per output channel (the maximum |w| over the input axes / 127; stacked experts
[E, in, out] get one scale per expert and output channel). Which axes are the inputs is the
model path's to say (registry's `_native_quant_axes` / `_torchax_quant_axes`).

`gguf`: a GGUF checkpoint's Q8_0 tensors are loaded as they are stored, int8 values with one
scale per block of 32 along the input axis (`QuantizedWeight(q, scale, group_size=32,
group_axis=...)`, read by registry.weights); no rounding beyond the file's own, so the
weights equal the dequantized checkpoint exactly. Its 4- and 5-bit types likewise, uint8 values
with a scale and an offset per block (`offset=...`, `bits=5` for 5-bit values).

The step function dequantizes its weights as it uses them (`q.astype(dtype) * scale`, inside
the jitted program, layer by layer when the runtime steps layer by layer), so both model
paths serve quantized weights through the same step contract; XLA fuses the dequantization
into the matmul's operand where the backend can (GPU/TPU). Weights take ~1/4 of their float32
bytes; shardings are the float weight's (the scale's reduced axes are whole).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from runtime.ops.step import LayerStages, LoadedModel

QUANTIZATIONS = ("int8", "gguf")


@flax.struct.dataclass
class QuantizedWeight:
    """A weight as int8 values and float scales: w ~= q * scale.

    Per channel (group_size 0): scale has size 1 on the reduced (input) axes and broadcasts
    over q. Grouped: one scale per `group_size` consecutive values along `group_axis`, so
    scale's shape is q's with that axis divided by group_size. group_axis counts from the end,
    so slicing leading (layer) axes off both arrays keeps it valid.
    """

    q: jax.Array  # int8 (uint8 4-bit values 0..15 where there is an offset, 0..31 with bits=5), the weight's shape
    scale: jax.Array  # the weight's dtype
    group_size: int = flax.struct.field(pytree_node=False, default=0)
    group_axis: int = flax.struct.field(pytree_node=False, default=-1)  # negative
    offset: jax.Array | None = None  # as scale: w ~= q * scale + offset (GGUF's 4- and 5-bit blocks)
    # 5: 5-bit values (GGUF's Q5 types); 6: int8 values -32..31 (GGUF's Q6_K, groups of 16); 0: as q says
    bits: int = flax.struct.field(pytree_node=False, default=0)
    # GGUF's K-quants: the float16 super-scale of each 256 inputs (scale's shape, its group axis 256 /
    # group_size times shorter; or [in / 256, out], the input axes flattened, where they split the
    # super-blocks) of which each group's scale is an integer multiple, the file's code (Q4_K, Q5_K:
    # d, codes 0..63; Q6_K: d, codes -128..127), and likewise the offsets' (-dmin);
    # runtime.ops.matmul packs the codes rather than the scales
    super_scale: jax.Array | None = None
    super_offset: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    def dequantize(self) -> jax.Array:
        if not self.group_size:
            w = self.q.astype(self.scale.dtype) * self.scale
            return w if self.offset is None else w + self.offset
        shape, axis = self.q.shape, self.group_axis % self.q.ndim
        grouped = self.q.reshape(*shape[:axis], shape[axis] // self.group_size, self.group_size, *shape[axis + 1:])
        w = grouped.astype(self.scale.dtype) * jnp.expand_dims(self.scale, axis + 1)
        if self.offset is not None:
            w = w + jnp.expand_dims(self.offset, axis + 1)
        return w.reshape(shape)


def transpose_matrix(w: Any) -> Any:
    """A matrix [a, b] as [b, a], a QuantizedWeight's values, scales and offsets alike (its
    grouping axis moving with them)."""
    if not isinstance(w, QuantizedWeight):
        return w.T
    transposed = lambda a: None if a is None else a.T  # noqa: E731
    return QuantizedWeight(w.q.T, w.scale.T, group_size=w.group_size, group_axis=-1 - (w.group_axis % 2),
                           offset=transposed(w.offset), bits=w.bits, super_scale=transposed(w.super_scale),
                           super_offset=transposed(w.super_offset))


def _is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def dequantize(tree: Any) -> Any:
    """The tree with every QuantizedWeight replaced by its float weight."""
    return jax.tree.map(lambda x: x.dequantize() if _is_quantized(x) else x, tree, is_leaf=_is_quantized)


def quantize_int8(w: jax.Array, reduce_axes: tuple[int, ...]) -> QuantizedWeight:
    """Symmetric int8 over `reduce_axes` (the input axes: one scale per output channel)."""
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=reduce_axes, keepdims=True)
    scale = jnp.where(amax == 0, 1.0, amax / 127.0)
    q = jnp.clip(jnp.round(wf / scale), -127, 127).astype(jnp.int8)
    return QuantizedWeight(q, scale.astype(w.dtype))


def quantize_model(model: LoadedModel, method: str, mesh: Mesh,
                   reduce_axes: Callable[[str, tuple[int, ...]], tuple[int, ...] | None]) -> None:
    """Quantize a loaded model's matrices in place (params, param_shardings, step functions).

    Args:
        reduce_axes: (dotted param path, shape) -> the input axes to take each scale over,
            or None to leave that param in float (norms, biases: any < 2-D param is left).

    Raises:
        ValueError: a method other than int8 ("gguf" weights are read quantized, see registry.weights).
    """
    if method != "int8":
        raise ValueError(f"quantization={method!r} cannot be applied to loaded weights; supported: int8")
    flat, treedef = jax.tree_util.tree_flatten_with_path(model.params)
    specs = treedef.flatten_up_to(model.param_shardings)
    new_params, new_specs = [], []
    for (path, w), spec in zip(flat, specs):
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        axes = reduce_axes(name, w.shape) if w.ndim >= 2 and jnp.issubdtype(w.dtype, jnp.floating) else None
        if axes is None:
            new_params.append(w)
            new_specs.append(spec)
            continue
        entries = tuple(spec) + (None,) * (w.ndim - len(tuple(spec)))
        scale_spec = PartitionSpec(*(None if i in axes else e for i, e in enumerate(entries)))
        out = QuantizedWeight(NamedSharding(mesh, PartitionSpec(*entries)), NamedSharding(mesh, scale_spec))
        new_params.append(jax.jit(functools.partial(quantize_int8, reduce_axes=axes), out_shardings=out)(w))
        new_specs.append(QuantizedWeight(PartitionSpec(*entries), scale_spec))
        del w
    model.params = jax.tree.unflatten(treedef, new_params)
    model.param_shardings = jax.tree.unflatten(treedef, new_specs)
    serve_quantized(model)


def serve_quantized(model: LoadedModel) -> None:
    """Make the model's step function (and layer stages) dequantize QuantizedWeight params."""
    step_fn = model.step_fn
    model.step_fn = lambda params, kv_cache, batch: step_fn(dequantize(params), kv_cache, batch)
    if model.stages is not None:
        model.stages = _dequantizing_stages(model.stages)


def _dequantizing_stages(stages: LayerStages) -> LayerStages:
    prologue, layer, epilogue = stages.prologue, stages.layer, stages.epilogue
    return dataclasses.replace(
        stages,
        prologue=lambda outer, batch: prologue(dequantize(outer), batch),
        layer=lambda p, carry, kv_cache, i, batch: layer(dequantize(p), carry, kv_cache, i, batch),
        epilogue=lambda outer, carry, batch: epilogue(dequantize(outer), carry, batch),
    )


def count_quantized(params: Any) -> int:
    """How many QuantizedWeight leaves a params tree holds."""
    return sum(map(_is_quantized, jax.tree.leaves(params, is_leaf=_is_quantized)))


def param_bytes(params: Any) -> int:
    """Bytes of a params tree (int8 values and scales counted as stored)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
