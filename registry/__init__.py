"""Model registry: find a checkpoint, pick its implementation, load it as a LoadedModel.

    resolved = registry.resolve("servax-tiny/llama")            # files, config, architecture, impl
    model = registry.load("servax-tiny/llama", dtype="bfloat16")  # runtime.step.LoadedModel

Native JAX models (models_jax) serve the architectures in `NATIVE_MODELS`; every other
architecture falls back to the transformers model wrapped by torchax.
"""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from registry.native import NATIVE_MODELS, load_native
from registry.resolve import ResolvedModel, resolve
from runtime.errors import ModelLoadError
from runtime.step import LoadedModel

__all__ = ["NATIVE_MODELS", "ResolvedModel", "check_tensor_parallel", "load", "resolve"]

logger = logging.getLogger("servax.registry")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def load(
    model: str | ResolvedModel, *, impl: str = "auto", dtype: str = "float32", mesh: Mesh | None = None,
    revision: str | None = None, trust_remote_code: bool = False,
) -> LoadedModel:
    """Resolve (unless given a ResolvedModel) and load a model, params placed on `mesh`.

    Args:
        model: model ID (local folder, servax-tiny/<name>, hub ID) or a ResolvedModel.
        impl: auto | jax | torchax (ignored when `model` is already resolved).
        dtype: float32 | bfloat16 | float16 | auto (the checkpoint's own dtype).
        mesh: a Mesh with a "model" axis; default a 1-device mesh.

    Raises:
        ModelLoadError: anything that stops the model from loading, with what to change
            (among them a model axis that does not divide num_attention_heads).
    """
    resolved = model if isinstance(model, ResolvedModel) else resolve(
        model, impl=impl, revision=revision, trust_remote_code=trust_remote_code
    )
    jdtype = _dtype(dtype, resolved)
    if mesh is None:
        mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    if "model" not in mesh.axis_names:
        raise ModelLoadError(f"the mesh must have a 'model' axis, it has {mesh.axis_names}")
    check_tensor_parallel(resolved, mesh.shape["model"])
    logger.info(
        "loading %s (%s) with impl=%s dtype=%s", resolved.model_id, resolved.architecture, resolved.impl, dtype
    )

    if resolved.impl == "torchax":
        try:
            from registry.torchax_model import load_torchax
        except ImportError as e:
            raise ModelLoadError(
                f"{resolved.model_id}: architecture {resolved.architecture} needs the torchax fallback, "
                f"which is not available ({e}); native: {', '.join(sorted(NATIVE_MODELS))}"
            ) from e
        return load_torchax(resolved, dtype=jdtype, mesh=mesh)

    cfg = resolved.hf_config
    tokenizer = _tokenizer(resolved)
    return LoadedModel(
        **load_native(resolved, dtype=jdtype, mesh=mesh),
        tokenizer=tokenizer,
        hf_config=cfg,
        impl="jax",
        model_id=resolved.model_id,
        max_model_len=int(cfg.max_position_embeddings),
        vocab_size=int(cfg.vocab_size),
        eos_token_ids=eos_token_ids(resolved),
    )


def check_tensor_parallel(resolved: ResolvedModel, tp: int) -> None:
    """Refuse a model axis that does not split the attention heads evenly (both model paths).

    Each device must hold whole query heads; KV heads that do not divide `tp` are
    replicated instead (the models declare that), so only the query heads are checked.

    Raises:
        ModelLoadError: num_attention_heads % tp != 0, naming the sizes that would work.
    """
    heads = getattr(resolved.hf_config, "num_attention_heads", None)
    if tp <= 1 or not isinstance(heads, int) or heads % tp == 0:
        return
    divisors = [n for n in range(1, heads + 1) if heads % n == 0]
    raise ModelLoadError(
        f"{resolved.model_id}: num_attention_heads={heads} is not divisible by the model axis size {tp} "
        f"(tensor_parallel_size={tp}), so the heads cannot be split evenly over the devices; "
        f"pick a tensor_parallel_size that divides {heads}: {', '.join(map(str, divisors))}"
    )


def _dtype(dtype: str, resolved: ResolvedModel):
    if dtype == "auto":
        dtype = str(getattr(resolved.hf_config, "dtype", None) or "float32").removeprefix("torch.")
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)} or auto")
    return DTYPES[dtype]


def _tokenizer(resolved: ResolvedModel):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(resolved.path)
    except Exception as e:  # no tokenizer files, or an unreadable one: serve token IDs only
        logger.warning("%s: no usable tokenizer (%s)", resolved.model_id, e)
        return None


def eos_token_ids(resolved: ResolvedModel) -> tuple[int, ...]:
    """End-of-sequence IDs: generation_config.json first, then config.json's eos_token_id."""
    eos = None
    gen = resolved.path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(resolved.hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
