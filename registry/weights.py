"""Safetensors checkpoints -> sharded jax.Arrays, each device reading only its own slice.

The files are memory-mapped (the safetensors header is a small JSON table of dtype,
shape and byte offsets), so a tensor is a lazy numpy view; `jax.make_array_from_callback`
then asks for one index per device and only those bytes are read from disk. bfloat16
comes through ml_dtypes, which numpy cannot name on its own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import struct
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models_jax.weights import WeightSpec, is_weight_spec, zeros
from registry.errors import ModelLoadError
from runtime.ops.quantization import QuantizedWeight

logger = logging.getLogger("servax.registry")

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


Q8_0_FOLDER = "q8_0"  # a GGUF conversion's Q8_0 tensors as stored (registry.gguf)
Q8_0_GROUP = 32  # values per Q8_0 block (one float16 scale each)


def open_q8_0(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A GGUF conversion's Q8_0 tensors, as stored in the file: Hugging Face name -> (int8
    values [out, in], float16 scales [out, in / 32]), memory-mapped. Empty for any other folder."""
    folder = Path(path) / Q8_0_FOLDER
    if not folder.is_dir():
        return {}
    tensors = open_checkpoint(folder)
    return {name: (tensors[name], tensors[name + ".scale"]) for name in tensors if not name.endswith(".scale")}


FOUR_BIT_FOLDER = "q4"  # a GGUF conversion's Q4_0 / Q4_1 / Q4_K tensors as stored (registry.gguf)
FIVE_BIT_FOLDER = "q5"  # ... its Q5_0 / Q5_1 / Q5_K ones
SIX_BIT_FOLDER = "q6"  # ... and its Q6_K ones


def open_four_bit(path: Path, folder: str = FOUR_BIT_FOLDER, bits: int = 4) -> dict[str, tuple]:
    """A GGUF conversion's 4-bit tensors, as stored in the file: Hugging Face name -> (uint8
    values 0..15 [out, in], float32 scales and offsets [out, in / 32], 4, supers), memory-mapped;
    the weight is value * scale + offset. `supers`: a K-quant's float16 super-scales of its scales
    and offsets [out, in / 256] (of which they are integer multiples), else None. Empty for any
    other folder."""
    folder = Path(path) / folder
    if not folder.is_dir():
        return {}
    tensors = open_checkpoint(folder)
    parts = (".scale", ".offset", ".super_scale", ".super_offset")
    return {name: (tensors[name], tensors[name + ".scale"], tensors.get(name + ".offset"), bits,
                   (tensors[name + ".super_scale"], tensors.get(name + ".super_offset"))
                   if name + ".super_scale" in tensors else None)
            for name in tensors if not name.endswith(parts)}


def open_five_bit(path: Path) -> dict[str, tuple]:
    """A GGUF conversion's 5-bit tensors, as `open_four_bit` reads the 4-bit ones (values 0..31),
    each marked 5: (values, scales, offsets, 5, supers). Empty for any other folder."""
    return open_four_bit(path, FIVE_BIT_FOLDER, 5)


def open_six_bit(path: Path) -> dict[str, tuple]:
    """A GGUF conversion's Q6_K tensors, as stored in the file: Hugging Face name -> (int8 values
    -32..31 [out, in], float32 scales [out, in / 16], None, 6, (super-scales [out, in / 256],
    None)), memory-mapped; the weight is value * scale. Empty for any other folder."""
    return open_four_bit(path, SIX_BIT_FOLDER, 6)


def stored_bits(parts: tuple) -> int:
    """The bits of a tensor as stored (`open_q8_0` 8, `open_four_bit` 4, `open_five_bit` 5, `open_six_bit` 6)."""
    return 8 if len(parts) == 2 else parts[3]


def load_params(path: Path, table, mesh: Mesh, dtype,
                int8_groups: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
                per_layer: bool = False) -> tuple[dict, dict]:
    """Read every weight that `table` (a pytree of WeightSpec) declares.

    A stacked weight (WeightSpec.num_layers) is assembled from its per-layer tensors;
    each device still reads only its own slice of each. With `per_layer`, a stacked weight
    comes instead as a list of per-layer arrays (and its spec less the layer axis; a list of
    per-layer specs where it is quantized): no stack to assemble, for a runtime that would split
    it again.

    int8_groups: checkpoint tensors stored quantized in groups of 32 inputs: int8 with a scale
    (`open_q8_0`), or 4- or 5-bit values with a scale and an offset (`open_four_bit`,
    `open_five_bit`), or of 16: 6-bit values with a scale (`open_six_bit`). A weight whose every
    tensor is there (and whose layout keeps those groups whole) becomes a
    runtime.ops.quantization.QuantizedWeight instead of a float array: with `per_layer` each
    layer in its own kind (GGUF files mix kinds by layer: a Q4_K_M file's ffn_down is Q6_K in
    some layers, Q4_K in the others), stacked in one kind (`_one_kind`).

    Returns (params, param_shardings): jax.Arrays of `dtype` (or a weight's own dtype)
    placed on `mesh`, and their PartitionSpecs (WeightSpec.partition_spec: the logical
    axes through runtime.ops.mesh's rules, fitted to what divides evenly).

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
    int8_groups = int8_groups or {}

    def place(w: WeightSpec) -> tuple[Any, Any]:
        stored = [int8_groups.get(name) for name in w.hf_names]
        per_layer_weight = per_layer and w.num_layers is not None
        if all(stored) and per_layer_weight:  # each layer in its own kind, as stored
            layer, per = _one_layer(w), len(stored) // w.num_layers
            placed = [_quantized(layer, _one_kind(layer, stored[i * per:(i + 1) * per]), mesh, w.dtype or dtype)
                      for i in range(w.num_layers)]
            if all(placed):
                return [p[0] for p in placed], [p[1] for p in placed]
        elif all(stored):
            quantized = _quantized(w, _one_kind(w, stored), mesh, w.dtype or dtype)
            if quantized is not None:
                return quantized
        spec = w.partition_spec(mesh)
        sources = [tensors[name] for name in w.hf_names]
        if per_layer_weight:
            layer, layer_spec = _one_layer(w), P(*tuple(spec)[1:])
            per = len(sources) // w.num_layers  # tensors of one layer (its experts)
            return [_place(layer, sources[i * per:(i + 1) * per], mesh, layer_spec, w.dtype or dtype)
                    for i in range(w.num_layers)], layer_spec
        return _place(w, sources, mesh, spec, w.dtype or dtype), spec

    placed = jax.tree.map(place, table, is_leaf=is_weight_spec)
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(  # noqa: E731
        x[1], (P, QuantizedWeight, list))
    params = jax.tree.map(lambda x: x[0], placed, is_leaf=is_pair)
    shardings = jax.tree.map(lambda x: x[1], placed, is_leaf=is_pair)
    return params, shardings


def _one_layer(w: WeightSpec) -> WeightSpec:
    """One layer of a stacked weight: its first layer's names, no layer axis."""
    return dataclasses.replace(w, hf_name=w.hf_name.replace("{layer}", "0"), logical_axes=w.logical_axes[1:],
                               num_layers=None)


def _quantized(w: WeightSpec, stored: list[tuple], mesh: Mesh, dtype: Any
               ) -> tuple[QuantizedWeight, QuantizedWeight] | None:
    """`w` from its tensors as stored, all of one kind (int8 blocks (q, scale); 4- to 6-bit (q,
    scale, offset or None, bits, supers)), as a QuantizedWeight and its partition specs (int8 blocks'
    scales in `dtype`; K-quants' super-scales where every tensor has them and the layout keeps
    their 256 inputs whole); None where the layout does not keep the groups whole (the weight is
    then read as float)."""
    bits = stored_bits(stored[0])
    group = 16 if bits == 6 else Q8_0_GROUP
    scales = w.group_scales(group)
    if scales is None:
        return None
    q_spec, s_spec = w.partition_spec(mesh), scales.partition_spec(mesh)
    offsets = bits in (4, 5)
    q = _place(w, [parts[0] for parts in stored], mesh, q_spec, np.uint8 if offsets else np.int8)
    s = _place(scales, [parts[1] for parts in stored], mesh, s_spec, np.float32 if bits != 8 else dtype)
    o = _place(scales, [parts[2] for parts in stored], mesh, s_spec, np.float32) if offsets else None
    axis, bits = w.group_axis(), 0 if bits in (4, 8) else bits  # QuantizedWeight.bits: 5 or 6 only
    supers = super_specs = (None, None)  # (of the scales, of the offsets)
    spec_256 = w.group_scales(256) or _flat_super_scales(w)
    if spec_256 is not None and all(len(parts) > 4 and parts[4] is not None for parts in stored):
        spec = spec_256.partition_spec(mesh)
        super_specs = (spec, spec if offsets else None)
        supers = tuple(None if kept is None else _place(spec_256, [parts[4][i] for parts in stored], mesh, kept,
                                                        np.float32) for i, kept in enumerate(super_specs))
    return (QuantizedWeight(q, s, group, axis, offset=o, bits=bits, super_scale=supers[0], super_offset=supers[1]),
            QuantizedWeight(q_spec, s_spec, group, axis, offset=s_spec if offsets else None, bits=bits,
                            super_scale=super_specs[0], super_offset=super_specs[1]))


def _flat_super_scales(w: WeightSpec) -> WeightSpec | None:
    """The spec of a matrix's K-quant super-scales where its native layout splits the inputs over
    several axes and super-blocks across them (o_proj's [heads, head_dim, out] with heads of fewer
    than 256 inputs): [in / 256, out], the inputs in the checkpoint's order (as runtime.ops.matmul's
    pack_matrix flattens them), whole on every device (a few bytes a column). None where the
    native layout's last axis is not the checkpoint's output axis."""
    if len(w.hf_shape) != 2 or w.hf_shape[1] % 256 or w.repeat or not w.perm or w.perm[-1] != 0:
        return None
    return dataclasses.replace(w, hf_shape=(w.hf_shape[0], w.hf_shape[1] // 256), view=None, perm=(1, 0),
                               logical_axes=(*w.logical_axes[:len(w.stacked_shape)], None, None))


def _one_kind(w: WeightSpec, stored: list[tuple]) -> list[tuple]:
    """A weight's tensors as stored (int8 blocks (q, scale); 4-bit (q, scale, offset); 5- and 6-bit
    (q, scale, offset or None, bits)) in one kind, so that the weight stays one quantized stack
    rather than falling back to float (four times the bytes of int8): a GGUF file's layers may mix
    kinds, as Q4_K_M files do (ffn_down Q6_K in some layers, Q4_K in the others). 4- and 5-bit
    values are all 5-bit ones (exactly); with int8 blocks or 6-bit values, every tensor is int8
    blocks of 32, the others requantized (registry.gguf_tensors.q8_0_blocks: each weight within
    1/254 of its block's largest)."""
    kinds = {stored_bits(parts) for parts in stored}
    if len(kinds) == 1:
        return stored
    if kinds <= {4, 5}:
        return [(*parts[:3], 5, *parts[4:]) for parts in stored]
    logger.info("%s: stored in different kinds by layer (%s bits); those not int8 blocks are requantized "
                "to int8 blocks", w.hf_name, ", ".join(map(str, sorted(kinds))))
    return [parts if len(parts) == 2 else requantized_int8_blocks(*parts[:3]) for parts in stored]


def requantized_int8_blocks(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None
                            ) -> tuple[np.ndarray, np.ndarray]:
    """Values [.., in] with a scale (and an offset) per group of inputs [.., groups] (4- and 5-bit:
    groups of 32 with offsets; 6-bit: of 16 without) as int8 blocks of 32 (values, float16 scales
    [.., in / 32]), a few million weights at a time (bounded temporaries)."""
    from registry.gguf_tensors import q8_0_blocks

    q2, s2 = q.reshape(-1, q.shape[-1]), scale.reshape(-1, scale.shape[-1])
    o2 = None if offset is None else offset.reshape(s2.shape)
    group = q2.shape[1] // s2.shape[1]
    values, scales = np.empty(q2.shape, np.int8), np.empty((q2.shape[0], q2.shape[1] // Q8_0_GROUP), np.float16)
    step = max(1, (1 << 22) // q2.shape[1])
    for r in range(0, q2.shape[0], step):
        blocks = q2[r:r + step].reshape(-1, s2.shape[1], group).astype(np.float32)
        w = blocks * s2[r:r + step, :, None] + (0 if o2 is None else o2[r:r + step, :, None])
        values[r:r + step], scales[r:r + step] = q8_0_blocks(w.reshape(-1, q2.shape[1]))
    return values.reshape(q.shape), scales.reshape(*q.shape[:-1], q.shape[-1] // Q8_0_GROUP)


def place_int8_groups(name: str, q: np.ndarray, scale: np.ndarray, mesh: Mesh, spec: P,
                      dtype) -> tuple[QuantizedWeight, QuantizedWeight]:
    """One Q8_0 tensor (`open_q8_0`) in the checkpoint's own layout (the torchax path's
    parameters), the values placed as `spec` says and the scales likewise where the mesh
    splits their shorter last axis evenly (else that axis whole).

    Returns (weight, its partition specs)."""
    entries = tuple(spec) + (None,) * (q.ndim - len(tuple(spec)))
    last = entries[-1]
    ways = 1 if last is None else math.prod(mesh.shape[a] for a in ((last,) if isinstance(last, str) else last))
    s_spec = P(*entries[:-1], last if scale.shape[-1] % ways == 0 else None)
    as_stored = WeightSpec(name, tuple(q.shape), (None,) * q.ndim, zeros)
    values = _place(as_stored, [q], mesh, P(*entries), np.int8)
    scales = _place(dataclasses.replace(as_stored, hf_shape=tuple(scale.shape)), [scale], mesh, s_spec, dtype)
    return QuantizedWeight(values, scales, Q8_0_GROUP, -1), QuantizedWeight(P(*entries), s_spec, Q8_0_GROUP, -1)


def _place(w: WeightSpec, sources: list[np.ndarray], mesh: Mesh, spec: P, dt) -> jax.Array:
    """`w`'s checkpoint tensors (one per layer when stacked) as one array in the native layout,
    each device reading only its own slice."""
    native = [w.to_native(t) for t in sources]  # lazy views of the memory maps (repeats copy)

    lead = w.stacked_shape  # (layers, experts): `native` holds one tensor per combination, in order

    def read(index: tuple[slice, ...]) -> np.ndarray:  # this device's slice only
        if not lead:
            return np.array(native[0][index], dtype=dt, order="C")
        picks = [np.arange(n)[index[i]] for i, n in enumerate(lead)]
        flat = np.ravel_multi_index(np.meshgrid(*picks, indexing="ij"), lead).reshape(-1)
        rest = index[len(lead):]
        parts = np.stack([np.asarray(native[i][rest], dtype=dt) for i in flat])
        return parts.reshape(*(len(p) for p in picks), *parts.shape[1:])

    return jax.make_array_from_callback(w.shape, NamedSharding(mesh, spec), read)
