"""The engine's device mesh and the one table that says how arrays are laid out on it.

The mesh has axes ("data", "model"), both with Auto sharding semantics. Nothing outside
this file names a mesh axis: weights, the KV cache and the torchax fallback's partition
rules name *logical* axes ("vocab", "q_heads", "mlp", ...), and `SHARDING_RULES` maps
each logical axis to the mesh axis that splits it (None: replicated). A sharding change
is a one-line edit here (as jax-llm-examples' ShardingRules, tpu-inference's
ShardingAxisName).

    logical_to_spec(("embed", "q_heads", "head_dim"), (64, 4, 16), mesh)  # P(None, 'model', None)
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh, PartitionSpec as P

DATA_AXIS = "data"
MODEL_AXIS = "model"

# Logical axis -> mesh axis (or a tuple of them) that splits it; None keeps it whole.
# Megatron-style tensor parallelism: attention heads, MLP features and the vocabulary
# are split over the model axis; the hidden size is not.
SHARDING_RULES: dict[str, str | tuple[str, ...] | None] = {
    # native weights (models_jax weight tables)
    "vocab": MODEL_AXIS,
    "embed": None,
    "q_heads": MODEL_AXIS,
    "kv_heads": MODEL_AXIS,  # also the KV cache's head axis
    "head_dim": None,
    "mlp": MODEL_AXIS,
    # Mixture of experts: an expert's features split like a dense MLP's (tensor parallel), or
    # whole experts per device (expert parallel); a model's weight table names one of the two.
    "moe_mlp": MODEL_AXIS,
    "expert": MODEL_AXIS,
    # Stacked decoder layers (weights and KV cache): the forward scans over it, so it stays whole.
    "layers": None,
    # the paged KV cache, [layers, num_blocks, kv_heads, block_size, head_dim] (runtime.ops.step.KV_CACHE_AXES)
    "kv_blocks": None,
    "kv_block_tokens": None,
    # The torchax fallback knows a weight only by its module's name, not whether its
    # features are attention heads or MLP units, so it names Megatron's two roles.
    "column": MODEL_AXIS,  # output features of a column-parallel linear
    "row": MODEL_AXIS,  # input features of a row-parallel linear
}

LogicalAxes = Sequence[str | None]


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A (data_parallel_size, tensor_parallel_size) mesh over the first devices.

    Axis types are Auto: jax 0.10's make_mesh defaults to Explicit, under which
    Megatron-style sharded matmuls raise ShardingTypeError.

    Raises:
        ValueError: the devices cannot hold that mesh (says how many there are).
    """
    devices = list(devices if devices is not None else jax.devices())
    needed = tensor_parallel_size * data_parallel_size
    if needed > len(devices) or len(devices) % needed and needed != len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} "
            f"= {needed} devices, but {len(devices)} {devices[0].platform} device(s) are available; "
            f"choose sizes whose product divides {len(devices)} (on CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax)"
        )
    return jax.make_mesh(
        (data_parallel_size, tensor_parallel_size), (DATA_AXIS, MODEL_AXIS),
        axis_types=(AxisType.Auto, AxisType.Auto), devices=devices[:needed],
    )


def mesh_axes(logical: str | None) -> tuple[str, ...]:
    """The mesh axes that split logical axis `logical` (empty: replicated).

    Raises:
        KeyError: `logical` is not in SHARDING_RULES (names the known ones).
    """
    if logical is None:
        return ()
    if logical not in SHARDING_RULES:
        raise KeyError(f"unknown logical axis {logical!r}; known: {', '.join(SHARDING_RULES)}")
    axes = SHARDING_RULES[logical]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def logical_axis_size(logical: str, mesh: Mesh) -> int:
    """How many ways `mesh` splits logical axis `logical` (1 when the mesh lacks its axes)."""
    return math.prod(mesh.shape.get(a, 1) for a in mesh_axes(logical))


def logical_to_spec(
    logical_axes: LogicalAxes, shape: Sequence[int | None] | None = None, mesh: Mesh | None = None
) -> P:
    """The PartitionSpec of an array whose dimensions have these logical axes.

    With a mesh, mesh axes it does not have are dropped; with a shape as well, so is a
    split that does not divide its dimension (that dimension is then replicated; None in
    `shape` is a size not known yet and is kept). A mesh axis splits at most one
    dimension (the first that asks for it). A spec that splits nothing is P().

    Raises:
        KeyError: a logical axis not in SHARDING_RULES.
        ValueError: `shape` and `logical_axes` differ in length.
    """
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for i, logical in enumerate(logical_axes):
        axes = tuple(a for a in mesh_axes(logical) if a not in used and (mesh is None or a in mesh.shape))
        dim = None if shape is None else shape[i]
        if axes and mesh is not None and dim is not None and dim % math.prod(mesh.shape[a] for a in axes):
            axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*spec) if any(s is not None for s in spec) else P()


def num_shards(spec: P, mesh: Mesh) -> int:
    """Into how many pieces `spec` splits an array over `mesh` (1: every device holds all of it)."""
    names = [a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)]
    return math.prod(mesh.shape[a] for a in names)


def check_mesh(mesh: Mesh) -> None:
    """Refuse a mesh that lacks an axis the rules split on (a typo would silently replicate everything).

    Raises:
        ValueError: names the missing and the present axes.
    """
    wanted = {a for logical in SHARDING_RULES for a in mesh_axes(logical)}
    missing = sorted(wanted - set(mesh.axis_names))
    if missing:
        raise ValueError(f"the mesh must have the axes {missing} that runtime.ops.mesh.SHARDING_RULES use; "
                         f"it has {tuple(mesh.axis_names)} (runtime.ops.mesh.make_mesh builds one)")
