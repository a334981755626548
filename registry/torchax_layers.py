"""A torchax-wrapped transformers model as LayerStages: decoder layers stepped a few per call.

Traced whole, a transformers model's forward unrolls its Python loop over the decoder
layers: every bucket's program holds all of them (megabytes of machine code each on a deep
model; a cold start compiled for minutes and a warm one spent most of its time loading
executables). When the layers are uniform (same class, same weights' names, shapes
and dtypes, same attention settings), the forward is split without knowing the architecture,
into runtime.ops.layered's three programs:

    prologue: the model's forward with every decoder layer swapped for a module that raises
        with its inputs at the first call: those inputs (hidden states, rotary tables,
        positions, ...; tensors only, anything else stays as the first trace saw it) are the
        carry.
    layer:    decoder layer 0's module run with layer i's weights on the carry; its attention
        writes KV layer i (a traced index, registry.torchax_attention.StepContext.layer).
    epilogue: the forward again with every decoder layer swapped for one that returns the
        carried hidden states: the final norm and the LM head (the embedding it recomputes
        is unused, so XLA drops it).

Architectures that do not split this way keep the whole-model step (`split_layers` says why
in the log).

The decoder layer's Linear submodules are grouped by input in the first trace of the layer
(q/k/v, gate/up in most decoders; a Linear alone is a group of one), and `fuse` joins each
group's weights into one matrix stored [in, out], so the layer runs one wide matmul where
the model has several narrow ones, in the layout the native models use (what their
fuse_layer does by name; on XLA:CPU a matmul of a few rows costs about as much by [D, F] as
by [D, 2F], and HF's [out, in] weights multiply more slowly than [in, out]; figures in
benchmarks/RESULTS.md). The runtime joins them only where a layer's weights are whole on every device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

from registry.torchax_attention import StepContext, step_context
from runtime.ops.matmul import PackedWeight, pack_matrix
from runtime.ops.step import KVCache, LayerStages, StepInput

logger = logging.getLogger("servax.registry")

LAYERS_KEY = "layers"
# Module attributes that make two decoder layers behave differently with the same weights.
_LAYER_SETTINGS = ("sliding_window", "is_sliding", "attention_type", "layer_type", "is_causal", "scaling",
                   "use_sliding_window", "rope_type", "head_dim", "num_key_value_groups")
_STATIC_TYPES = (type(None), bool, int, float, str)
_TENSOR = object()  # a tensor's slot among the decoder layer's call arguments


@dataclasses.dataclass(frozen=True)
class LinearGroup:
    """torch.nn.Linear submodules of a decoder layer that read the same input, in call order
    (one or more)."""

    members: tuple[str, ...]  # module names relative to the layer
    out_features: tuple[int, ...]
    bias: bool

    @property
    def weight_key(self) -> str:
        """The joined weight's name in a fused layer's params: [in, sum of out_features],
        the members' outputs side by side in order."""
        return "+".join(self.members) + ".joined_weight"

    @property
    def bias_key(self) -> str:
        return "+".join(self.members) + ".joined_bias"


def _join_transposed(weights: list[Any]) -> Any | None:
    """[out_i, in] Linear weights (float, or QuantizedWeight scaled per row or in groups along
    `in`) as one [in, sum out_i], joined as the native models join theirs
    (models_jax.weights.join_outputs); None when they cannot be one."""
    from models_jax.weights import join_outputs
    from runtime.ops.quantization import QuantizedWeight

    def in_out(w: Any) -> Any:
        if not isinstance(w, QuantizedWeight):
            return w.T
        # transposed, a grouping along the last axis (`in`) lies along the first
        return QuantizedWeight(w.q.T, w.scale.T, group_size=w.group_size,
                               group_axis=-2 if w.group_axis % w.q.ndim == 1 else -1)

    return join_outputs([in_out(w) for w in weights])


def _plain_linears(layer: Any) -> dict[str, Any]:
    import torch

    return {name: m for name, m in layer.named_modules()
            if isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward}


class SplitError(Exception):
    """The model's forward cannot be split into per-layer programs (the message says why)."""


class _Captured(Exception):
    def __init__(self, args: tuple, kwargs: dict):
        super().__init__("decoder layer inputs captured")
        self.call = (args, kwargs)


def _flatten(tree: Any) -> tuple[list, Any]:
    from torch.utils import _pytree

    return _pytree.tree_flatten(tree)


def _unflatten(leaves: list, spec: Any) -> Any:
    from torch.utils import _pytree

    return _pytree.tree_unflatten(leaves, spec)


def find_decoder_layers(model: Any, num_layers: int) -> tuple[str, Any] | None:
    """(dotted name, ModuleList) of the model's decoder layers: the ModuleList of `num_layers`
    modules whose i-th holds the attention with layer_idx i; None when there is none."""
    import torch

    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) != num_layers or not name:
            continue
        if all(any(getattr(m, "layer_idx", None) == i for m in child.modules()) for i, child in enumerate(module)):
            return name, module
    return None


def _settings(layer: Any) -> list:
    """What distinguishes a layer beyond its weights: each submodule's class and settings."""
    out = []
    for name, m in layer.named_modules():
        values = tuple((k, getattr(m, k)) for k in _LAYER_SETTINGS
                       if isinstance(getattr(m, k, None), _STATIC_TYPES) and hasattr(m, k))
        out.append((name, type(m).__name__, values))
    return out


@dataclasses.dataclass
class TorchaxLayers:
    """The three stage functions over one transformers model (see the module docstring).

    Attributes:
        module: the torchax JittableModule around the model (weights reparametrized per call).
        layers: the model's ModuleList of decoder layers (entries swapped during a trace).
        forward: (model, input_ids, position_ids, logits_indices) -> logits [S, vocab].
        outer_params / outer_buffers: names of the weights outside the decoder layers.
        env: the torchax environment.
        kv_repeat, qkv_sharding: as registry.torchax_attention.StepContext.
    """

    module: Any
    layers: Any
    forward: Callable
    outer_params: list[str]
    outer_buffers: list[str]
    env: Any
    kv_repeat: int = 1
    qkv_sharding: Any = None
    # Found by the first trace: how to rebuild the decoder layer's call from the carry.
    _call_spec: Any = None
    _statics: list | None = None
    _hidden: int = 0
    _rest: tuple | None = None  # a layer returning a tuple: what follows the hidden states
    groups: tuple[LinearGroup, ...] | None = None  # found by the first trace of the layer

    @contextlib.contextmanager
    def _swapped(self, stand_in: Any):
        original = list(self.layers)
        try:
            for i in range(len(original)):
                self.layers[i] = stand_in
            yield
        finally:
            for i, layer in enumerate(original):
                self.layers[i] = layer

    @contextlib.contextmanager
    def _tracing(self):
        import torch

        with self.env, torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Explicitly requested dtype int64")
            yield

    def _model_inputs(self, outer: dict, batch: StepInput) -> tuple:
        return self.env.j2t_iso((
            {k: outer[k] for k in self.outer_params}, {k: outer[k] for k in self.outer_buffers},
            batch.input_ids.astype(jnp.int32)[None], batch.positions.astype(jnp.int32)[None],
            batch.logits_indices.astype(jnp.int32),
        ))

    def prologue(self, outer: dict, batch: StepInput) -> list[jax.Array]:
        """The first decoder layer's inputs, as the carry (its tensors, in a list)."""
        import torch

        class Capture(torch.nn.Module):
            def forward(self, *args: Any, **kwargs: Any) -> Any:
                raise _Captured(args, kwargs)

        params, buffers, ids, pos, idx = self._model_inputs(outer, batch)
        with self._tracing(), self._swapped(Capture()):
            try:
                self.module.functional_call(self.forward, params, buffers, ids, pos, idx)
            except _Captured as captured:
                args, kwargs = captured.call
            else:
                raise SplitError("the model's forward never called its first decoder layer")
        if not args or not isinstance(args[0], torch.Tensor):
            raise SplitError("the decoder layer's hidden states are not its first positional argument")
        leaves, spec = _flatten((args, kwargs))
        tensors = [isinstance(x, torch.Tensor) for x in leaves]
        bad = [type(x).__name__ for x, t in zip(leaves, tensors) if not t and not isinstance(x, _STATIC_TYPES)]
        if bad:
            raise SplitError(f"the decoder layers take non-tensor objects ({', '.join(sorted(set(bad)))})")
        statics = [_TENSOR if t else x for x, t in zip(leaves, tensors)]
        if self._call_spec is None:
            self._call_spec, self._statics = spec, statics
            self._hidden = 0  # args[0] is the first leaf
        elif spec != self._call_spec or statics != self._statics:
            raise SplitError("the decoder layers' call differs between traces")
        return [self.env.t2j_iso(x) for x, t in zip(leaves, tensors) if t]

    def _rebuild(self, carry: list) -> tuple[tuple, dict]:
        tensors = iter(self.env.j2t_iso(list(carry)))
        return _unflatten([next(tensors) if s is _TENSOR else s for s in self._statics], self._call_spec)

    def layer(self, layer_params: dict, carry: list, kv_cache: KVCache | None, index: jax.Array,
              batch: StepInput) -> tuple[list, KVCache | None]:
        """Decoder layer `index` (its weights in layer_params) on the carry; its KV written."""
        import torch
        from torch.nn.utils import stateless

        if self._call_spec is None:
            raise SplitError("layer traced before the prologue")
        args, kwargs = self._rebuild(carry)
        template = self.layers[0]
        ctx = StepContext(batch, kv_cache, kv_repeat=self.kv_repeat, qkv_sharding=self.qkv_sharding, layer=index)
        layer_params = dict(layer_params)
        joined = {g: (layer_params.pop(g.weight_key), layer_params.pop(g.bias_key, None))
                  for g in self.groups or () if g.weight_key in layer_params}
        # Packed weights (pack_layer) stay JAX arrays: their members multiply through the kernel.
        joined = {g: (w if isinstance(w, PackedWeight) else self.env.j2t_iso(w), None if b is None else self.env.j2t_iso(b))
                  for g, (w, b) in joined.items()}
        weights = self.env.j2t_iso(layer_params)
        with (self._tracing(), step_context(ctx), stateless._reparametrize_module(template, weights),
              self._recording_groups(template), self._joined_linears(template, joined, batch.num_tokens)):
            out = template(*args, **kwargs)
        hidden, rest = (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, None)
        if rest is not None and not all(isinstance(x, _STATIC_TYPES) for x in rest):
            raise SplitError("the decoder layer returns tensors besides its hidden states")
        if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape) != tuple(args[0].shape):
            raise SplitError("the decoder layer's output is not hidden states shaped like its input")
        self._rest = rest
        carry = list(carry)
        carry[self._hidden] = self.env.t2j_iso(hidden)
        return carry, ctx.kv_cache

    @contextlib.contextmanager
    def _recording_groups(self, template: Any):
        """On the first trace: which plain Linear submodules read the same input (self.groups)."""
        if self.groups is not None:
            yield
            return
        linears = _plain_linears(template)
        calls: list[tuple[str, Any]] = []  # (module name, its input), in call order
        hooks = [m.register_forward_pre_hook(lambda m, args, name=name: calls.append((name, args[0])))
                 for name, m in linears.items()]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
        names = [name for name, _ in calls]
        by_input: dict[int, list[str]] = {}
        for name, x in calls:
            if names.count(name) == 1:  # a module called twice is left alone
                by_input.setdefault(id(x), []).append(name)
        groups = []
        for members in by_input.values():
            mods = [linears[n] for n in members]
            if len({(m.in_features, m.bias is None, m.weight.dtype) for m in mods}) == 1:
                groups.append(LinearGroup(tuple(members), tuple(m.out_features for m in mods), mods[0].bias is not None))
        self.groups = tuple(groups)

    @contextlib.contextmanager
    def _joined_linears(self, template: Any, joined: dict, num_tokens: jax.Array):
        """The members of each joined group answer from one matmul with its [in, out] weight
        (a PackedWeight: by the CPU kernel, on the step's real tokens only)."""
        import torch

        modules = dict(template.named_modules())
        results: dict[LinearGroup, tuple[Any, tuple]] = {}

        def matmul(x: Any, weight: Any) -> Any:
            if not isinstance(weight, PackedWeight):
                return torch.matmul(x, weight)
            xj = self.env.t2j_iso(x)  # [..., T, in]: the step's tokens, real ones first
            rows = num_tokens if xj.ndim == 2 or xj.shape[0] == 1 else None
            y = weight.matmul(xj.reshape(-1, xj.shape[-1]), rows)
            return self.env.j2t_iso(y.reshape(*xj.shape[:-1], y.shape[-1]))

        def answer(group: LinearGroup, k: int, weight: Any, bias: Any) -> Callable:
            def forward(x: Any) -> Any:
                if group not in results or results[group][0] is not x:
                    y = matmul(x, weight) if bias is None else matmul(x, weight) + bias
                    results[group] = (x, torch.split(y, list(group.out_features), dim=-1))
                return results[group][1][k]
            return forward

        patched = []
        try:
            for group, (weight, bias) in joined.items():
                for k, name in enumerate(group.members):
                    modules[name].forward = answer(group, k, weight, bias)
                    patched.append(modules[name])
            yield
        finally:
            for m in patched:
                del m.forward  # back to the class's forward

    def fuse(self, layer_params: dict) -> dict:
        """One layer's weights with each group's weights joined and stored [in, out] (biases
        joined) under LinearGroup.weight_key / bias_key; a group that cannot be joined stays as
        it was, and weights joined already pass through."""
        out = dict(layer_params)
        for group in self.groups or ():
            names = [f"{m}.weight" for m in group.members]
            if not all(n in out for n in names):
                continue
            weight = _join_transposed([out[n] for n in names])
            if weight is None:
                continue
            for n in names:
                del out[n]
            out[group.weight_key] = weight
            if group.bias:
                out[group.bias_key] = jnp.concatenate([out.pop(f"{m}.bias") for m in group.members])
        return out

    def pack_layer(self, layer_params: dict) -> dict:
        """One (fused) layer's weights with each group's joined float32 weight as a
        runtime.ops.matmul.PackedWeight; packed weights pass through."""
        out = dict(layer_params)
        for group in self.groups or ():
            if group.weight_key in out:
                out[group.weight_key] = pack_matrix(out[group.weight_key])
        return out

    def epilogue(self, outer: dict, carry: list, batch: StepInput) -> jax.Array:
        """The final norm and LM head on the last layer's hidden states: logits [S, vocab]."""
        import torch

        hidden = self.env.j2t_iso(carry[self._hidden])
        returned = hidden if self._rest is None else (hidden, *self._rest)

        class Replay(torch.nn.Module):
            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return returned

        params, buffers, ids, pos, idx = self._model_inputs(outer, batch)
        with self._tracing(), self._swapped(Replay()):
            logits = self.module.functional_call(self.forward, params, buffers, ids, pos, idx)
        return self.env.t2j_iso(logits).astype(jnp.float32)


def split_layers(
    model: Any, module: Any, env: Any, forward: Callable, param_names: list[str], buffer_names: list[str],
    num_layers: int, abstract: dict[str, jax.ShapeDtypeStruct], kv_repeat: int, qkv_sharding: Any,
) -> tuple[LayerStages, str] | str:
    """The model's LayerStages and the dotted name of its decoder layers, or why not (a str).

    `abstract` maps every param and buffer name to its shape; the split is traced on it once
    (no compute) to prove the three stages compose to the model's forward.
    """
    found = find_decoder_layers(model, num_layers)
    if found is None:
        return f"no ModuleList of {num_layers} decoder layers with their attention's layer_idx in order"
    name, layers = found
    settings = _settings(layers[0])
    if any(type(layer) is not type(layers[0]) or _settings(layer) != settings for layer in layers):
        return "its decoder layers differ in class or settings (e.g. sliding and full attention)"
    per_layer = [{n[len(f"{name}.{i}."):] for n in abstract if n.startswith(f"{name}.{i}.")} for i in range(num_layers)]
    shapes = [{r: abstract[f"{name}.{i}.{r}"] for r in rel} for i, rel in enumerate(per_layer)]
    if not shapes[0] or any(s != shapes[0] for s in shapes):
        return "its decoder layers' weights differ in names, shapes or dtypes"
    inner = {f"{name}.{i}.{r}" for i, rel in enumerate(per_layer) for r in rel}
    stages_impl = TorchaxLayers(
        module=module, layers=layers, forward=forward, env=env, kv_repeat=kv_repeat, qkv_sharding=qkv_sharding,
        outer_params=[n for n in param_names if n not in inner], outer_buffers=[n for n in buffer_names if n not in inner],
    )
    stages = LayerStages(stages_impl.prologue, stages_impl.layer, stages_impl.epilogue, num_layers=num_layers,
                         layers_key=LAYERS_KEY)
    outer = {n: s for n, s in abstract.items() if n not in inner}
    batch = _probe_batch()
    try:
        carry = jax.eval_shape(stages.prologue, outer, batch)
        carry, _ = jax.eval_shape(lambda lp, c, b: stages.layer(lp, c, None, jnp.int32(0), b), shapes[0], carry, batch)
        logits = jax.eval_shape(stages.epilogue, outer, carry, batch)
    except SplitError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - any failure keeps the whole-model step, with the reason
        return f"{type(e).__name__}: {e}"
    if logits.ndim != 2 or logits.shape[0] != 1:
        return f"the split forward gives logits of shape {logits.shape}"
    if stages_impl.groups:
        stages = dataclasses.replace(stages, fuse=stages_impl.fuse, pack_layer=stages_impl.pack_layer)
        logger.info("decoder layer matmuls, by input: %s", ", ".join(
            "/".join(g.members) for g in stages_impl.groups))
    return stages, name


def _probe_batch() -> StepInput:
    import numpy as np

    from runtime.ops.step import make_step_input

    return make_step_input(
        input_ids=np.zeros(2), positions=np.arange(2), slot_mapping=np.arange(2),
        block_tables=np.zeros((1, 1)), seq_lens=np.array([2]), query_start_loc=np.array([0, 2]),
        logits_indices=np.array([1]), num_seqs=1, num_tokens=2,
    )


def nest_layer_params(tree: dict, layers_name: str, num_layers: int) -> dict:
    """{name: x} with the decoder layers' entries moved to tree[LAYERS_KEY][i][relative name]."""
    per_layer: list[dict] = [{} for _ in range(num_layers)]
    outer = {}
    for n, x in tree.items():
        head, _, rest = n[len(layers_name) + 1:].partition(".")
        if n.startswith(layers_name + ".") and head.isdigit() and int(head) < num_layers:
            per_layer[int(head)][rest] = x
        else:
            outer[n] = x
    return {**outer, LAYERS_KEY: per_layer}
