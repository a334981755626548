"""The native table (HF architecture -> models_jax entry) and the native load path.

The table is built from the `ENTRY` each module of models_jax declares, so serving a new
architecture natively takes a new module there and nothing here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import pkgutil
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

import models_jax
from models_jax import ModelEntry
from registry.errors import ModelLoadError
from registry.model_info import ModelInfo, ResolvedModel
from registry.peft import read_peft_adapter
from registry.weights import load_params
from runtime.ops.layered import layered_forward
from runtime.ops.mesh import MODEL_AXIS, logical_axis_size
from runtime.ops.step import KVCacheSpec, LayerStages, LoadedModel


def declared_models(package: Any = models_jax) -> dict[str, ModelEntry]:
    """HF architecture -> ModelEntry, from the `ENTRY` of every module of `package`.

    Raises:
        ImportError: two modules declare the same architecture.
    """
    table: dict[str, ModelEntry] = {}
    declared_by: dict[str, str] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        entry = getattr(module, "ENTRY", None)
        if not isinstance(entry, ModelEntry):
            continue
        for arch in entry.architectures:
            if arch in table:
                raise ImportError(f"{arch} is declared by two native models: {declared_by[arch]} and {module.__name__}")
            table[arch], declared_by[arch] = entry, module.__name__
    return table


NATIVE_MODELS: dict[str, ModelEntry] = declared_models()


def load_native(resolved: ResolvedModel, *, dtype: jnp.dtype, mesh: Mesh, info: ModelInfo,
                int8_groups: dict | None = None, layered: bool = False,
                expert_parallel: bool = False) -> LoadedModel:
    """Build the native model, its params read from the checkpoint onto `mesh`.

    int8_groups: weights to keep as int8 with a scale per 32 inputs (registry.weights.load_params).
    layered: for a model with layer stages, params["layers"] as a list of per-layer weights,
        quantized ones each in its own kind (the form runtime/ops/layered.py steps; step_fn then
        calls the layer stage once per layer) instead of arrays stacked [num_layers, ...].

    Raises:
        ModelLoadError: unsupported config features, missing or misshapen weights.
    """
    entry = NATIVE_MODELS[resolved.architecture]
    try:
        args = entry.config_from_hf(resolved.hf_config)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"{resolved.model_id} ({resolved.architecture}): {e}") from e
    if entry.kv_spec is None:  # K and V per KV head, each stored often enough to split over the model axis
        args = dataclasses.replace(args, kv_repeat=kv_repeat(args.num_kv_heads, logical_axis_size("kv_heads", mesh)))
        windowed = entry.window_blocks and any(args.sliding_windows)  # sliding layers keep only their window
        kv_spec = KVCacheSpec(args.num_layers, args.num_kv_heads * args.kv_repeat, args.head_dim, dtype,
                              sliding_windows=tuple(args.sliding_windows) if windowed else None)
    else:  # what the model says a block holds (a latent per token: whole on every device)
        kv_spec = entry.kv_spec(args, dtype)
        if kv_spec.num_kv_heads > 1:  # heads of its own shape (Gemma 4): stored often enough to split, as above
            args = dataclasses.replace(args, kv_repeat=kv_repeat(kv_spec.num_kv_heads, logical_axis_size("kv_heads",
                                                                                                         mesh)))
            kv_spec = entry.kv_spec(args, dtype)
    args = _place_experts(args, mesh, expert_parallel, resolved)
    layered = layered and entry.stages is not None
    params, shardings = load_params(resolved.path, entry.weight_table(args), mesh, dtype, int8_groups,
                                    per_layer=layered)
    stages = None
    step_fn = functools.partial(entry.forward, args=args)
    if entry.stages is not None:
        pack_head = functools.partial(entry.pack_head, args=args) if entry.pack_head is not None else None
        stages = LayerStages(*(functools.partial(fn, args=args) for fn in entry.stages), num_layers=args.num_layers,
                             stacks=entry.layer_stacks(args) if entry.layer_stacks is not None else (),
                             fuse=entry.fuse_layer, pack_layer=entry.pack_layer, pack_head=pack_head,
                             hidden=functools.partial(entry.hidden, args=args) if entry.hidden is not None else None)
    if layered:  # {name: [per-layer arrays]} -> [{name: array} per layer] (a quantized weight's specs per layer too)
        is_parts = lambda x: isinstance(x, list)  # noqa: E731
        is_spec = lambda x: isinstance(x, (list, PartitionSpec))  # noqa: E731
        for key, n in stages.stack_sizes.items():
            params[key] = [jax.tree.map(lambda parts, i=i: parts[i], params[key], is_leaf=is_parts) for i in range(n)]
            shardings[key] = [jax.tree.map(lambda s, i=i: s[i] if isinstance(s, list) else s, shardings[key],
                                           is_leaf=is_spec) for i in range(n)]
        step_fn = functools.partial(layered_forward, stages=stages)
    targets = entry.lora_targets(args) if entry.lora_targets is not None else None
    read_adapter = None if targets is None else functools.partial(
        read_peft_adapter, targets=targets, num_layers=kv_spec.num_layers, dtype=kv_spec.dtype)
    return LoadedModel(
        step_fn=step_fn,
        stages=stages,
        params=params,
        param_shardings=shardings,
        kv_spec=kv_spec,
        kv_partition_spec=kv_spec.partition_spec(mesh),
        impl="jax",
        lora_targets=targets,
        read_lora_adapter=read_adapter,
        vocab_size=int(resolved.hf_config.vocab_size),
        **vars(info),
    )


def _place_experts(args: Any, mesh: Mesh, expert_parallel: bool, resolved: ResolvedModel) -> Any:
    """A mixture-of-experts model's args with the mesh its experts split over (whole experts per
    device with `expert_parallel`, else each expert's features).

    Raises:
        ModelLoadError: expert_parallel on a dense model, or experts (or their features) that
            the model axis does not divide.
    """
    config = getattr(args, "moe", None)
    if config is None:
        if expert_parallel:
            raise ModelLoadError(f"{resolved.model_id}: enable_expert_parallel needs a mixture-of-experts model; "
                                 f"{resolved.architecture} has no experts")
        return args
    ways = mesh.shape[MODEL_AXIS]
    split, name = ((config.num_experts, "num_experts") if expert_parallel
                   else (config.intermediate_size, "the experts' intermediate size"))
    if split % ways:
        raise ModelLoadError(f"{resolved.model_id}: {name} = {split} does not split over a model axis of {ways} "
                             f"devices; choose a tensor_parallel_size that divides it"
                             + ("" if expert_parallel else " or set enable_expert_parallel"))
    placed = dataclasses.replace(config, expert_parallel=expert_parallel, mesh=mesh if ways > 1 else None)
    return dataclasses.replace(args, moe=placed)


def kv_repeat(num_kv_heads: int, tp: int) -> int:
    """How many times to store each KV head so that the stored heads split evenly over tp devices.

    lcm(num_kv_heads, tp) stored heads: 1 when tp divides the KV heads; tp // num_kv_heads
    when there are fewer KV heads than devices (each device then holds the one KV head
    its query heads read). Because registry.load checked that tp divides num_heads, and
    num_kv_heads divides num_heads, lcm(num_kv_heads, tp) divides num_heads too, so the
    grouped-query mapping stays exact (see models_jax/__init__.py).
    """
    return tp // math.gcd(num_kv_heads, tp)
