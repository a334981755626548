"""The native table (HF architecture -> models_jax module) and the native load path."""

from __future__ import annotations

import functools
import importlib

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
    tp = mesh.shape["model"]  # registry.load has checked that it divides the query heads
    params, shardings = load_params(resolved.path, module.weight_table(args), mesh, dtype)
    return dict(
        step_fn=functools.partial(module.forward, args=args),
        params=params,
        param_shardings=shardings,
        kv_spec=KVCacheSpec(args.num_layers, args.num_kv_heads, args.head_dim, dtype),
        kv_partition_spec=P(None, None, "model", None) if args.num_kv_heads % tp == 0 else P(),
    )
