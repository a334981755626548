"""Run a step a few decoder layers per call: three compiled programs per bucket, not one.

A model that offers `LayerStages` (runtime/ops/step.py) can be stepped as

    carry = prologue(outer_params, batch)                     # program 1
    for i in range(0, num_layers, k):                         # program 2, called L / k times
        for j in range(i, i + k):                             #   (k layers, unrolled)
            carry, kv_cache = layer(layers[j], carry, kv_cache, j, batch)
    logits = epilogue(outer_params, carry, batch)             # program 3

with each layer's weights in arrays of their own. The one-program alternative, a scan
over weights stacked [num_layers, ...], makes XLA:CPU copy every layer's weights out of
the stack before its matmuls, most of a batch-1 decode step's time on the demo model
(benchmarks/RESULTS.md). Here the matmuls read the weights where they lie; the layer program
is compiled once per bucket whatever the depth (the first layer's index is an argument;
k, at most MAX_LAYERS_PER_CALL, divides the depth), and the host dispatches L / k + 2
calls per step asynchronously while the device runs. Each call costs a little beyond its
work (starting the program, handing the carry on; measured in benchmarks/RESULTS.md), which
is why k is not 1; compile time per bucket grows with k, which is why it is capped.

With `wide_seqs` (the runtime gives its largest sequence bucket when attention runs in the
C++ kernel, whose cost does not depend on empty sequence slots) the prologue and layer
programs see the batch's sequence arrays padded to that many slots: they then compile once
per token bucket instead of once per (tokens, sequences) bucket; only the epilogue, which
picks each sequence's row for the LM head, keeps the bucket's own sequence count. With
`pack` (also the CPU kernels' path) the layers' matrices and the LM head are packed for the
C++ matmul of runtime/ops/matmul.py, where the model offers it (LayerStages.pack_layer,
pack_head) and the weights are whole on every device; each stack's layers are then stacked
again where they can be (runtime/ops/stacked.py: the kernels read a packed matrix in the
stack, at its layer), so a call takes a few arrays rather than a dozen per layer.
With `compute_float32` (a half-precision model on CPU) the prologue's carry is widened to
float32, so the layers compute in float32 while the weights stay as stored (the packed
kernels widen them in registers; under tensor parallelism XLA's dots convert them).

With async scheduling (runtime/engine/core.py) some input ids are still on the device: the
prologue also takes the previous step's samples (`prev`, padded to `feed_rows`) and, per token,
the row whose sample is its id (`input_from`, -1: its own id); a step whose ids are all on the
host passes zeros and -1s, so one prologue program serves both. A step of at most
WHOLE_STEP_MAX_TOKENS tokens (a lone decode) runs prologue, layers and epilogue as one program.

Shardings are pinned: the carry and the batch are replicated on the mesh, the weights and
the KV cache keep their own, so every call of a bucket hits the same compiled program
(and ahead-of-time compilation from shapes alone matches what serving later calls).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from runtime.ops.host_batch import HostBatch, widen_seqs  # noqa: F401 - widen_seqs: part of this module's API
from runtime.ops.matmul import is_packed, packed_matmul_available
from runtime.ops.stacked import (MixedLayers, StackedLayers, by_form, form, mixed_in_order, some_layer, stack,
                                 stackable)
from runtime.ops.step import KVCache, LayerStages, LoadedModel, StepInput

logger = logging.getLogger("servax.engine")

# Decoder layers one program runs (unrolled), at most: the largest divisor of the depth up to this.
MAX_LAYERS_PER_CALL = 6
# Steps of at most this many tokens (a lone decode) run as one program: prologue, every layer
# and epilogue. Each call costs the host ~0.1-0.2 ms, which a one-token step, short and run
# ahead (async scheduling), pays on the same cores; one more program to compile at start-up
# (benchmarks/RESULTS.md, stop 46).
WHOLE_STEP_MAX_TOKENS = 1


def layers_per_call(num_layers: int, most: int = MAX_LAYERS_PER_CALL) -> int:
    """How many decoder layers each call of the layer program runs: the largest divisor of
    `num_layers` that is at most `most` (30 layers: 6 per call; 28: 4; a prime depth: 1)."""
    return max(k for k in range(1, min(most, num_layers) + 1) if num_layers % k == 0)


def layered_forward(params: dict, kv_cache: KVCache, batch: StepInput, *, stages: LayerStages):
    """The whole step from its stages, with each stack's params[key] a list of per-layer
    weights (the form LayeredStep leaves a model in); one program when jitted whole."""
    outer = {k: v for k, v in params.items() if k not in stages.stack_sizes}
    carry = stages.prologue(outer, batch)
    for i, (key, j) in enumerate(_layer_order(stages)):
        layer_params = params[key][j]
        carry, kv_cache = stages.layer(layer_params, carry, kv_cache, jnp.int32(i), batch)
    return stages.epilogue(outer, carry, batch), kv_cache


def _layer_order(stages: LayerStages) -> list[tuple[str, int]]:
    """(stack key, index in the stack) of every layer, in layer order."""
    order, taken = [], dict.fromkeys(stages.stack_sizes, 0)
    for key, n in stages.layer_runs:
        order += [(key, taken[key] + j) for j in range(n)]
        taken[key] += n
    return order


def _unstack(stacked: Any, specs: Any, num_layers: int, mesh: Mesh) -> list:
    """Per-layer copies of stacked [num_layers, ...] weights, each placed with its spec
    minus the layer axis; the stacked arrays are freed one by one as they are split."""
    per_layer: list[list] = [[] for _ in range(num_layers)]
    leaves, treedef = jax.tree.flatten(stacked)
    spec_leaves = treedef.flatten_up_to(specs)
    for w, spec in zip(leaves, spec_leaves):
        sharding = NamedSharding(mesh, PartitionSpec(*tuple(spec)[1:]))
        if w.is_fully_addressable:  # split on the host: no program to compile (~2 s of a cold start)
            host = np.array(w)  # a copy: the parts may alias it, and w is freed below
            parts = [jax.device_put(host[i], sharding) for i in range(num_layers)]
        else:  # shards in other processes: every process splits its own
            split = jax.jit(lambda w: tuple(w[i] for i in range(num_layers)), out_shardings=(sharding,) * num_layers)
            parts = split(w)
        for i, part in enumerate(parts):
            per_layer[i].append(part)
        w.delete()
    return [jax.tree.unflatten(treedef, parts) for parts in per_layer]


def _fuse_in_place(layers: list, fuse: Any, replicated: NamedSharding) -> None:
    """layers[i] = fuse(layers[i]) (or any other change of form, e.g. packing), one layer at
    a time (layer i's old arrays are freed as it is replaced: at most one layer is held
    twice); weights whole on every device."""
    joined = jax.jit(fuse, out_shardings=replicated)
    for i, layer_params in enumerate(layers):
        layers[i] = joined(layer_params)


def _chain(changes: list) -> Any:
    """The changes of form applied in order, as one function."""
    def chained(layer: Any) -> Any:
        for change in changes:
            layer = change(layer)
        return layer

    return chained


def _fuse_changes(fuse: Any, layer: Any) -> bool:
    """Whether `fuse` would change the form of anything in `layer`, its structure or an array's
    shape or dtype (False for weights joined, or packed, already)."""
    joined = jax.eval_shape(fuse, layer)
    return jax.tree.structure(joined) != jax.tree.structure(layer) or any(
        (a.shape, a.dtype) != (b.shape, b.dtype) for a, b in zip(jax.tree.leaves(joined), jax.tree.leaves(layer)))


def _packed(layer: Any) -> bool:
    """Whether a layer's weights hold packed matrices (runtime/ops/matmul.py)."""
    return any(is_packed(w) for w in jax.tree.leaves(layer, is_leaf=is_packed))


def _for_int8_activations(params: Any) -> Any:
    """params with their packed int8, 4- and 5-bit matrices laid out for int8 activations
    (runtime.ops.matmul.PackedWeight.for_int8_activations); the rest as it is."""
    return jax.tree.map(lambda w: w.for_int8_activations() if is_packed(w) else w, params, is_leaf=is_packed)


def _for_float_activations(params: Any) -> Any:
    """params with their packed 5-bit matrices, which only int8 activations multiply, requantized
    to int8 blocks (PackedWeight.for_float_activations); the rest as it is."""
    return jax.tree.map(lambda w: w.for_float_activations() if is_packed(w) else w, params, is_leaf=is_packed)


def _unpacking(stage: Any, batch_arg: int) -> Any:
    """`stage` taking a HostBatch as its argument `batch_arg`, unpacked for it."""
    def unpacked(*args):
        args = list(args)
        args[batch_arg] = args[batch_arg].unpack()
        return stage(*args)

    return unpacked


def _fed(prologue: Any) -> Any:
    """The prologue taking two more arguments, for async scheduling (runtime/engine/core.py):
    `prev` [R] int32, the previous step's sampled ids on the device, and `input_from` [T]
    int32, for each token whose id is one of them its row there (-1: the batch's own id)."""
    def fed(outer: dict, batch: StepInput, prev: jax.Array, input_from: jax.Array) -> Any:
        ids = jnp.where(input_from >= 0, prev[jnp.maximum(input_from, 0)], batch.input_ids)
        return prologue(outer, dataclasses.replace(batch, input_ids=ids))

    return fed


def _float32_carry(prologue: Any) -> Any:
    """The prologue with its carry's half-precision arrays widened to float32: the layers then
    compute in float32 whatever dtype the weights are stored in."""
    def widened(outer: dict, batch: StepInput) -> Any:
        wide = lambda a: a.astype(jnp.float32) if a.dtype in (jnp.bfloat16, jnp.float16) else a  # noqa: E731
        return jax.tree.map(wide, prologue(outer, batch))

    widened.computes_float32 = True
    return widened


def _layers_in_order(layer: Any) -> Any:
    """A stage function running several decoder layers in one program:
    (list of layer weights, carry, kv_cache, first index, batch) -> (carry, kv_cache).

    The layer is traced once per program, not once per layer (a nested jit: its layers share
    shapes); XLA inlines the calls, so the program is the same and start-up traces 1/k as much."""
    traced_once = jax.jit(layer)

    def run(layer_params: list, carry: Any, kv_cache: KVCache, first: jax.Array, batch: StepInput):
        for j, params in enumerate(layer_params):
            carry, kv_cache = traced_once(params, carry, kv_cache, first + j, batch)
        return carry, kv_cache

    return run


def _whole_step(stages: LayerStages) -> Any:
    """(outer, each stack's layers, kv_cache, batch, epilogue batch, prev, input_from) -> (logits,
    kv_cache): a step as one program (the layer traced once, as in _layers_in_order)."""
    prologue, layer = _unpacking(_fed(stages.prologue), 1), jax.jit(stages.layer)

    def run(outer: dict, stacks: dict, kv_cache: KVCache, batch: HostBatch, narrow: HostBatch, prev: jax.Array,
            input_from: jax.Array):
        carry = prologue(outer, batch, prev, input_from)
        unpacked = batch.unpack()
        for i, (key, j) in enumerate(_layer_order(stages)):
            carry, kv_cache = layer(stacks[key][j], carry, kv_cache, jnp.int32(i), unpacked)
        return stages.epilogue(outer, carry, narrow.unpack()), kv_cache

    return run


def _stacked_in_order(layer: Any, per_call: int) -> Any:
    """_layers_in_order's program for a StackedLayers: (stack, carry, kv_cache, first, batch),
    `first` [2] int32 the first layer's index in the model and in the stack, runs `per_call`
    layers from there (each a view of the stack)."""
    run = _layers_in_order(layer)

    def stacked(layers: StackedLayers, carry: Any, kv_cache: KVCache, first: jax.Array, batch: StepInput):
        return run([layers.layer(first[1] + j) for j in range(per_call)], carry, kv_cache, first[0], batch)

    return stacked


@dataclasses.dataclass
class _Call:
    """One call of a layer program: `per_call` layers of stack `key` from its layer `start`,
    the first of them layer `first` of the model (an int32 already on the device; of a
    StackedLayers, [first, start]; of a MixedLayers, [first, each layer's index in its form])."""

    program: Any
    key: str
    start: int
    per_call: int
    first: jax.Array
    forms: tuple | None = None  # of a MixedLayers: what the call takes (MixedLayers.for_call)


class LayeredStep:
    """Steps a LoadedModel a few layers per call (see the module docstring).

    Takes ownership of `model.params`: each stack's stacked layer weights are replaced by
    per-layer arrays (model.params[key] becomes a list, model.param_shardings likewise; or,
    packed, a StackedLayers of the layers' final form, which `[i]` reads like the list), and
    model.step_fn by `layered_forward`, which computes the same from that form. A model
    already in that form (a second engine on the same LoadedModel) is used as it is. A model
    whose layers lie in several stacks (LayerStages.stacks) gets a layer program per stack
    (and per layers-per-call its runs need). A stack whose layers come in different forms (a
    GGUF file's layers in different kinds) is held as runtime.ops.stacked.MixedLayers, one stack
    per form, with a program per pattern of forms its calls run.
    """

    def __init__(self, model: LoadedModel, mesh: Mesh, kv_sharding: NamedSharding | KVCache,
                 wide_seqs: int | None = None, pack: bool = False, compute_float32: bool = False,
                 int8_activations: bool = False, feed_rows: int = 1):
        stages = model.stages
        assert stages is not None
        if compute_float32 and not getattr(stages.prologue, "computes_float32", False):
            model.stages = stages = dataclasses.replace(stages, prologue=_float32_carry(stages.prologue))
        sizes = stages.stack_sizes
        self.outer = {k: v for k, v in model.params.items() if k not in sizes}
        self.stacks: dict[str, list | StackedLayers | MixedLayers] = {}  # each stack's per-layer weights
        for key, n in sizes.items():
            if isinstance(model.params[key], (list, StackedLayers, MixedLayers)):  # per layer, or another engine's
                self.stacks[key] = model.params[key]
            else:
                self.stacks[key] = _unstack(model.params[key], model.param_shardings[key], n, mesh)
        replicated = NamedSharding(mesh, PartitionSpec())
        whole = all(a.sharding.is_fully_replicated for a in jax.tree.leaves(list(self.stacks.values())))
        if pack and packed_matmul_available() and whole and stages.pack_head is not None and all(
                a.sharding.is_fully_replicated for a in jax.tree.leaves(self.outer)):
            if _fuse_changes(stages.pack_head, self.outer):
                self.outer = jax.jit(stages.pack_head, out_shardings=replicated)(self.outer)
            activations = _for_int8_activations if int8_activations else _for_float_activations
            if _fuse_changes(activations, self.outer):
                self.outer = jax.jit(activations, out_shardings=replicated)(self.outer)
        for key, layers in self.stacks.items():  # changes of each layer's form, one pass (one program) a layer
            if not isinstance(layers, list):  # another engine's final form
                continue
            forms = list({form(layer): layer for layer in layers}.values())  # a layer of each form
            changes = []
            if stages.fuse is not None and whole and any(_fuse_changes(stages.fuse, layer) for layer in forms):
                changes.append(stages.fuse)
            if pack and packed_matmul_available() and whole and stages.pack_layer is not None and any(
                    _fuse_changes(stages.pack_layer, jax.eval_shape(_chain(changes), layer)) for layer in forms):
                changes.append(stages.pack_layer)
                changes.append(_for_int8_activations if int8_activations else _for_float_activations)
            if changes:
                _fuse_in_place(layers, _chain(changes), replicated)
            # a few arrays a step (runtime/ops/stacked.py): a stack per form of layer
            stacked = lambda ls: stack(ls) if pack and _packed(ls[0]) and stackable(ls) else ls  # noqa: E731
            mixed = by_form(layers)
            self.stacks[key] = (MixedLayers(tuple(map(stacked, mixed.stacks)), mixed.where)
                                if isinstance(mixed, MixedLayers) else stacked(layers))
        # Whether the layers' products run on packed weights (here or by an earlier engine).
        self.packed = _packed(some_layer(next(iter(self.stacks.values()))))
        model.params = {**self.outer, **self.stacks}
        model.param_shardings = {**jax.tree.map(lambda a: a.sharding.spec, self.outer),
                                 **{key: jax.tree.map(lambda a: a.sharding.spec, layers)
                                    if not isinstance(layers, list) else
                                    [jax.tree.map(lambda a: a.sharding.spec, layer) for layer in layers]
                                    for key, layers in self.stacks.items()}}
        model.step_fn = functools.partial(layered_forward, stages=stages)

        self.replicated = rep = replicated
        outer_shardings = jax.tree.map(lambda a: a.sharding, self.outer)
        # A KVCache of shardings carries the cache's static metadata (attention backend, mesh).
        kv = kv_sharding if isinstance(kv_sharding, KVCache) else KVCache(kv_sharding, kv_sharding)
        self._prologue = jax.jit(_unpacking(_fed(stages.prologue), 1), in_shardings=(outer_shardings, rep, rep, rep),
                                 out_shardings=rep)
        # What the prologue takes when no input id is on the device: `feed_rows` zeros (the
        # previous step's samples are padded to that many rows) and -1 for every token.
        self._no_feed = jax.device_put(np.zeros(feed_rows, np.int32), rep)
        self._own_ids: dict[int, np.ndarray] = {}
        # (stack, layers per call[, pattern of forms]) -> its program
        programs: dict[tuple, Any] = {}
        self.calls: list[_Call] = []
        taken, first_layer = dict.fromkeys(sizes, 0), 0
        for key, n in stages.layer_runs:
            layers, k = self.stacks[key], layers_per_call(n)
            if isinstance(layers, MixedLayers):
                self.calls += self._mixed_calls(stages, key, taken[key], n, k, first_layer, programs, kv)
            else:
                stacked = isinstance(layers, StackedLayers)
                if (key, k) not in programs:
                    programs[key, k] = self._layer_program(
                        _stacked_in_order(stages.layer, k) if stacked else _layers_in_order(stages.layer),
                        layers if stacked else layers[:k], kv)
                self.calls += [_Call(programs[key, k], key, taken[key] + i, k, jax.device_put(
                    np.array([first_layer + i, taken[key] + i], np.int32) if stacked else np.int32(first_layer + i),
                    rep)) for i in range(0, n, k)]
            taken[key] += n
            first_layer += n
        # The first call of each program: what lowering a bucket compiles.
        self._distinct = list({id(c.program): c for c in self.calls}.values())
        self._epilogue = jax.jit(_unpacking(stages.epilogue, 2), in_shardings=(outer_shardings, rep, rep),
                                 out_shardings=rep)
        self._whole = jax.jit(_whole_step(stages), in_shardings=(
            outer_shardings, jax.tree.map(lambda a: a.sharding, self.stacks), kv, rep, rep, rep, rep),
            out_shardings=(rep, kv), donate_argnums=(2,))
        self.wide_seqs = wide_seqs  # see the module docstring

    def _layer_program(self, run: Any, weights: Any, kv: KVCache) -> Any:
        """`run` (weights, carry, kv_cache, first, batch) jitted for weights placed as `weights` are,
        the carry, `first` and the batch replicated, the cache donated."""
        rep, placed = self.replicated, jax.tree.map(lambda a: a.sharding, weights)
        return jax.jit(_unpacking(run, 4), in_shardings=(placed, rep, kv, rep, rep), out_shardings=(rep, kv),
                       donate_argnums=(2,))

    def _mixed_calls(self, stages: LayerStages, key: str, start: int, n: int, uniform: int, first_layer: int,
                     programs: dict, kv: KVCache) -> list[_Call]:
        """The calls running layers start .. start + n - 1 of MixedLayers stack `key` (layer
        first_layer of the model the first of them; `uniform` layers a call in one form), a program
        per pattern of forms (in `programs`)."""
        layers, calls = self.stacks[key], []
        k = layers.per_call(start, n, uniform)
        for i in range(start, start + n, k):
            pattern, forms = layers.pattern(i, k), layers.for_call(i, k)
            if (key, k, pattern) not in programs:
                programs[key, k, pattern] = self._layer_program(
                    mixed_in_order(_layers_in_order(stages.layer), pattern), forms, kv)
            first = np.array([first_layer + i - start, *layers.indices(i, k)], np.int32)
            calls.append(_Call(programs[key, k, pattern], key, i, k, jax.device_put(first, self.replicated), forms))
        logger.info("%s: %d layers in %d forms of weights (a stack each), %d a call, %d layer programs", key, n,
                    len(layers.stacks), k, len({id(c.program) for c in calls}))
        return calls

    @property
    def layers(self) -> list:
        """Every layer's weights, in layer order."""
        return [self.stacks[c.key][c.start + j] for c in self.calls for j in range(c.per_call)]

    def _weights(self, c: _Call) -> Any:
        """What call c's program takes as its layers' weights: their list, or the whole stack."""
        if c.forms is not None:
            return c.forms
        layers = self.stacks[c.key]
        return layers if isinstance(layers, StackedLayers) else layers[c.start:c.start + c.per_call]

    @property
    def per_call(self) -> int:
        """Layers per call of the first layer program (of the only one, for most models)."""
        return self.calls[0].per_call

    def _inputs(self, batch: StepInput) -> tuple[HostBatch, HostBatch]:
        """(batch for the prologue and layers, batch for the epilogue), each one host buffer
        (HostBatch): each program takes it in its own call, through jit's C++ argument path
        (a `jax.device_put` of a step's arrays costs more of the host's time than the calls)."""
        wide = batch if self.wide_seqs is None else widen_seqs(batch, self.wide_seqs)
        narrow = HostBatch.pack(batch)
        return narrow if wide is batch else HostBatch.pack(wide), narrow

    def _feed(self, num_tokens: int, prev: jax.Array | None, input_from: np.ndarray | None) -> tuple:
        """The prologue's (prev, input_from): the given ones, or those of a batch whose input ids
        are all its own."""
        if input_from is not None:
            return prev, input_from
        if num_tokens not in self._own_ids:
            self._own_ids[num_tokens] = np.full(num_tokens, -1, np.int32)
        return self._no_feed, self._own_ids[num_tokens]

    def __call__(self, kv_cache: KVCache, batch: StepInput, prev: jax.Array | None = None,
                 input_from: np.ndarray | None = None) -> tuple[jax.Array, KVCache]:
        """One step: (logits, kv_cache), dispatched without waiting (kv_cache is donated). With
        `input_from` (async scheduling), the tokens it marks take their ids from `prev`, the
        previous step's samples still on the device (see _fed)."""
        wide, narrow = self._inputs(batch)
        feed = self._feed(wide.padded_num_tokens, prev, input_from)
        if wide.padded_num_tokens <= WHOLE_STEP_MAX_TOKENS:
            return self._whole(self.outer, self.stacks, kv_cache, wide, narrow, *feed)
        carry = self._prologue(self.outer, wide, *feed)
        for c in self.calls:
            carry, kv_cache = c.program(self._weights(c), carry, kv_cache, c.first, wide)
        return self._epilogue(self.outer, carry, narrow), kv_cache

    def lower(self, kv_cache: KVCache, batch: StepInput, seen: set | None = None) -> list:
        """The bucket of `batch` (its shapes) lowered, not yet compiled: prologue, layers and
        epilogue; with `seen`, the prologue and layers only if their shapes are not in it
        (then added): buckets that share them share those programs."""
        wide, narrow = self._inputs(batch)
        feed = self._feed(wide.padded_num_tokens, None, None)
        if wide.padded_num_tokens <= WHOLE_STEP_MAX_TOKENS:
            return [self._whole.lower(self.outer, self.stacks, kv_cache, wide, narrow, *feed)]
        carry = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.replicated),
                             jax.eval_shape(self._prologue, self.outer, wide, *feed))
        shared = (wide.padded_num_tokens, wide.padded_num_seqs)
        programs = []
        if seen is None or shared not in seen:
            programs.append(self._prologue.lower(self.outer, wide, *feed))
            programs += [c.program.lower(self._weights(c), carry, kv_cache, c.first, wide) for c in self._distinct]
            if seen is not None:
                seen.add(shared)
        return programs + [self._epilogue.lower(self.outer, carry, narrow)]
