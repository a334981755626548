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

Layers of one stack whose weights differ in form (a GGUF file keeps some layers' ffn_down in
Q6_K, the others' in Q4_K: `registry.weights.load_params` hands each layer over in its own kind)
are held as `MixedLayers`: one stack per form (`by_form`), each stacked where it can be, and
which of them holds each layer; a layer program then runs a given pattern of forms.
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


def form(layer: Any) -> tuple:
    """What a layer program's trace depends on: the structure, shapes and dtypes of a layer's weights."""
    leaves, treedef = jax.tree.flatten(layer)
    return treedef, tuple((a.shape, a.dtype) for a in leaves)


@flax.struct.dataclass
class MixedLayers:
    """The layers of one stack in several forms: `stacks[s]` holds the layers of form s (a
    StackedLayers, or a list of per-layer weights), `where[i]` = (s, index in stacks[s]) for
    layer i of the stack. `mixed[i]` reads layer i like a list (Python ints)."""

    stacks: tuple
    where: tuple[tuple[int, int], ...] = flax.struct.field(pytree_node=False)

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, i: int) -> Any:
        s, j = self.where[i]
        return self.stacks[s][j]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def pattern(self, start: int, count: int) -> tuple[int, ...]:
        """The form of each of layers start .. start + count - 1."""
        return tuple(s for s, _ in self.where[start:start + count])

    def per_call(self, start: int, n: int, uniform: int) -> int:
        """Layers per call over layers start .. start + n - 1: the most, dividing `uniform` (what a
        stack of one form runs per call), whose calls' patterns of forms trace no more layers
        (patterns times layers per call) than a program of `uniform` layers per form would:
        compile time as for one form, at the cost of a few more calls."""
        return next(k for k in range(uniform, 0, -1) if uniform % k == 0 and k * len(
            {self.pattern(i, k) for i in range(start, start + n, k)}) <= len(self.stacks) * uniform)

    def for_call(self, start: int, count: int) -> tuple:
        """What a call running layers start .. start + count - 1 takes: each form's StackedLayers
        whole, a list form's layers of this call only (in order)."""
        return tuple(stack if isinstance(stack, StackedLayers) else
                     [stack[j] for s2, j in self.where[start:start + count] if s2 == s]
                     for s, stack in enumerate(self.stacks))

    def indices(self, start: int, count: int) -> list[int]:
        """Each of layers start .. start + count - 1's index in its form's stack."""
        return [j for _, j in self.where[start:start + count]]


def by_form(layers: list) -> list | MixedLayers:
    """`layers` as they are where all share one form, else as MixedLayers (one list per form, in
    the order the forms first appear)."""
    forms: dict[tuple, int] = {}
    stacks: list[list] = []
    where = []
    for layer in layers:
        s = forms.setdefault(form(layer), len(forms))
        if s == len(stacks):
            stacks.append([])
        where.append((s, len(stacks[s])))
        stacks[s].append(layer)
    return layers if len(stacks) == 1 else MixedLayers(tuple(stacks), tuple(where))


def mixed_in_order(run: Any, pattern: tuple[int, ...]) -> Any:
    """A layer program for `len(pattern)` layers of a MixedLayers, layer j of form pattern[j]:
    (each form's weights (MixedLayers.for_call), carry, kv_cache, first, batch), `first` [1 + k]
    int32 the first layer's index in the model, then each layer's index in its form's stack.
    `run`: runtime.ops.layered's (list of layer weights, carry, kv_cache, first index, batch) program."""
    def program(forms: tuple, carry: Any, kv_cache: Any, first: jax.Array, batch: Any):
        taken = [0] * len(forms)
        layers = []
        for j, s in enumerate(pattern):
            if isinstance(forms[s], StackedLayers):
                layers.append(forms[s].layer(first[1 + j]))
            else:
                layers.append(forms[s][taken[s]])
                taken[s] += 1
        return run(layers, carry, kv_cache, first[0], batch)

    return program


def some_layer(layers: list | StackedLayers | MixedLayers) -> Any:
    """A stack's first layer's weights, or (stacked) all of them: what tells whether it is packed."""
    if isinstance(layers, MixedLayers):
        return some_layer(layers.stacks[0])
    return layers.params if isinstance(layers, StackedLayers) else layers[0]
