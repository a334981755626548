"""LoRA adapter slots in a model's params: many fine-tunes of one base model, batched in one step.

An engine with `enable_lora` holds `max_loras + 1` adapter *slots* in the step's params
(slot 0: no adapter, all zeros). For every projection a model declares as a LoRA target
(`LoadedModel.lora_targets`, PEFT's module names: q_proj, k_proj, ...), each layer carries

    a: [slots, in_features, max_lora_rank]      b: [slots, max_lora_rank, out_features]

with the adapter's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) folded into b, and each
token of a step carries its request's slot (`StepInput.lora_slots`). The model adds

    delta = ((x @ a[s]) masked to the token's slot s) @ b      (one pair of dense matmuls)

so a step mixes requests of different adapters and of the base model, and loading an adapter
is a write into a slot: same shapes, nothing recompiles. Reading an adapter from disk is
registry/peft.py's job; which adapters sit in which slots is runtime/engine/lora.py's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from runtime.ops.mesh import logical_to_spec
from runtime.ops.step import LoadedModel

class LoRAError(ValueError):
    """An adapter that cannot be served (its rank, its modules, its shapes, its files)."""


@dataclasses.dataclass(frozen=True)
class LoRATarget:
    """A projection a model lets LoRA adapt: y = x @ W, x [T, in_features], y [T, out_features].

    in_axis / out_axis: logical axes (runtime.ops.mesh) of the base weight's input and output, so
    the slots shard as the weight does. head_dim / head_repeat: the output is heads of
    head_dim, each stored head_repeat times (the KV heads a model repeats for the mesh).
    """

    in_features: int
    out_features: int
    in_axis: str | None = None
    out_axis: str | None = None
    head_dim: int = 0
    head_repeat: int = 1

    @property
    def stored_out_features(self) -> int:
        return self.out_features * self.head_repeat


@dataclasses.dataclass
class LoRAAdapter:
    """An adapter read from disk, in slot form: per target, a [layers, in, r_max] and a
    [layers, r_max, out] array (zeros where it adapts nothing)."""

    name: str  # the adapter's name (LoRARequest.lora_name)
    rank: int
    modules: tuple[str, ...]
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def add_lora_slots(model: LoadedModel, *, max_loras: int, max_rank: int, mesh: Mesh) -> None:
    """Give a model's layers their (zero) adapter slot tables, before a runner takes its params.

    params[layers]["lora"][module] = {"a": [layers, slots, in, r], "b": [layers, slots, r, out]}
    (slots = max_loras + 1), sharded on the logical axes of the base weight's input / output,
    and param_shardings to match.

    Raises:
        LoRAError: the model offers no LoRA targets (the torchax path, native mixture-of-experts models).
    """
    if not model.lora_targets:
        served = "LoRA adapters run on the dense native JAX models (Llama, Mistral, Qwen2, Qwen3)"
        config = model.hf_config
        if model.impl == "jax" and (getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)):
            arch = (getattr(config, "architectures", None) or ["?"])[0]
            raise LoRAError(f"{model.model_id} is a mixture-of-experts model ({arch}): adapters on "
                            f"mixture-of-experts layers are not served; {served}")
        raise LoRAError(f"{served}; {model.model_id} runs on the {model.impl} path, which cannot apply adapter slots")
    key = model.stages.layers_key if model.stages is not None else "layers"
    if isinstance(model.params[key], list) or "lora" in model.params[key]:
        raise LoRAError(
            f"{model.model_id}: this loaded model already serves an engine (its adapter slots or layers belong "
            "to it); a second engine with enable_lora needs its own registry.load"
        )
    num_layers = model.kv_spec.num_layers
    slots, tables, specs = max_loras + 1, {}, {}
    for name, t in model.lora_targets.items():
        shapes = {"a": (num_layers, slots, t.in_features, max_rank),
                  "b": (num_layers, slots, max_rank, t.stored_out_features)}
        axes = {"a": ("layers", None, t.in_axis, None), "b": ("layers", None, None, t.out_axis)}
        specs[name] = {ab: logical_to_spec(axes[ab], shapes[ab], mesh) for ab in shapes}
        tables[name] = {
            ab: jax.jit(functools.partial(jnp.zeros, shape, model.kv_spec.dtype),
                        out_shardings=NamedSharding(mesh, specs[name][ab]))()
            for ab, shape in shapes.items()
        }
    model.params = {**model.params, key: {**model.params[key], "lora": tables}}
    model.param_shardings = {**model.param_shardings, key: {**model.param_shardings[key], "lora": specs}}


class LoRASlots:
    """Writes adapters into the slot tables of a model's params (see add_lora_slots).

    Same shapes every time: one small program per table shape, nothing compiles after warmup.
    """

    def __init__(self, targets: dict[str, LoRATarget], layers_key: str):
        self.targets = targets
        self.layers_key = layers_key
        self._writers: dict[Any, Any] = {}

    @classmethod
    def of(cls, model: LoadedModel) -> "LoRASlots | None":
        """The slot writer of a model whose params carry adapter slots, else None."""
        key = model.stages.layers_key if model.stages is not None else "layers"
        if not model.lora_targets or key not in model.params:
            return None  # the torchax path: no adapter slots
        layers = model.params[key]
        return cls(model.lora_targets, key) if "lora" in (layers[0] if isinstance(layers, list) else layers) else None

    def write(self, model: LoadedModel, slot: int, adapter: LoRAAdapter | None) -> None:
        """Write `adapter` (None: zeros) into device slot `slot` of every layer's tables."""
        layers = model.params[self.layers_key]
        for name in self.targets:
            for j, ab in enumerate(("a", "b")):
                stacked = None if adapter is None else adapter.weights[name][j]  # [layers, ...]
                if isinstance(layers, list):  # one table per layer (runtime/ops/layered.py)
                    for i, lp in enumerate(layers):
                        table = lp["lora"][name][ab]
                        value = np.zeros(table.shape[1:], table.dtype) if stacked is None else stacked[i]
                        lp["lora"][name][ab] = self._writer(table, 0)(table, np.int32(slot), value)
                else:  # stacked [layers, slots, ...]
                    table = layers["lora"][name][ab]
                    value = np.zeros(table.shape[:1] + table.shape[2:], table.dtype) if stacked is None else stacked
                    layers["lora"][name][ab] = self._writer(table, 1)(table, np.int32(slot), value)

    def _writer(self, table: jax.Array, axis: int):
        key = (table.shape, table.dtype, table.sharding, axis)
        if key not in self._writers:
            def write(table, slot, value):
                return jax.lax.dynamic_update_index_in_dim(table, value.astype(table.dtype), slot, axis)
            self._writers[key] = jax.jit(write, out_shardings=table.sharding)
        return self._writers[key]
