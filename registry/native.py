"""The native table (HF architecture -> models_jax module) and the native load path."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from registry.resolve import ResolvedModel
from registry.weights import load_params
from runtime.errors import ModelLoadError
from runtime.step import KVCacheSpec, LoadedModel

# HF architecture name -> module implementing the models_jax interface (see models_jax/__init__.py).
NATIVE_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "models_jax.llama",
    "MistralForCausalLM": "models_jax.llama",
    "Qwen2ForCausalLM": "models_jax.llama",
    "Qwen3ForCausalLM": "models_jax.llama",
}


def load_native(resolved: ResolvedModel, *, dtype: jnp.dtype, mesh: Mesh) -> dict:
    """Build the native model: the LoadedModel fields that depend on the implementation.

    Raises:
        ModelLoadError: unsupported config features, missing or misshapen weights.
    """
    module = importlib.import_module(NATIVE_MODELS[resolved.architecture])
    try:
        args = module.config_from_hf(resolved.hf_config)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"{resolved.model_id} ({resolved.architecture}): {e}") from e
    args = dataclasses.replace(args, kv_repeat=kv_repeat(args.num_kv_heads, mesh.shape["model"]))
    params, shardings = load_params(resolved.path, module.weight_table(args), mesh, dtype)
    return dict(
        step_fn=functools.partial(module.forward, args=args),
        params=params,
        param_shardings=shardings,
        kv_spec=KVCacheSpec(args.num_layers, args.num_kv_heads * args.kv_repeat, args.head_dim, dtype),
        kv_partition_spec=P(None, None, "model", None),
    )


def kv_repeat(num_kv_heads: int, tp: int) -> int:
    """How many times to store each KV head so that the stored heads split evenly over tp devices.

    lcm(num_kv_heads, tp) stored heads: 1 when tp divides the KV heads; tp // num_kv_heads
    when there are fewer KV heads than devices (each device then holds the one KV head
    its query heads read). Because registry.load checked that tp divides num_heads, and
    num_kv_heads divides num_heads, lcm(num_kv_heads, tp) divides num_heads too, so the
    grouped-query mapping stays exact (see models_jax/__init__.py).
    """
    return tp // math.gcd(num_kv_heads, tp)
