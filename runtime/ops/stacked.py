"""A stack of decoder layers whose weights are packed for the C++ matmuls, kept as a few arrays.

A step hands XLA every weight array it reads as an argument, and each costs the host a few
microseconds a call (flattening, checks, usage events: the more so as the step's own weight
stream has just evicted the host's bookkeeping from the caches). A packed model's layers
carry a dozen arrays each (panels, scales and offsets of four matrices, norms), hundreds a
step, about a millisecond of host time in a batch-1 decode that runs a few milliseconds on
the same cores (benchmarks/RESULTS.md, stop 50). `StackedLayers` keeps each of those arrays
once for all layers, stacked [num_layers, ...]: the kernels read a stacked PackedWeight at
its layer in place (runtime/ops/kernels/panels.h LayerView), and the small arrays (norms,
biases) are sliced per layer inside the program, which costs nothing to speak of.

Only layers whose every array is a PackedWeight or small (SMALL_BYTES) are stacked: slicing a
large plain array out of a stack would copy it every step (why runtime/ops/layered.py keeps
per-layer arrays at all).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from runtime.ops.matmul import is_packed

SMALL_BYTES = 64 * 1024  # a layer's plain arrays at most this large are stacked (sliced in the program)


@flax.struct.dataclass
class StackedLayers:
    """num_layers layers of one structure, each array stacked [num_layers, ...] (a PackedWeight's
    panels, scales and offsets likewise). `stack[i]` (or `layer(i)`, i a Python or traced int) is
    layer i's weights in the form the layer stage reads: its PackedWeights views of the stack at
    layer i, its other arrays slices of theirs."""

    params: Any
    num_layers: int = flax.struct.field(pytree_node=False)

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, i: int | jax.Array) -> Any:
        if isinstance(i, int) and not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} of a stack of {self.num_layers}")
        return self.layer(i)

    def __iter__(self):
        return (self.layer(i) for i in range(self.num_layers))

    def layer(self, i: int | jax.Array) -> Any:
        """Layer i's weights (see the class docstring)."""
        i = jnp.asarray(i, jnp.int32)
        return jax.tree.map(lambda w: w.at_layer(i) if is_packed(w) else jax.lax.dynamic_index_in_dim(
            w, i, keepdims=False), self.params, is_leaf=is_packed)


def stackable(layers: list) -> bool:
    """Whether `layers` (per-layer weights, of one structure) can be stacked: every array a
    PackedWeight or at most SMALL_BYTES, every array on this process whole (one program
    reads them all), and no LoRA adapter slots (runtime/ops/lora.py writes those per layer)."""
    if not layers or any(isinstance(layer, dict) and "lora" in layer for layer in layers):
        return False
    structure = jax.tree.structure(layers[0], is_leaf=is_packed)
    if any(jax.tree.structure(layer, is_leaf=is_packed) != structure for layer in layers[1:]):
        return False
    for leaf in jax.tree.leaves(layers, is_leaf=is_packed):
        arrays = jax.tree.leaves(leaf)
        if not all(isinstance(a, jax.Array) and a.is_fully_addressable and a.sharding.is_fully_replicated
                   for a in arrays):
            return False
        if not is_packed(leaf) and leaf.nbytes > SMALL_BYTES:
            return False
        if is_packed(leaf) and leaf.layer is not None:
            return False
    return len({tuple((a.shape, a.dtype) for a in jax.tree.leaves(layer)) for layer in layers}) == 1


def stack(layers: list) -> StackedLayers:
    """The layers stacked (see `stackable`); each layer's arrays are freed as they are copied
    into the stack, so at most one array's stack is held beside the layers."""
    n = len(layers)
    per_layer = [jax.tree.leaves(layer) for layer in layers]
    treedef = jax.tree.structure(layers[0])
    stacked = []
    for j, first in enumerate(per_layer[0]):
        host = np.empty((n, *first.shape), first.dtype)
        for i in range(n):
            host[i] = np.asarray(per_layer[i][j])
            per_layer[i][j].delete()
        stacked.append(jax.device_put(host, first.sharding))
        del host
    return StackedLayers(jax.tree.unflatten(treedef, stacked), n)
