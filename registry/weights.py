"""Safetensors checkpoints -> sharded jax.Arrays, each device reading only its own slice.

The files are memory-mapped (the safetensors header is a small JSON table of dtype,
shape and byte offsets), so a tensor is a lazy numpy view; `jax.make_array_from_callback`
then asks for one index per device and only those bytes are read from disk. bfloat16
comes through ml_dtypes, which numpy cannot name on its own.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models_jax.weights import WeightSpec, is_weight_spec
from registry.errors import ModelLoadError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def open_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the *.safetensors files in `path`, as read-only memory-mapped arrays.

    Raises:
        ModelLoadError: no safetensors file, or a tensor of a dtype numpy cannot hold.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (other formats are not read)")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        with open(file, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + header_len)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _DTYPES:
                raise ModelLoadError(f"{file.name}: tensor {name} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            tensors[name] = data[begin:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def load_params(path: Path, table, mesh: Mesh, dtype) -> tuple[dict, dict]:
    """Read every weight that `table` (a pytree of WeightSpec) declares.

    A stacked weight (WeightSpec.num_layers) is assembled from its per-layer tensors;
    each device still reads only its own slice of each.

    Returns (params, param_shardings): jax.Arrays of `dtype` (or a weight's own dtype)
    placed on `mesh`, and their PartitionSpecs (WeightSpec.partition_spec: the logical
    axes through runtime.mesh's rules, fitted to what divides evenly).

    Raises:
        ModelLoadError: a weight is missing or its shape differs from the table's.
    """
    tensors = open_checkpoint(path)
    specs = jax.tree.leaves(table, is_leaf=is_weight_spec)
    missing = [name for w in specs for name in w.hf_names if name not in tensors]
    if missing:
        raise ModelLoadError(f"{path}: {len(missing)} weights missing from the checkpoint, e.g. {missing[:5]}")
    wrong = [
        f"{name} has shape {tuple(tensors[name].shape)}, the config implies {tuple(w.hf_shape)}"
        for w in specs for name in w.hf_names if tuple(tensors[name].shape) != tuple(w.hf_shape)
    ]
    if wrong:
        raise ModelLoadError(f"{path}: {len(wrong)} weights do not fit the config: " + "; ".join(wrong[:4]))

    def place(w: WeightSpec) -> tuple[jax.Array, P]:
        # Lazy views of the memory-mapped tensors (only repeated KV heads are copied).
        native = [w.to_native(tensors[name]) for name in w.hf_names]
        dt = w.dtype or dtype

        def read(index: tuple[slice, ...]) -> np.ndarray:  # this device's slice only
            if w.num_layers is None:
                return np.array(native[0][index], dtype=dt, order="C")
            return np.stack([np.asarray(layer[index[1:]], dtype=dt) for layer in native[index[0]]])

        spec = w.partition_spec(mesh)
        return jax.make_array_from_callback(w.shape, NamedSharding(mesh, spec), read), spec

    placed = jax.tree.map(place, table, is_leaf=is_weight_spec)
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], P)  # noqa: E731
    params = jax.tree.map(lambda x: x[0], placed, is_leaf=is_pair)
    shardings = jax.tree.map(lambda x: x[1], placed, is_leaf=is_pair)
    return params, shardings
