"""Run a step one decoder layer per call: three compiled programs per bucket, not one.

A model that offers `LayerStages` (runtime/step.py) can be stepped as

    carry = prologue(outer_params, batch)                     # program 1
    for i in range(num_layers):                               # program 2, called L times
        carry, kv_cache = layer(layers[i], carry, kv_cache, i, batch)
    logits = epilogue(outer_params, carry, batch)             # program 3

with each layer's weights in arrays of their own. The one-program alternative, a scan
over weights stacked [num_layers, ...], makes XLA:CPU copy every layer's weights out of
the stack before its matmuls: on the 30-layer demo model that copy is ~30 of a 54 ms
batch-1 decode step. Here the matmuls read the weights where they lie; the layer program
is compiled once per bucket whatever the depth (the layer index is an argument), and the
host dispatches L + 2 calls per step asynchronously while the device runs.

Shardings are pinned: the carry and the batch are replicated on the mesh, the weights and
the KV cache keep their own, so every call of a bucket hits the same compiled program
(and ahead-of-time compilation from shapes alone matches what serving later calls).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from runtime.step import KVCache, LayerStages, LoadedModel, StepInput


def layered_forward(params: dict, kv_cache: KVCache, batch: StepInput, *, stages: LayerStages):
    """The whole step from its stages, with params[layers_key] a list of per-layer weights
    (the form LayeredStep leaves a model in); one program when jitted whole."""
    key = stages.layers_key
    outer = {k: v for k, v in params.items() if k != key}
    carry = stages.prologue(outer, batch)
    for i, layer_params in enumerate(params[key]):
        carry, kv_cache = stages.layer(layer_params, carry, kv_cache, jnp.int32(i), batch)
    return stages.epilogue(outer, carry, batch), kv_cache


def _unstack(stacked: Any, specs: Any, num_layers: int, mesh: Mesh) -> list:
    """Per-layer copies of stacked [num_layers, ...] weights, each placed with its spec
    minus the layer axis; the stacked arrays are freed one by one as they are split."""
    per_layer: list[list] = [[] for _ in range(num_layers)]
    leaves, treedef = jax.tree.flatten(stacked)
    spec_leaves = treedef.flatten_up_to(specs)
    for w, spec in zip(leaves, spec_leaves):
        sharding = NamedSharding(mesh, PartitionSpec(*tuple(spec)[1:]))
        split = jax.jit(lambda w: tuple(w[i] for i in range(num_layers)), out_shardings=(sharding,) * num_layers)
        for i, part in enumerate(split(w)):
            per_layer[i].append(part)
        w.delete()
    return [jax.tree.unflatten(treedef, parts) for parts in per_layer]


def _fuse_in_place(layers: list, fuse: Any, replicated: NamedSharding) -> None:
    """layers[i] = fuse(layers[i]), one layer at a time (layer i's old arrays are freed as
    it is replaced: at most one layer is held twice); weights whole on every device."""
    joined = jax.jit(fuse, out_shardings=replicated)
    for i, layer_params in enumerate(layers):
        layers[i] = joined(layer_params)


def _fuse_changes(fuse: Any, layer: Any) -> bool:
    """Whether `fuse` would join anything in `layer` (False for weights joined already)."""
    joined = jax.eval_shape(fuse, layer)
    return jax.tree.structure(joined) != jax.tree.structure(layer)


class LayeredStep:
    """Steps a LoadedModel layer by layer (see the module docstring).

    Takes ownership of `model.params`: the stacked layer weights are replaced by per-layer
    arrays (model.params[layers_key] becomes a list, model.param_shardings likewise), and
    model.step_fn by `layered_forward`, which computes the same from that form. A model
    already in that form (a second engine on the same LoadedModel) is used as it is.
    """

    def __init__(self, model: LoadedModel, mesh: Mesh, kv_sharding: NamedSharding | KVCache):
        stages = model.stages
        assert stages is not None
        key, n = stages.layers_key, stages.num_layers
        self.outer = {k: v for k, v in model.params.items() if k != key}
        if isinstance(model.params[key], list):  # per-layer already (the torchax path, or another engine's)
            self.layers = model.params[key]
        else:
            self.layers = _unstack(model.params[key], model.param_shardings[key], n, mesh)
        if stages.fuse is not None and _fuse_changes(stages.fuse, self.layers[0]) and all(
                a.sharding.is_fully_replicated for a in jax.tree.leaves(self.layers)):
            _fuse_in_place(self.layers, stages.fuse, NamedSharding(mesh, PartitionSpec()))
        layer_specs = jax.tree.map(lambda a: a.sharding.spec, self.layers[0])
        model.params = {**self.outer, key: self.layers}
        model.param_shardings = {**model.param_shardings, key: [layer_specs] * n}
        model.step_fn = functools.partial(layered_forward, stages=stages)

        self.replicated = NamedSharding(mesh, PartitionSpec())
        rep = self.replicated
        outer_shardings = jax.tree.map(lambda a: a.sharding, self.outer)
        layer_shardings = jax.tree.map(lambda a: a.sharding, self.layers[0])
        # A KVCache of shardings carries the cache's static metadata (attention backend, mesh).
        kv = kv_sharding if isinstance(kv_sharding, KVCache) else KVCache(kv_sharding, kv_sharding)
        self._prologue = jax.jit(stages.prologue, in_shardings=(outer_shardings, rep), out_shardings=rep)
        self._layer = jax.jit(stages.layer, in_shardings=(layer_shardings, rep, kv, rep, rep),
                              out_shardings=(rep, kv), donate_argnums=(2,))
        self._epilogue = jax.jit(stages.epilogue, in_shardings=(outer_shardings, rep, rep), out_shardings=rep)
        self._index = [jax.device_put(np.int32(i), rep) for i in range(n)]

    def __call__(self, kv_cache: KVCache, batch: StepInput) -> tuple[jax.Array, KVCache]:
        """One step: (logits, kv_cache), dispatched without waiting (kv_cache is donated)."""
        batch = jax.device_put(batch, self.replicated)
        carry = self._prologue(self.outer, batch)
        for layer_params, i in zip(self.layers, self._index):
            carry, kv_cache = self._layer(layer_params, carry, kv_cache, i, batch)
        return self._epilogue(self.outer, carry, batch), kv_cache

    def lower(self, kv_cache: KVCache, batch: StepInput) -> list:
        """The bucket of `batch` (its shapes) lowered, not yet compiled: three programs."""
        batch = jax.device_put(batch, self.replicated)
        carry = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.replicated),
                             jax.eval_shape(self._prologue, self.outer, batch))
        return [
            self._prologue.lower(self.outer, batch),
            self._layer.lower(self.layers[0], carry, kv_cache, self._index[0], batch),
            self._epilogue.lower(self.outer, carry, batch),
        ]
