"""Model registry: find a checkpoint, pick its implementation, load it as a LoadedModel.

    resolved = registry.resolve("servax-tiny/llama")            # files, config, architecture, impl
    model = registry.load("servax-tiny/llama", dtype="bfloat16")  # runtime.ops.step.LoadedModel

Native JAX models (models_jax) serve the architectures in `NATIVE_MODELS` (built from
the models' own declarations); every other architecture falls back to the transformers
model wrapped by torchax.
"""

from __future__ import annotations

import collections
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jax.sharding import Mesh

from registry.errors import ModelLoadError
from registry.model_info import ResolvedModel, jax_dtype, read_model_info, read_tokenizer
from registry.native import NATIVE_MODELS, load_native
from registry.resolve import MODEL_IMPLS, model_impl_setting, resolve
from runtime.ops.mesh import check_mesh, logical_axis_size, make_mesh
from runtime.ops.step import LoadedModel

__all__ = [
    "MODEL_IMPLS", "ModelLoadError", "NATIVE_MODELS", "ResolvedModel", "check_tensor_parallel", "load", "resolve",
]

logger = logging.getLogger("servax.registry")


def load(
    model: str | os.PathLike | ResolvedModel, *, model_impl: str = "auto", dtype: str = "float32",
    mesh: Mesh | None = None, revision: str | None = None, trust_remote_code: bool = False,
    tokenizer: str | os.PathLike | None = None, tokenizer_mode: str = "auto", skip_tokenizer_init: bool = False,
    hf_overrides: dict[str, Any] | None = None, impl: str | None = None, quantization: str | None = None,
    layered: bool = False, expert_parallel: bool = False,
) -> LoadedModel:
    """Resolve (unless given a ResolvedModel) and load a model, params placed on `mesh`.

    Args:
        model: model ID (local folder, servax-tiny/<name>, hub ID) or a ResolvedModel.
        model_impl: auto | jax | torchax (ignored when `model` is already resolved).
        dtype: float32 | bfloat16 | float16 | auto (the checkpoint's own dtype).
        mesh: the mesh to place params on (runtime.ops.mesh.make_mesh); default one device.
        revision: the hub revision of the model (and of `tokenizer`, when given).
        trust_remote_code: let the checkpoint's own modelling / tokenizer code run.
        tokenizer: a tokenizer source (folder or hub ID) other than the model's own.
        tokenizer_mode: "auto" / "hf" (fast tokenizer) or "slow" (vLLM's setting).
        skip_tokenizer_init: load no tokenizer; the model serves token ids only.
        hf_overrides: config attributes to set before the model is built (vLLM's hf_overrides).
        impl: deprecated alias of model_impl (DeprecationWarning).
        quantization: None; "int8": the matrices stored as per-output-channel int8
            (runtime/ops/quantization.py), on either path; "gguf": a GGUF checkpoint's Q8_0
            tensors kept as stored (int8, a scale per 32 inputs), and natively its Q4_0 / Q4_1 /
            Q4_K and Q5_0 / Q5_1 / Q5_K tensors (4- or 5-bit values, a scale and an offset per 32
            inputs) and Q6_K ones (6-bit values, a scale per 16 inputs; the torchax path takes the
            5- and 6-bit ones as int8 blocks); other types dequantized.
        layered: native models with layer stages, unquantized or GGUF: the decoder layers'
            weights as a list of per-layer weights, the form runtime/ops/layered.py steps (no
            stacked [num_layers, ...] arrays to assemble here and split there; a GGUF file's
            layers each in the kind it stores them in).
        expert_parallel: a mixture-of-experts model's experts split over the mesh's model axis
            (whole experts per device) instead of each expert's features (vLLM's
            enable_expert_parallel); native MoE models only.

    Raises:
        ModelLoadError: anything that stops the model from loading, with what to change
            (among them a model axis that does not divide num_attention_heads).
    """
    model_impl = model_impl_setting(model_impl, impl)
    resolved = model if isinstance(model, ResolvedModel) else resolve(
        model, model_impl=model_impl, revision=revision, trust_remote_code=trust_remote_code,
        hf_overrides=hf_overrides,
    )
    jdtype = jax_dtype(dtype, resolved.hf_config)
    mesh = make_mesh() if mesh is None else mesh
    try:
        check_mesh(mesh)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    check_tensor_parallel(resolved, logical_axis_size("q_heads", mesh))
    logger.info("loading %s (%s) with model_impl=%s dtype=%s",
                resolved.model_id, resolved.architecture, resolved.impl, dtype)
    tokenizer_args = dict(tokenizer=tokenizer, revision=revision, tokenizer_mode=tokenizer_mode)
    if resolved.impl == "jax" and not skip_tokenizer_init:
        # The tokenizer (and transformers' slow import under it) is read on a thread while the weights load.
        info = read_model_info(resolved, skip_tokenizer_init=True)
        with ThreadPoolExecutor(1, thread_name_prefix="servax-tokenizer") as pool:
            tokenizer_read = pool.submit(read_tokenizer, resolved, **tokenizer_args)
            loaded = _load_weights(resolved, jdtype, mesh, info, quantization, layered, expert_parallel)
            loaded.tokenizer = tokenizer_read.result()
        return loaded
    info = read_model_info(resolved, skip_tokenizer_init=skip_tokenizer_init, **tokenizer_args)
    return _load_weights(resolved, jdtype, mesh, info, quantization, layered, expert_parallel)


def _load_weights(resolved: ResolvedModel, jdtype: Any, mesh: Mesh, info: Any, quantization: str | None,
                  layered: bool = False, expert_parallel: bool = False) -> LoadedModel:
    """The model's weights loaded on `mesh` (and quantized as asked), with `info`'s fields."""
    int8_groups = _gguf_stored(resolved) if quantization == "gguf" else None
    if resolved.impl == "torchax":
        try:
            from registry.torchax_model import load_torchax
        except ImportError as e:
            raise ModelLoadError(
                f"{resolved.model_id}: architecture {resolved.architecture} needs the torchax fallback, "
                f"which is not available ({e}); native: {', '.join(sorted(NATIVE_MODELS))}"
            ) from e
        if expert_parallel:
            raise ModelLoadError(f"{resolved.model_id}: enable_expert_parallel needs a native mixture-of-experts "
                                 f"model; {resolved.architecture} runs on the torchax path")
        loaded = load_torchax(resolved, dtype=jdtype, mesh=mesh, info=info, int8_groups=int8_groups)
        reduce_axes = _torchax_quant_axes
    else:
        loaded = load_native(resolved, dtype=jdtype, mesh=mesh, info=info, int8_groups=int8_groups,
                             layered=layered and quantization in (None, "gguf"),
                             expert_parallel=expert_parallel)
        reduce_axes = _native_quant_axes
    if quantization == "gguf":
        from registry.weights import stored_bits
        from runtime.ops.quantization import count_quantized, serve_quantized

        serve_quantized(loaded)
        kinds = collections.Counter({8: "int8 blocks", 4: "4-bit", 5: "5-bit", 6: "6-bit"}[stored_bits(parts)]
                                    for parts in int8_groups.values())
        logger.info("%s: %d weights kept quantized as the GGUF file stores them (of %d tensors: %s; a scale per 32 "
                    "inputs, per 16 for 6-bit); other GGUF types were dequantized when converted",
                    resolved.model_id, count_quantized(loaded.params), len(int8_groups),
                    ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())))
    elif quantization is not None:
        from runtime.ops.quantization import quantize_model

        try:
            quantize_model(loaded, quantization, mesh, reduce_axes)
        except ValueError as e:
            raise ModelLoadError(f"{resolved.model_id}: {e}") from e
        logger.info("%s: weights quantized to %s", resolved.model_id, quantization)
    return loaded


def _gguf_stored(resolved: ResolvedModel) -> dict:
    """The quantized tensors of a converted GGUF checkpoint, as stored: Q8_0
    (registry.weights.open_q8_0) and, for native models, Q4_0 / Q4_1 / Q4_K, Q5_0 / Q5_1 / Q5_K
    and Q6_K (open_four_bit, open_five_bit, open_six_bit; the torchax path takes the 5- and 6-bit
    ones as int8 blocks).

    Raises:
        ModelLoadError: the checkpoint was not converted from a GGUF file.
    """
    from registry.gguf import MARKER, is_current_conversion
    from registry.weights import open_five_bit, open_four_bit, open_q8_0, open_six_bit, requantized_int8_blocks

    if not (resolved.path / MARKER).exists():
        raise ModelLoadError(
            f"{resolved.model_id}: quantization='gguf' reads a GGUF file's quantized tensors, and this checkpoint "
            "is not a GGUF file; pass the .gguf file, or use quantization='int8' to quantize these weights"
        )
    if not is_current_conversion(resolved.path):
        raise ModelLoadError(
            f"{resolved.model_id}: {resolved.path} was converted from GGUF by an older servax, without the "
            "quantized tensors as stored; delete that folder and it is converted again on the next start"
        )
    stored = open_q8_0(resolved.path)
    wider = {**open_five_bit(resolved.path), **open_six_bit(resolved.path)}
    if resolved.impl == "jax":  # the torchax path keeps int8 blocks only (4-bit types come dequantized, 5- and
        stored.update(open_four_bit(resolved.path))  # 6-bit ones requantized to int8 blocks)
        stored.update(wider)
    else:
        stored.update({name: requantized_int8_blocks(*parts[:3]) for name, parts in wider.items()})
    return stored


def _native_quant_axes(name: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The input axes of a native (models_jax) matrix, by its param path; None: keep it float.

    Stacked layer weights have a leading layer axis: layers.q [L, D, H, hd] reduces D,
    layers.o [L, H, hd, D] reduces (H, hd); the embedding [V, D] one scale per row. A MoE
    layer's experts (layers.mlp.experts.gate / up / down / gate_up, [L, E, in, out]) reduce
    their input axis: one scale per expert and output channel; the router stays float (a
    small matrix whose rounding would move tokens to other experts), as do the experts' biases.
    """
    leaf = name.rsplit(".", 1)[-1]
    if name == "embed":
        return (1,)
    if name == "lm_head":
        return (0,)
    if name.startswith("layers.") and ".experts." in name:
        return (2,) if len(shape) == 4 and leaf in ("gate", "up", "down", "gate_up") else None
    if name.startswith("layers.") and len(shape) >= 3:
        if leaf in ("q", "k", "v", "gate", "up", "down"):
            return (1,)
        if leaf == "o":
            return (1, 2)
    return None


def _torchax_quant_axes(name: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """transformers' 2-D weights: Linear [out, in] and Embedding [vocab, D] reduce axis 1
    (one scale per output channel / row); norms and biases stay float."""
    if len(shape) == 2 and name.endswith("weight") and "norm" not in name.lower():
        return (1,)
    return None


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
