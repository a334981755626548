"""The torchax fallback: any Hugging Face causal LM behind servax's step contract.

The transformers model is built on CPU (its parameters on the meta device when the
checkpoint can be read as it lies: then each device reads only its slice of the files); its
parameters and buffers become JAX arrays placed on the mesh and passed to the step function as arguments (never
closed over, or XLA would bake them into the program as constants). Under jit the model
runs through torchax with the ragged batch as one row ([1, T] ids and positions, no HF
cache); every attention layer goes through `registry.torchax_attention`, which writes the
layer's paged KV cache and attends with `runtime.ops.attention.paged_attention`. Only the
rows at `logits_indices` reach the LM head (`logits_to_keep` with an index tensor).

    loaded = load_torchax(resolved, dtype="bfloat16")   # -> runtime.ops.step.LoadedModel
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from registry.errors import ModelLoadError
from registry.model_info import ModelInfo, jax_dtype, read_model_info
from registry.native import kv_repeat
from registry.torchax_attention import (
    ATTN_IMPLEMENTATION,
    EXPERTS_IMPLEMENTATION,
    StepContext,
    register_implementations,
    step_context,
)
from registry.torchax_compat import import_torchax
from registry.torchax_layers import nest_layer_params, split_layers
from registry.weights import place_int8_groups
from runtime.ops.layered import layered_forward
from runtime.ops.mesh import logical_axis_size, logical_to_spec, make_mesh
from runtime.ops.step import KVCache, KVCacheSpec, LoadedModel, StepInput, make_step_input

# Megatron-style tensor parallelism over HF module names (the last name component).
# "column": split the output features; "row": split the input features (one all-reduce
# after it); "vocab": split the vocabulary. "kv_column": split the output features by KV
# head when the model's KV heads divide the axis, else replicated (the attention then
# repeats the KV heads, see StepContext.kv_repeat). Anything else is replicated.
# Each kind names the logical axis of its split dimension (_KIND_AXIS); runtime.ops.mesh's
# rules map it to a mesh axis, and a split is used only where it divides the dimension.
PARTITION_RULES: tuple[tuple[str, str], ...] = (
    (r"(q|gate|up|gate_up)_proj|c_fc|fc1|fc_in|w1|w3|dense_h_to_4h|query|in_proj", "column"),
    # K/V, and fused q|k|v laid out by KV-head group: [heads, 3, head_dim] (GPT-NeoX, Bloom,
    # Persimmon) or [kv_heads, group + 2, head_dim] (Falcon). A split that cuts a KV head
    # would make every step gather K/V; Falcon's multi-query [q heads | k | v] has 1 KV head.
    (r"(k|v)_proj|key|value|query_key_value", "kv_column"),
    # Fused block-major [q | k | v] (GPT-2, GPT-BigCode, MPT, DBRX, Phi-3): a column split
    # cuts across the blocks, not between heads, so the model's own split would reshard
    # them every layer (q, k and v are also kept whole: StepContext.qkv_sharding).
    (r"qkv_proj|c_attn|Wqkv", "replicated"),
    (r"o_proj|out_proj|down_proj|fc2|fc_out|c_proj|dense|w2|dense_4h_to_h|wo|Wo", "row"),
    (r"embed_tokens|wte|embed_in|word_embeddings|lm_head|embed_out", "vocab"),
)
logger = logging.getLogger("servax.registry")

_NOT_ROUTED = (
    "{arch} cannot be served by the torchax fallback: its attention does not go through "
    "transformers' AttentionInterface, so it cannot be routed to servax's paged KV cache"
)
_EXPERT_PARAMS = {"gate_up_proj": "column", "up_proj": "column", "down_proj": "row"}
_KIND_AXIS = {"column": "column", "row": "row", "vocab": "vocab", "kv_column": "kv_heads"}


def _check_servable(resolved: Any, model_cls: Any) -> None:
    """Refuse, before loading weights, what the torchax path cannot serve."""
    if not getattr(model_cls, "_supports_attention_backend", False) and not model_cls._can_set_attn_implementation():
        raise ModelLoadError(_NOT_ROUTED.format(arch=resolved.architecture))


def _model_class(resolved: Any, trust_remote_code: bool) -> Any:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = resolved.hf_config
    arch = resolved.architecture
    if getattr(config, "auto_map", None) and "AutoModelForCausalLM" in config.auto_map:
        if not trust_remote_code:
            raise ModelLoadError(
                f"{resolved.model_id} ({arch}) needs custom code from its repository "
                f"(auto_map); servax does not run remote code unless trust_remote_code is set"
            )
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(config.auto_map["AutoModelForCausalLM"], str(resolved.path))
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelLoadError(
            f"{resolved.model_id} ({arch}, model_type={config.model_type!r}) has no causal-LM head in "
            f"transformers (AutoModelForCausalLM does not know it); it cannot generate text"
        )
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def load_torchax(
    resolved: Any, *, dtype: Any = "float32", mesh: jax.sharding.Mesh | None = None, info: ModelInfo | None = None,
    int8_groups: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> LoadedModel:
    """Wrap a transformers causal LM so it runs as a servax step function.

    Args:
        resolved: the resolved model; only .model_id, .path, .hf_config and .architecture
            are read (and .trust_remote_code if present).
        dtype: "float32", "bfloat16" or "float16" (or the jnp dtype), for weights and KV cache.
        mesh: where to place the weights (runtime.ops.mesh.make_mesh); default one device.
            Weights follow PARTITION_RULES.
        info: tokenizer, EOS ids and context length (registry.load reads them); default
            read from `resolved`.
        int8_groups: parameters to keep as int8 with a scale per 32 inputs, by name
            (registry.weights.open_q8_0); each becomes a QuantizedWeight when its shape is the
            parameter's (the caller wraps the step to dequantize).

    Returns:
        a LoadedModel with impl="torchax".

    Raises:
        ModelLoadError: the architecture cannot be served (no causal-LM head, attention
            not routable to the paged cache, custom code not allowed) or loading failed.
    """
    import torch

    torchax = import_torchax()
    from torchax.interop import JittableModule

    register_implementations()
    dtype = jnp.dtype(jax_dtype(dtype, resolved.hf_config))
    torch_dtype = getattr(torch, dtype.name)
    trust_remote_code = bool(getattr(resolved, "trust_remote_code", False))
    model_cls = _model_class(resolved, trust_remote_code)
    _check_servable(resolved, model_cls)

    kwargs: dict[str, Any] = dict(dtype=torch_dtype, attn_implementation=ATTN_IMPLEMENTATION)
    if model_cls._can_set_experts_implementation():
        kwargs["experts_implementation"] = EXPERTS_IMPLEMENTATION
    model, sources = _build_model(resolved, model_cls, kwargs)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)

    module = JittableModule(model)  # drops tied duplicates (lm_head.weight == embed weight)
    param_names, buffer_names = list(module.params), list(module.buffers)
    env = torchax.default_env()
    # Host views (no copy) of every parameter and buffer: the checkpoint's memory-mapped tensors,
    # or the torch tensors from_pretrained filled; each device then reads only its own slice.
    tensors = {**module.params, **module.buffers}
    host_params = {name: sources[name] if name in sources else _host_array(t) for name, t in tensors.items()}
    dtypes = {name: _numpy_dtype(t.dtype) for name, t in tensors.items()}

    accepts_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    def forward(model, input_ids, position_ids, logits_indices):
        kw = dict(input_ids=input_ids, position_ids=position_ids, use_cache=False, return_dict=False)
        if accepts_logits_to_keep:
            return model(**kw, logits_to_keep=logits_indices)[0][0]  # [S, vocab]
        return model(**kw)[0][0][logits_indices]

    def _call(params, batch, ctx):
        ids = batch.input_ids.astype(jnp.int32)[None]  # [1, T]
        pos = batch.positions.astype(jnp.int32)[None]  # [1, T]
        t_params, t_buffers, t_ids, t_pos, t_idx = env.j2t_iso((
            {k: params[k] for k in param_names}, {k: params[k] for k in buffer_names},
            ids, pos, batch.logits_indices.astype(jnp.int32),
        ))
        with step_context(ctx), env, torch.no_grad(), warnings.catch_warnings():
            # HF code asks for int64 indices (torch.long); with x64 off JAX keeps them int32,
            # which holds any token id, position or expert index.
            warnings.filterwarnings("ignore", message="Explicitly requested dtype int64")
            out = module.functional_call(forward, t_params, t_buffers, t_ids, t_pos, t_idx)
        return env.t2j_iso(out)

    abstract = {name: jax.ShapeDtypeStruct(arr.shape, dtypes[name]) for name, arr in host_params.items()}
    num_heads, kv_spec = _probe_kv_spec(resolved, abstract, _call, dtype)
    mesh = make_mesh() if mesh is None else mesh
    axis = logical_axis_size("kv_heads", mesh)
    # Store each KV head r times so the cache splits by head over the model axis, as the
    # native path does; kept at 1 where grouped-query attention could not map the copies
    # (the axis does not divide the query heads; registry.load refuses that anyway).
    repeat = kv_repeat(kv_spec.num_kv_heads, axis)
    if num_heads % (kv_spec.num_kv_heads * repeat):
        repeat = 1
    # Fused block-major q|k|v weights are replicated ("replicated" rule), yet sharding
    # propagation would still compute their product split by columns (following the
    # head-split attention after it), and the model's slicing into q, k and v would then move
    # blocks between devices in every layer. Whole q, k, v slice locally.
    fused = any(_rule_kind(n.rpartition(".")[2]) == "replicated" for n, _ in model.named_modules())
    qkv_sharding = NamedSharding(mesh, P()) if fused and axis > 1 else None
    split = split_layers(model, module, env, forward, param_names, buffer_names, kv_spec.num_layers, abstract,
                         repeat, qkv_sharding)
    param_shardings = {
        name: partition_spec(model, name, host_params[name].shape, mesh, num_kv_heads=kv_spec.num_kv_heads)
        for name in host_params
    }
    int8_groups = {name: qs for name, qs in (int8_groups or {}).items()
                   if name in host_params and tuple(qs[0].shape) == tuple(host_params[name].shape)}
    params = {
        name: jax.make_array_from_callback(
            arr.shape, NamedSharding(mesh, param_shardings[name]),
            lambda index, arr=arr, dt=dtypes[name]: np.asarray(arr[index], dtype=dt))
        for name, arr in host_params.items() if name not in int8_groups
    }
    for name, (q, scale) in int8_groups.items():
        params[name], param_shardings[name] = place_int8_groups(name, q, scale, mesh, param_shardings[name],
                                                                dtypes[name])
    del host_params, abstract
    # The step function reparametrizes every parameter and buffer with the JAX arrays, so
    # the torch copies are dead weight: keep only their shapes (halves host memory).
    module.params.clear()
    module.buffers.clear()
    model.to("meta")

    def step_fn(params: dict[str, jax.Array], kv_cache: KVCache, batch: StepInput):
        ctx = StepContext(batch, kv_cache, kv_repeat=repeat, qkv_sharding=qkv_sharding)
        logits = _call(params, batch, ctx)
        return logits.astype(jnp.float32), ctx.collect()

    stages = None
    if isinstance(split, tuple):  # uniform decoder layers: one program per layer, not the model unrolled
        stages, layers_name = split
        params = nest_layer_params(params, layers_name, kv_spec.num_layers)
        param_shardings = nest_layer_params(param_shardings, layers_name, kv_spec.num_layers)
        step_fn = functools.partial(layered_forward, stages=stages)
    else:
        logger.info("%s: stepped as one program per bucket, not layer by layer: %s", resolved.architecture, split)
    kv_spec = dataclasses.replace(kv_spec, num_kv_heads=kv_spec.num_kv_heads * repeat)
    return LoadedModel(
        step_fn=step_fn,
        stages=stages,
        params=params,
        kv_spec=kv_spec,
        param_shardings=param_shardings,
        kv_partition_spec=kv_spec.partition_spec(mesh),
        impl="torchax",
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        **vars(info or read_model_info(resolved)),
    )


def _probe_kv_spec(resolved: Any, params: Any, call: Any, dtype: Any) -> tuple[int, KVCacheSpec]:
    """Trace the model once abstractly (no compute) and read each layer's Q and K shapes.

    params may be abstract (jax.ShapeDtypeStruct). Returns the number of query heads and
    the cache spec with the model's own KV heads (no repeat). Also proves the attention
    really goes through the registered function: a model whose layers never call it cannot
    be served.
    """
    batch = make_step_input(
        input_ids=np.zeros(2), positions=np.arange(2), slot_mapping=np.arange(2),
        block_tables=np.zeros((1, 1)), seq_lens=np.array([2]), query_start_loc=np.array([0, 2]),
        logits_indices=np.array([1]), num_seqs=1, num_tokens=2,
    )
    ctx = StepContext(batch, None)
    try:
        jax.eval_shape(lambda p, b: call(p, b, ctx), params, batch)
    except Exception as e:  # a model that cannot be traced by torchax
        raise ModelLoadError(
            f"{resolved.architecture} could not be traced through torchax: {type(e).__name__}: {e}"
        ) from e
    if not ctx.seen:
        raise ModelLoadError(_NOT_ROUTED.format(arch=resolved.architecture))
    if ctx.unsupported:
        raise ModelLoadError(
            f"{resolved.architecture} cannot be served by the torchax fallback: its layers use "
            f"{', '.join(sorted(set(ctx.unsupported.values())))}, which servax's paged attention does not implement"
        )
    num_layers = max(ctx.seen) + 1
    shapes = {ctx.seen[i][:3] for i in ctx.seen}
    if sorted(ctx.seen) != list(range(num_layers)) or len(shapes) != 1:
        raise ModelLoadError(
            f"{resolved.architecture}: layers have differing KV shapes {sorted(shapes)} or gaps in "
            f"layer_idx ({sorted(ctx.seen)}); servax's KV cache needs one shape for all layers"
        )
    (num_heads, num_kv_heads, head_dim), = shapes
    return int(num_heads), KVCacheSpec(
        num_layers=num_layers, num_kv_heads=int(num_kv_heads), head_dim=int(head_dim), dtype=dtype
    )


def partition_spec(
    model: Any, name: str, shape: tuple[int, ...], mesh: jax.sharding.Mesh, *, num_kv_heads: int
) -> P:
    """The PartitionSpec of parameter `name` (HF naming) under `mesh`, per PARTITION_RULES.

    The split dimension gets its kind's logical axis (_KIND_AXIS), which runtime.ops.mesh's
    rules map to a mesh axis where it divides the dimension; K/V projections
    ("kv_column") also need `num_kv_heads`, the model's own KV heads, to divide that
    axis. Linear weights are [out, in]; GPT-2's Conv1D weights are [in, out]; embeddings
    are [vocab, hidden]; fused MoE experts are [E, out, in] (or [E, in, out] when the
    experts module says is_transposed).
    """
    owner_name, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        return P()
    split = _split_dim(owner, owner_name.rpartition(".")[2], leaf, len(shape))
    if split is None:
        return P()
    dim, kind = split
    if kind == "kv_column" and num_kv_heads % logical_axis_size("kv_heads", mesh):
        return P()
    axes: list[str | None] = [None] * len(shape)
    axes[dim] = _KIND_AXIS[kind]
    return logical_to_spec(axes, shape, mesh)


def _rule_kind(module_leaf: str) -> str | None:
    """The PARTITION_RULES kind of a module by the last component of its name, or None."""
    return next((k for pattern, k in PARTITION_RULES if re.fullmatch(pattern, module_leaf)), None)


def _split_dim(owner: Any, owner_leaf: str, leaf: str, ndim: int) -> tuple[int, str] | None:
    """(dimension, rule kind) of parameter `leaf` of module `owner` that tensor parallelism splits, or None."""
    import torch
    from transformers.pytorch_utils import Conv1D

    if ndim == 3 and leaf in _EXPERT_PARAMS:  # fused experts [E, out, in] / [E, in, out]
        kind = _EXPERT_PARAMS[leaf]
        out_dim, in_dim = (2, 1) if getattr(owner, "is_transposed", False) else (1, 2)
        return (out_dim if kind == "column" else in_dim), kind
    kind = _rule_kind(owner_leaf)
    if kind in (None, "replicated") or leaf not in ("weight", "bias"):
        return None
    if isinstance(owner, torch.nn.Embedding):
        return (0, kind) if kind == "vocab" and leaf == "weight" else None
    if isinstance(owner, Conv1D):  # weight [in, out], bias [out]
        out_dim, in_dim = 1, 0
    elif isinstance(owner, torch.nn.Linear):  # weight [out, in], bias [out]
        out_dim, in_dim = 0, 1
    else:
        return None
    if leaf == "bias":
        return (0, kind) if kind != "row" else None
    return (in_dim if kind == "row" else out_dim), kind


def _build_model(resolved: Any, model_cls: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, np.ndarray]]:
    """The transformers model and, where the checkpoint can be read as it lies, its tensors.

    When every parameter of the model is a tensor of the same name and shape in the
    checkpoint's safetensors files, the model is built with its parameters on the meta device
    (no memory; buffers such as rotary frequencies are computed as usual) and the parameters'
    sources are the memory-mapped checkpoint tensors: each process then reads only the slices
    of its own devices and never holds the whole model. Otherwise (renamed or converted
    weights, other formats) transformers' from_pretrained loads the model into host memory.

    Returns (model, sources): sources maps parameter names to host arrays (empty: read the
    model's own tensors).
    """
    from registry.weights import open_checkpoint

    config = copy.deepcopy(resolved.hf_config)  # transformers writes the attention choice into it
    try:
        tensors = open_checkpoint(resolved.path)
        with _parameters_on_meta():
            model = model_cls._from_config(config, **kwargs)
        # A tied parameter has several names; the checkpoint holds it under one of them.
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        shapes = {id(p): tuple(p.shape) for p in model.parameters()}
        found = {key: next((n for n in names if n in tensors and tuple(tensors[n].shape) == shapes[key]), None)
                 for key, names in aliases.items()}
        unmatched = [aliases[key][0] for key, name in found.items() if name is None]
        unmatched += [n for n, b in model.named_buffers() if b.device.type == "meta"]  # made from parameters
        if not unmatched:
            logger.info("%s: parameters read from the checkpoint's files by slice", resolved.model_id)
            return model, {alias: tensors[found[key]] for key, names in aliases.items() for alias in names}
        reason = f"{len(unmatched)} tensors are not in the checkpoint as they are in the model, e.g. {unmatched[0]}"
    except Exception as e:  # noqa: BLE001 - any surprise: the reference loader below decides
        reason = repr(e)
    logger.info("%s: loading with transformers' from_pretrained into host memory (%s)", resolved.model_id, reason)
    try:
        model = model_cls.from_pretrained(str(resolved.path), config=copy.deepcopy(resolved.hf_config), **kwargs)
    except (ValueError, ImportError, OSError) as e:
        raise ModelLoadError(f"could not load {resolved.model_id} ({resolved.architecture}) with transformers: {e}") from e
    return model, {}


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules constructed inside get parameters on the meta device (shape and dtype, no
    memory); buffers stay on the CPU with their computed values."""
    import torch

    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _numpy_dtype(torch_dtype: Any) -> np.dtype:
    import torch

    return np.dtype(jnp.bfloat16) if torch_dtype == torch.bfloat16 else torch.empty(0, dtype=torch_dtype).numpy().dtype


def _host_array(tensor: Any) -> Any:
    """A CPU torch tensor as a NumPy array sharing its memory (bfloat16 via ml_dtypes)."""
    import torch

    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(jnp.bfloat16)
    return tensor.numpy()
