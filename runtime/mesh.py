"""The engine's device mesh: axes ("data", "model"), both with Auto sharding semantics."""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

DATA_AXIS = "data"
MODEL_AXIS = "model"


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
