"""The abstract description of one parameter, shared by every native model.

A model declares a pytree of `WeightSpec`s with the same structure as its params (as
jax-llm-examples' ArrayInfo). That one tree drives loading (which tensor of the Hugging
Face checkpoint, how to lay it out), sharding (logical axes, which runtime.ops.mesh's rules
turn into a PartitionSpec) and random initialisation (`init_params`, no checkpoint
needed), so a layout or sharding change is a one-line edit in the model's table.

The decoder layers are *stacked*: one array per weight with a leading "layers" axis
(`stacked`), so that the forward pass can `jax.lax.scan` over them and compile one layer
whatever the depth. A stacked weight names its checkpoint tensors with a `{layer}`
pattern (`model.layers.{layer}.mlp.up_proj.weight`) and is read layer by layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from runtime.ops.mesh import logical_to_spec
from runtime.ops.quantization import QuantizedWeight, quantize_int8

# (key, shape, dtype) -> array, as jax.nn.initializers.
Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]
ones: Initializer = jax.nn.initializers.ones
zeros: Initializer = jax.nn.initializers.zeros


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One native parameter and where it comes from.

    The checkpoint tensor `hf_name` (shape `hf_shape`) is reshaped to `view`, transposed
    by `perm`, and, with `repeat=(axis, times)`, each slice along `axis` is repeated
    `times` times in place (KV heads stored once per device group, see
    models_jax/__init__.py), giving the native layout `shape`, whose dimensions have the
    `logical_axes`. `init` draws a random tensor in the checkpoint's layout (so repeated
    heads stay copies); `dtype` None means the dtype the model is loaded in.

    Stacked (`num_layers` set, see `stacked`): `hf_name` holds `{layer}`, there is one
    checkpoint tensor of `hf_shape` per layer, and `shape` / `logical_axes` have a leading
    "layers" axis; `view`, `perm` and `repeat` describe one layer. Experts (`num_experts`
    set): likewise `{expert}`, one tensor per expert, an axis of experts after the layers'.
    """

    hf_name: str
    hf_shape: tuple[int, ...]
    logical_axes: tuple[str | None, ...]
    init: Initializer
    view: tuple[int, ...] | None = None
    perm: tuple[int, ...] | None = None
    repeat: tuple[int, int] | None = None  # (axis of the native layout, times)
    dtype: Any = None
    num_layers: int | None = None  # stacked over this many layers
    num_experts: int | None = None  # stacked over this many experts (after the layers)

    def __post_init__(self):
        if self.view is not None and math.prod(self.view) != math.prod(self.hf_shape):
            raise ValueError(f"{self.hf_name}: view {self.view} does not fit {self.hf_shape}")
        if len(self.logical_axes) != len(self.shape):
            raise ValueError(f"{self.hf_name}: logical axes {self.logical_axes} do not fit shape {self.shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The native shape (with the leading layers axis when stacked)."""
        shape = self.view or self.hf_shape
        shape = [shape[i] for i in self.perm] if self.perm else list(shape)
        if self.repeat:
            axis, times = self.repeat
            shape[axis] *= times
        return (*self.stacked_shape, *shape)

    @property
    def stacked_shape(self) -> tuple[int, ...]:
        """The leading axes of stacked tensors: (layers, experts), either, or none."""
        return tuple(n for n in (self.num_layers, self.num_experts) if n)

    @property
    def hf_names(self) -> list[str]:
        """The checkpoint tensors this weight is read from: one per layer when stacked."""
        names = [self.hf_name]
        for key, count in (("{layer}", self.num_layers), ("{expert}", self.num_experts)):
            if count:
                names = [name.replace(key, str(i)) for name in names for i in range(count)]
        return names

    def to_native(self, tensor: Any) -> Any:
        """A checkpoint-layout tensor (numpy, a lazy view of a memmap, or jax) in the native
        layout; for a stacked weight, one layer's tensor in one layer's native layout.

        Reshape and transpose stay views for numpy input; only a repeat copies.
        """
        xp = jnp if isinstance(tensor, jax.Array) else np
        native = tensor.reshape(self.view) if self.view else tensor
        native = native.transpose(self.perm) if self.perm else native
        if self.repeat:
            native = xp.repeat(native, self.repeat[1], axis=self.repeat[0])
        return native

    def group_scales(self, group: int) -> WeightSpec | None:
        """The spec of this weight's scales when its checkpoint tensor is quantized in groups of
        `group` along the last (input) axis: the same layout with that axis `group` times
        shorter. None when the native layout would split a group (the last axis of `view`, the
        one the input axis lands in, not a multiple of `group`)."""
        last = (self.view or self.hf_shape)[-1]
        if len(self.hf_shape) < 2 or self.hf_shape[-1] % group or last % group:
            return None
        view = (*self.view[:-1], self.view[-1] // group) if self.view else None
        return dataclasses.replace(self, hf_shape=(*self.hf_shape[:-1], self.hf_shape[-1] // group), view=view)

    def group_axis(self) -> int:
        """Where the checkpoint's last axis lands in the native layout, counted from the end."""
        ndim = len(self.view or self.hf_shape)
        return (self.perm.index(ndim - 1) if self.perm else ndim - 1) - ndim

    def partition_spec(self, mesh: Mesh) -> P:
        """The logical axes through runtime.ops.mesh's rules, fitted to what divides evenly on `mesh`."""
        return logical_to_spec(self.logical_axes, self.shape, mesh)


def is_weight_spec(x: Any) -> bool:
    return isinstance(x, WeightSpec)


def init_params(table: Any, mesh: Mesh, dtype: Any, key: jax.Array) -> tuple[Any, Any]:
    """Random params for a weight table, placed on `mesh`, without a checkpoint.

    Each weight is drawn by its own initializer (one key per weight, in table order) in
    the checkpoint layout and then laid out as `to_native` does for a loaded tensor, so
    init and load give the same layout. One compiled program makes them all, each
    device computing only its own shards.

    Returns:
        (params, param_shardings): jax.Arrays of `dtype` (or a weight's own dtype) and
        their PartitionSpecs, both with the table's tree structure.
    """
    specs, treedef = jax.tree.flatten(table, is_leaf=is_weight_spec)
    pspecs = [w.partition_spec(mesh) for w in specs]

    def draw(w: WeightSpec, key: jax.Array) -> jax.Array:
        tensors = w.init(key, (*w.stacked_shape, *w.hf_shape), w.dtype or dtype)  # [L?, E?, *hf_shape]
        native = w.to_native
        for _ in w.stacked_shape:
            native = jax.vmap(native)
        return native(tensors)

    def make(key: jax.Array) -> list[jax.Array]:
        keys = jax.random.split(key, len(specs))
        return [draw(w, k) for w, k in zip(specs, keys)]

    out = jax.jit(make, out_shardings=[NamedSharding(mesh, s) for s in pspecs])(key)
    return jax.tree.unflatten(treedef, out), jax.tree.unflatten(treedef, pspecs)


# ---- table helpers: the Hugging Face layouts the native models read --------------------


def stacked(layer_table: Any, num_layers: int) -> Any:
    """A table of one decoder layer (hf_names with `{layer}`) stacked over `num_layers`:
    each weight gains a leading "layers" axis (never sharded, see runtime.ops.mesh).

    Raises:
        ValueError: a weight's hf_name has no `{layer}` to fill.
    """

    def stack(w: WeightSpec) -> WeightSpec:
        if "{layer}" not in w.hf_name:
            raise ValueError(f"{w.hf_name}: a stacked weight names its tensors with {{layer}}")
        return dataclasses.replace(w, num_layers=num_layers, logical_axes=("layers", *w.logical_axes))

    return jax.tree.map(stack, layer_table, is_leaf=is_weight_spec)


def vector(hf_name: str, size: int, axes: tuple[str | None] = (None,), init: Initializer = ones) -> WeightSpec:
    """A 1-D tensor kept as is (norm scales: ones; biases: pass init=zeros)."""
    return WeightSpec(hf_name, (size,), axes, init)


def embedding(hf_name: str, vocab: int, d: int, init: Initializer) -> WeightSpec:
    """An nn.Embedding weight [vocab, d], split by vocabulary."""
    return WeightSpec(hf_name, (vocab, d), ("vocab", "embed"), init)


def linear(hf_name: str, d_in: int, d_out: int, axes: tuple[str | None, str | None], init: Initializer) -> WeightSpec:
    """An nn.Linear weight: HF [out, in] -> native [in, out] with logical `axes` (in, out)."""
    return WeightSpec(hf_name, (d_out, d_in), axes, init, perm=(1, 0))


def _repeat(axis: int, times: int) -> tuple[int, int] | None:
    return (axis, times) if times > 1 else None


def linear_to_heads(
    hf_name: str, d_in: int, heads: int, head_dim: int, heads_axis: str, init: Initializer, repeat: int = 1
) -> WeightSpec:
    """A projection into heads (q/k/v): HF [heads * head_dim, in] -> native [in, heads * repeat, head_dim]."""
    return WeightSpec(
        hf_name, (heads * head_dim, d_in), ("embed", heads_axis, "head_dim"), init,
        view=(heads, head_dim, d_in), perm=(2, 0, 1), repeat=_repeat(1, repeat),
    )


def linear_from_heads(hf_name: str, heads: int, head_dim: int, d_out: int, init: Initializer) -> WeightSpec:
    """A projection out of the query heads (o_proj): HF [out, heads * head_dim] -> native [heads, head_dim, out]."""
    return WeightSpec(
        hf_name, (d_out, heads * head_dim), ("q_heads", "head_dim", "embed"), init,
        view=(d_out, heads, head_dim), perm=(1, 2, 0),
    )


def head_bias(hf_name: str, heads: int, head_dim: int, heads_axis: str, repeat: int = 1) -> WeightSpec:
    """A q/k/v bias: HF [heads * head_dim] -> native [heads * repeat, head_dim], initialised to zeros."""
    return WeightSpec(
        hf_name, (heads * head_dim,), (heads_axis, "head_dim"), zeros, view=(heads, head_dim), repeat=_repeat(0, repeat)
    )


def _int8_blocks(w: QuantizedWeight, scale_dtype, group: int) -> QuantizedWeight:
    """A grouped QuantizedWeight (4-, 5- or 6-bit values) as int8 values in groups of `group` along
    its group axis: each group's largest |weight| / 127 its scale (each weight within 1/254 of it)."""
    shape, axis = w.q.shape, w.group_axis % w.q.ndim
    grouped = w.dequantize().astype(jnp.float32).reshape(*shape[:axis], shape[axis] // group, group, *shape[axis + 1:])
    blocks = quantize_int8(grouped, reduce_axes=(axis + 1,))
    return QuantizedWeight(blocks.q.reshape(shape), jnp.squeeze(blocks.scale, axis + 1).astype(scale_dtype), group,
                           w.group_axis)


def join_outputs(weights: list[Any], requantize: bool = True) -> Any | None:
    """Matrices that read the same input, [D, *out_i] each, as one [D, sum_i prod(out_i)] with
    their outputs side by side in order: one wide matmul where there were several narrow ones.

    QuantizedWeights join values, scales and offsets alike (per-channel scales [1, *out_i], grouped
    scales [D / group, *out_i] grouped along D); 4- beside 5-bit values as 5-bit ones; grouped
    values of other kinds side by side (a GGUF file's attn_v Q6_K or Q8_0 beside its Q4_K or Q5_0 q
    and k) as int8 blocks of the largest group, the others requantized (`_int8_blocks`), unless not
    `requantize`. None where they cannot be one: float and quantized mixed, kinds that would need
    requantizing and may not, or a grouping along another axis.
    """
    def flat(w: jax.Array) -> jax.Array:
        return w.reshape(w.shape[0], -1)

    quantized = [isinstance(w, QuantizedWeight) for w in weights]
    if not any(quantized):
        return jnp.concatenate([flat(w) for w in weights], axis=-1)
    if not all(quantized):
        return None
    kinds = {(w.group_size, w.q.dtype, w.offset is None, w.bits) for w in weights}
    if len(kinds) > 1 and all(w.group_size for w in weights) and any(w.offset is None for w in weights):
        if not requantize:
            return None
        group = max(w.group_size for w in weights)
        blocks = lambda w: w.offset is None and not w.bits and w.group_size == group  # noqa: E731 (int8 blocks)
        dtype = next((w.scale.dtype for w in weights if blocks(w)), jnp.float32)
        weights = [w if blocks(w) else _int8_blocks(w, dtype, group) for w in weights]
    if len({(w.group_size, w.q.dtype, w.offset is None) for w in weights}) != 1:
        return None
    group_size = weights[0].group_size
    if group_size and any(w.group_axis % w.q.ndim != 0 for w in weights):
        return None

    def joined(field: str) -> jax.Array | None:  # None unless every weight has it
        parts = [getattr(w, field) for w in weights]
        return None if any(a is None for a in parts) else jnp.concatenate([flat(a) for a in parts], axis=-1)

    supers = all(w.super_scale is not None for w in weights)  # K-quants' codes (the offsets' too, if any)
    return QuantizedWeight(
        joined("q"), joined("scale"), group_size=group_size, group_axis=-2 if group_size else -1,
        offset=joined("offset"), bits=max(w.bits for w in weights),  # 4-bit values are 5-bit ones too (6-bit ones
        super_scale=joined("super_scale") if supers else None,      # join only their own)
        super_offset=joined("super_offset") if supers else None,
    )


def joined_projections(w: dict, names: tuple[str, ...], joined: str, requantize: bool = True) -> dict:
    """`w` with the weights `names` (and their "<name>_bias") joined as `joined` (and
    "<joined>_bias"); `w` as it was where they cannot be joined (or are joined already; see
    join_outputs for `requantize`)."""
    if not all(n in w for n in names):
        return w
    weight = join_outputs([w[n] for n in names], requantize)
    if weight is None:
        return w
    biases = [n + "_bias" for n in names]
    out = {k: v for k, v in w.items() if k not in names and k not in biases}
    out[joined] = weight
    if biases[0] in w:
        out[joined + "_bias"] = jnp.concatenate([w[b].reshape(-1) for b in biases])
    return out
