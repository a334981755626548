"""Gemma 4 (text: transformers' `Gemma4ForCausalLM`, model type gemma4_text) in plain JAX.

A Gemma decoder (models_jax/gemma.py: four norms per layer, GeGLU, the scaled embedding, a tied
head, final logit soft-capping) with what Gemma 4 adds, every part read from the Hugging Face
config (its per-layer attributes from `per_layer_config`):
- sliding-window and global layers by `layer_types`; the global layers have their own head size
  (`global_head_dim`) and, with `attention_k_eq_v`, their own KV head count
  (`num_global_key_value_heads`) and no value projection: values are the key projection's output;
- per-head RMSNorm of q and k with a plain weight (weight, not Gemma 2/3's 1 + weight) and of v
  without one; attention scale 1.0 (the norms set the logits' size);
- rotary embeddings per layer type: the sliding layers' default rope, the global layers'
  "proportional" rope (frequencies for a `partial_rotary_factor` share of the head, zero for the
  rest, which then pass unrotated), each over its own head size;
- per-layer input embeddings (`hidden_size_per_layer_input` P): a second embedding
  [vocab, layers * P] plus a projection of the main embedding, normed, averaged; layer i takes
  its slice [T, P], gates it by gelu(x @ gate) and adds its projection back to D, normed, into
  the residual after the MLP;
- KV sharing: the last `num_kv_shared_layers` layers own no K/V projection and no cache; each
  attends over the K/V of the last earlier layer of its type (transformers' "store" layer);
  with `use_double_wide_mlp` their MLP is twice as wide;
- with `enable_moe_block` a mixture of experts beside every layer's dense MLP: a router on the
  unnormed residual (RMSNorm without weight, times a learned scale and D^-1/2; softmax, top-k,
  renormalised, times a per-expert scale), experts of GeGLU on their own pre-norm, each branch
  normed before the two are added (models_jax/moe.py's grouped experts);
- a learned `layer_scalar` multiplying each layer's output; plain-weight RMSNorm everywhere.

The KV cache. The paged cache has one block shape for every layer ([kv_heads, block_size,
head_dim], runtime.ops.step.KVCacheSpec), but Gemma 4's sliding layers have more, smaller KV
heads than its global ones (31B: 16 of 256 against 4 of 512). Every layer's K/V is stored in one
shape: the larger head size, the smaller heads zero-padded (a zero-padded query against a
zero-padded key gives the same logit; the padded output columns are dropped), and
lcm(sliding KV heads, global KV heads) heads, each layer's heads repeated in place to fill them
(query head h still reads a copy of its own KV head h // (H / KV), as with models_jax's
kv_repeat; the registry multiplies them once more to split over the mesh). Why this and not a
cache array per layer type: the sliding layers keep only their window's blocks (KV cache groups,
`window_blocks`), so on a long context almost every block is a global layer's and padding the
sliding ones costs little; the repeated global heads do cost (a global layer's bytes times
sliding KV heads / global KV heads, 4x on the 31B), which a cache with a block shape per group
(vLLM's hybrid allocator: equal page bytes, different shapes) would save, at the price of a
second cache array through the allocator, both attention kernels and sharding: the next step
if Gemma 4's long contexts matter. Every attention backend reads this cache as it reads any.

KV-shared layers read their source layer's cache rows, which already hold this step's tokens,
and own none (KVCacheSpec.num_layers is the layers before the shared tail). The step carries
the source layers' K/V of this step's tokens (transformers' shared_kv_states) so that a shared
layer hands paged_attention the same new K/V the source wrote (rewritten in place, unchanged).

The layers lie in up to four weight stacks by kind, "sliding", "global", "shared_sliding" and
"shared_global" (their weights differ in shape), as runs of consecutive layers that interleave
(runtime.ops.step.LayerStages.stacks); the layer stage reads its kind from its weights' shapes
and everything else (window, rope, source layer) from per-layer tables indexed by the layer.
`forward` scans each run in one program; runtime/ops/layered.py steps them a few per call, on
CPU with the MLP's gate and up joined and the matrices packed for the C++ kernels (fuse_layer,
pack_layer; q, k and v stay apart, their shapes telling the layer's kind).

Refused with ModelLoadError (results equal to transformers' could not be promised):
`use_bidirectional_attention` (servax attends causally), activations other than
gelu_pytorch_tanh, `attention_bias` (no released checkpoint has biases), rope types other than
default and proportional. Gemma4ForConditionalGeneration (the multimodal checkpoints) is not
declared: torchax refuses it (its layers' KV shapes differ). LoRA adapters and pooling are not
served on Gemma 4.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models_jax import ModelEntry, layers, llama, llama_moe, moe
from models_jax.weights import WeightSpec, embedding, linear, linear_from_heads, linear_to_heads, ones, vector
from runtime.ops.attention import NO_SLIDING_WINDOW, paged_attention
from runtime.ops.attention_common import soft_cap
from runtime.ops.matmul import PackedWeight, pack_matrix
from runtime.ops.step import KVCache, KVCacheSpec, StepInput

ACTIVATION = "gelu_pytorch_tanh"
ROPE_TYPES = ("default", "proportional")
SLIDING, GLOBAL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Gemma4Args:
    """Gemma 4's hyperparameters (hashable: closed over by the jitted step).

    num_kv_heads / head_dim are the sliding layers', global_kv_heads / global_head_dim the
    global layers'; kv_repeat multiplies the cache's heads to split over the mesh (set by
    registry.native)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    global_kv_heads: int
    global_head_dim: int
    rms_norm_eps: float
    rope: layers.RopeConfig  # global layers
    local_rope: layers.RopeConfig  # sliding layers
    sliding: tuple[bool, ...]  # per layer: a sliding-window layer
    sliding_window: int
    values_from_keys: bool = False  # attention_k_eq_v: the global layers have no v projection
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    per_layer_dim: int = 0  # hidden_size_per_layer_input; 0: no per-layer inputs
    per_layer_vocab: int = 0
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    moe: moe.MoeConfig | None = None
    kv_repeat: int = 1

    @classmethod
    def from_hf(cls, cfg: Any) -> "Gemma4Args":
        """Raises ValueError on config features this module does not implement."""
        act = getattr(cfg, "hidden_activation", None) or ACTIVATION
        if act != ACTIVATION:
            raise ValueError(f"hidden_activation {act!r} is not supported (only {ACTIVATION})")
        if getattr(cfg, "use_bidirectional_attention", None):
            raise ValueError("use_bidirectional_attention is not supported (servax attends causally); "
                             "use model_impl='torchax'")
        if getattr(cfg, "attention_bias", False):
            raise ValueError("attention_bias is not supported on Gemma 4 (no released checkpoint has biases)")
        n = cfg.num_hidden_layers
        types_ = list(cfg.layer_types)
        if len(types_) != n or not set(types_) <= {SLIDING, GLOBAL}:
            raise ValueError(f"layer_types {types_} must name {n} layers, each one of {SLIDING}, {GLOBAL}")
        shapes = {t: _per_layer(cfg, types_.index(t)) if t in types_ else None for t in (SLIDING, GLOBAL)}
        heads = cfg.num_attention_heads
        (kv, hd), (gkv, ghd) = (shapes[t] or shapes[SLIDING] or shapes[GLOBAL] for t in (SLIDING, GLOBAL))
        if any(_per_layer(cfg, i) != shapes[t] for i, t in enumerate(types_)):
            raise ValueError("per_layer_config gives layers of one type different head shapes")
        moe_config = None
        if getattr(cfg, "enable_moe_block", False):
            moe_config = moe.MoeConfig(num_experts=cfg.num_experts, top_k=cfg.top_k_experts,
                                       intermediate_size=cfg.moe_intermediate_size, activation="gelu_tanh")
        per_layer_dim = int(getattr(cfg, "hidden_size_per_layer_input", 0) or 0)
        shared = int(getattr(cfg, "num_kv_shared_layers", 0) or 0)
        if set(types_[n - shared:]) - set(types_[:n - shared]):
            raise ValueError(f"the last {shared} layers share K/V, but not every type of them has an earlier layer "
                             "of its type to read from")
        cap = getattr(cfg, "final_logit_softcapping", None)
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_layers=n, num_heads=heads, num_kv_heads=kv, head_dim=hd, global_kv_heads=gkv, global_head_dim=ghd,
            rms_norm_eps=cfg.rms_norm_eps, rope=_rope(cfg, GLOBAL, ghd), local_rope=_rope(cfg, SLIDING, hd),
            sliding=tuple(t == SLIDING for t in types_), sliding_window=int(cfg.sliding_window),
            values_from_keys=bool(getattr(cfg, "attention_k_eq_v", False)), num_kv_shared_layers=shared,
            double_wide_mlp=bool(getattr(cfg, "use_double_wide_mlp", False)), per_layer_dim=per_layer_dim,
            per_layer_vocab=int(getattr(cfg, "vocab_size_per_layer_input", 0) or cfg.vocab_size),
            final_logit_softcap=float(cap) if cap else None,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
            initializer_range=float(getattr(cfg, "initializer_range", 0.02)), moe=moe_config,
        )

    # ---- derived per-layer facts ------------------------------------------------------------

    @property
    def num_cache_layers(self) -> int:
        """The layers that own K/V in the cache: all but the KV-shared tail."""
        return self.num_layers - self.num_kv_shared_layers

    def shared(self, i: int) -> bool:
        return i >= self.num_cache_layers

    def kv_source(self, i: int) -> int:
        """The layer whose K/V layer i attends over: itself, or for a KV-shared layer the last
        earlier layer of its type that owns a cache (transformers' "store" layer)."""
        if not self.shared(i):
            return i
        return max(j for j in range(self.num_cache_layers) if self.sliding[j] == self.sliding[i])

    def stack_key(self, i: int) -> str:
        return ("shared_" if self.shared(i) else "") + ("sliding" if self.sliding[i] else "global")

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        return tuple(self.sliding_window if s else None for s in self.sliding)

    @property
    def cache_head_dim(self) -> int:
        return max(self.head_dim, self.global_head_dim)

    @property
    def cache_kv_heads(self) -> int:
        """KV heads each cache row stores: both layer types' counts repeated to their lcm, times kv_repeat."""
        return math.lcm(self.num_kv_heads, self.global_kv_heads) * self.kv_repeat


def _per_layer(cfg: Any, i: int) -> tuple[int, int]:
    """(KV heads, head size) of layer i, with its per_layer_config overrides (global layers)."""
    overrides = getattr(cfg, "per_layer_config", None)
    if overrides is not None and not isinstance(overrides, dict):  # transformers' per-layer view of a config
        return int(overrides[i].num_key_value_heads), int(overrides[i].head_dim)
    layer = (overrides or {}).get(str(i)) or (overrides or {}).get(i) or {}  # as to_dict() writes it
    return int(layer.get("num_key_value_heads", cfg.num_key_value_heads)), int(layer.get("head_dim", cfg.head_dim))


def _rope(cfg: Any, layer_type: str, head_dim: int) -> layers.RopeConfig:
    """One layer type's rotary table: default (or another type models_jax.layers reads), or
    proportional (transformers' `_compute_proportional_rope_parameters`: the first
    partial_rotary_factor * head_dim / 2 frequencies of a head_dim-sized rope, zeros after)."""
    params = dict((getattr(cfg, "rope_parameters", None) or {}).get(layer_type) or {"rope_type": "default"})
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} ({layer_type}) is not supported on Gemma 4 (only {ROPE_TYPES})")
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type == "default":
        one = types.SimpleNamespace(rope_parameters=params, max_position_embeddings=cfg.max_position_embeddings)
        return layers.RopeConfig.from_hf(one, head_dim)
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    inv_freq = np.zeros(head_dim // 2, np.float32)
    inv_freq[:angles] = layers.default_inv_freq(theta, head_dim)[:angles]
    inv_freq /= np.float32(params.get("factor", 1.0))
    return layers.RopeConfig("proportional", head_dim, theta, tuple(inv_freq.tolist()))


# ---- weights ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Gemma4Weight(WeightSpec):
    """A WeightSpec stacked over the checkpoint layers `layer_ids` (a stack of one kind of the
    interleaved layers), or one of `parts` equal slices of its checkpoint tensor along
    `part_axis` (the experts keep gate and up in one [E, 2F, D] tensor; apart, each splits over
    the mesh by its own features)."""

    layer_ids: tuple[int, ...] = ()
    part: int = 0
    parts: int = 1
    part_axis: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        if self.parts == 1:
            return super().shape
        hf = list(self.hf_shape)
        hf[self.part_axis] //= self.parts
        return dataclasses.replace(self, hf_shape=tuple(hf), parts=1).shape

    @property
    def hf_names(self) -> list[str]:
        if not self.layer_ids or self.num_layers is None:
            return super().hf_names
        return [self.hf_name.replace("{layer}", str(i)) for i in self.layer_ids]

    def to_native(self, tensor: Any) -> Any:
        if self.parts > 1:
            size = tensor.shape[self.part_axis] // self.parts
            index = [slice(None)] * tensor.ndim
            index[self.part_axis] = slice(self.part * size, (self.part + 1) * size)
            tensor = tensor[tuple(index)]
        return super().to_native(tensor)


def _stacked_at(table: dict, layer_ids: tuple[int, ...]) -> dict:
    """One layer's table stacked over the checkpoint's layers `layer_ids` (a leading "layers" axis)."""
    def stack(w: WeightSpec) -> WeightSpec:
        fields = {**vars(w), "num_layers": len(layer_ids), "logical_axes": ("layers", *w.logical_axes)}
        return _Gemma4Weight(**{**fields, "layer_ids": layer_ids})

    return jax.tree.map(stack, table, is_leaf=lambda x: isinstance(x, WeightSpec))


def layer_table(a: Gemma4Args, sliding: bool, shared: bool) -> dict:
    """One decoder layer's WeightSpecs of a kind (hf names with `{layer}`); norms plain weights."""
    d, hd = a.hidden_size, a.head_dim if sliding else a.global_head_dim
    kv = a.num_kv_heads if sliding else a.global_kv_heads
    f = a.intermediate_size * (2 if shared and a.double_wide_mlp else 1)
    normal = jax.nn.initializers.normal(a.initializer_range)
    pre = "model.layers.{layer}."
    attn, mlp = pre + "self_attn.", pre + "mlp."
    norm = lambda name, size=d, axes=("embed",): vector(pre + name + ".weight", size, axes)  # noqa: E731
    w = {
        "input_norm": norm("input_layernorm"),
        "q": linear_to_heads(attn + "q_proj.weight", d, a.num_heads, hd, "q_heads", normal),
        "q_norm": vector(attn + "q_norm.weight", hd, ("head_dim",)),
        "o": linear_from_heads(attn + "o_proj.weight", a.num_heads, hd, d, normal),
        "post_attn_norm": norm("post_attention_layernorm"),
        "pre_ffw_norm": norm("pre_feedforward_layernorm"),
        "post_ffw_norm": norm("post_feedforward_layernorm"),
        "mlp": {
            "gate": linear(mlp + "gate_proj.weight", d, f, ("embed", "mlp"), normal),
            "up": linear(mlp + "up_proj.weight", d, f, ("embed", "mlp"), normal),
            "down": linear(mlp + "down_proj.weight", f, d, ("mlp", "embed"), normal),
        },
        "layer_scalar": WeightSpec(pre + "layer_scalar", (1,), (None,), ones),
    }
    if not shared:  # KV-shared layers read an earlier layer's K/V
        w["k"] = linear_to_heads(attn + "k_proj.weight", d, kv, hd, "kv_heads", normal)
        w["k_norm"] = vector(attn + "k_norm.weight", hd, ("head_dim",))
        if sliding or not a.values_from_keys:
            w["v"] = linear_to_heads(attn + "v_proj.weight", d, kv, hd, "kv_heads", normal)
    if a.per_layer_dim:
        w["per_layer_gate"] = linear(pre + "per_layer_input_gate.weight", d, a.per_layer_dim, ("embed", None), normal)
        w["per_layer_proj"] = linear(pre + "per_layer_projection.weight", a.per_layer_dim, d, (None, "embed"), normal)
        w["post_per_layer_norm"] = norm("post_per_layer_input_norm")
    if a.moe is not None:
        m = a.moe
        expert_axis, feature_axis = m.axes
        e, fm = m.num_experts, m.intermediate_size
        gate_up = dict(hf_name=pre + "experts.gate_up_proj", hf_shape=(e, 2 * fm, d),
                       logical_axes=(expert_axis, "embed", feature_axis), init=normal, perm=(0, 2, 1), parts=2,
                       part_axis=1)
        w["router"] = {"proj": moe.router_weight(pre + "router.proj.weight", d, e, normal),
                       "scale": vector(pre + "router.scale", d, ("embed",)),
                       "per_expert_scale": vector(pre + "router.per_expert_scale", e)}
        w["experts"] = {  # [E, D, F] each, down [E, F, D]
            "gate": _Gemma4Weight(**gate_up, part=0), "up": _Gemma4Weight(**gate_up, part=1),
            "down": WeightSpec(pre + "experts.down_proj", (e, d, fm), (expert_axis, feature_axis, "embed"), normal,
                               perm=(0, 2, 1)),
        }
        w["post_ffw_norm_1"] = norm("post_feedforward_layernorm_1")  # the dense MLP's output
        w["pre_ffw_norm_2"] = norm("pre_feedforward_layernorm_2")  # the experts' input
        w["post_ffw_norm_2"] = norm("post_feedforward_layernorm_2")  # the experts' output
    return w


def layer_stacks(a: Gemma4Args) -> tuple[tuple[str, int], ...]:
    """Runs of consecutive layers of one kind, in layer order (LayerStages.stacks)."""
    runs: list[tuple[str, int]] = []
    for i in range(a.num_layers):
        key = a.stack_key(i)
        if runs and runs[-1][0] == key:
            runs[-1] = (key, runs[-1][1] + 1)
        else:
            runs.append((key, 1))
    return tuple(runs)


def weight_table(a: Gemma4Args) -> dict:
    """The params tree as WeightSpecs: embeddings, per-layer input tables, one stack per kind of
    layer. Sharded as the Llama family's (models_jax/llama.py: heads, MLP features, vocabulary);
    the per-layer input tables and projections whole on every device."""
    d = a.hidden_size
    normal = jax.nn.initializers.normal(a.initializer_range)
    table = {
        "embed": embedding("model.embed_tokens.weight", a.vocab_size, d, normal),
        "final_norm": vector("model.norm.weight", d, ("embed",)),
    }
    for key in dict(layer_stacks(a)):
        ids = tuple(i for i in range(a.num_layers) if a.stack_key(i) == key)
        table[key] = _stacked_at(layer_table(a, a.sliding[ids[0]], a.shared(ids[0])), ids)
    if a.per_layer_dim:
        width = a.num_layers * a.per_layer_dim
        table["per_layer_embed"] = WeightSpec("model.embed_tokens_per_layer.weight", (a.per_layer_vocab, width),
                                              (None, None), normal)
        table["per_layer_model_proj"] = linear("model.per_layer_model_projection.weight", d, width, ("embed", None),
                                               normal)
        table["per_layer_proj_norm"] = vector("model.per_layer_projection_norm.weight", a.per_layer_dim)
    if not a.tie_word_embeddings:
        table["lm_head"] = linear("lm_head.weight", d, a.vocab_size, ("embed", "vocab"), normal)
    return table


def kv_spec(a: Gemma4Args, dtype: Any) -> KVCacheSpec:
    """One block shape for every layer (see the module docstring): the larger head size, the
    KV head counts repeated to their lcm (times kv_repeat); the KV-shared layers own no rows;
    the sliding layers keep only their window (KV cache groups)."""
    windows = a.sliding_windows[:a.num_cache_layers]
    return KVCacheSpec(a.num_cache_layers, a.cache_kv_heads, a.cache_head_dim, dtype,
                       sliding_windows=windows if any(windows) else None)


# ---- the step in three stages -------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """Gemma 4's RMSNorm over the last axis, in float32: x / rms(x) * weight (no weight: the
    v-norm and the router's), cast back to x's dtype. x: [..., D]."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf if weight is None else xf * weight.astype(jnp.float32)).astype(x.dtype)


def _scaled(x: jax.Array, scale: float) -> jax.Array:
    """x times a constant rounded to x's dtype first (transformers' embed_scale buffers)."""
    return x * jnp.asarray(np.float32(scale)).astype(x.dtype)


def _times(x: jax.Array, c: float) -> jax.Array:
    """x times a Python constant as torch multiplies a half-precision tensor by one: in float32,
    rounded once."""
    return (x.astype(jnp.float32) * c).astype(x.dtype)


def prologue(params: dict, batch: StepInput, *, args: Gemma4Args) -> dict:
    """The carry: x [T, D] (scaled embeddings), each layer type's rope tables, the per-layer
    inputs [T, layers, P] and, with KV sharing, the source layers' K/V of this step's tokens
    (filled by those layers) in the cache's shape [T, KV, hd]."""
    a = args
    with jax.named_scope("embed"):
        embed = params["embed"]  # a tied table may be packed as the LM head (pack_head)
        x = embed.columns(batch.input_ids) if isinstance(embed, PackedWeight) else embed[batch.input_ids]
        x = _scaled(x, a.hidden_size**0.5)  # [T, D]
    seq_lens = llama.token_seq_lens(batch)
    carry = {"x": x, "rope": {"global": layers.rope_cos_sin(a.rope, batch.positions, seq_lens),
                              "sliding": layers.rope_cos_sin(a.local_rope, batch.positions, seq_lens)}}
    if a.per_layer_dim:
        with jax.named_scope("per_layer_inputs"):
            shape = (x.shape[0], a.num_layers, a.per_layer_dim)
            token = _scaled(params["per_layer_embed"][batch.input_ids], a.per_layer_dim**0.5).reshape(shape)
            context = _times(x @ params["per_layer_model_proj"], a.hidden_size**-0.5).reshape(shape)
            context = rms_norm(context, params["per_layer_proj_norm"], a.rms_norm_eps)
            carry["per_layer"] = _times(context + token, 2.0**-0.5)  # [T, layers, P]
    if a.num_kv_shared_layers:
        empty = jnp.zeros((x.shape[0], a.cache_kv_heads, a.cache_head_dim), x.dtype)
        carry["shared_kv"] = {kind: (empty, empty) for kind in ("sliding", "global")}
    return carry


def _to_cache_shape(y: jax.Array, a: Gemma4Args) -> jax.Array:
    """A layer's K or V [T, kv, hd] as the cache stores it: each head repeated in place to
    cache_kv_heads heads, zero-padded to cache_head_dim."""
    y = jnp.repeat(y, a.cache_kv_heads // y.shape[1], axis=1)
    return jnp.pad(y, ((0, 0), (0, 0), (0, a.cache_head_dim - y.shape[2])))


def _layer_table(values: list, dtype: Any = jnp.int32) -> jax.Array:
    return jnp.asarray(np.asarray(values), dtype)


def _head_dim(q: Any, num_heads: int) -> int:
    """A layer's head size from its q projection ([D, H, hd], or packed [D, H * hd])."""
    return (q.out_features if isinstance(q, PackedWeight) else q.shape[1] * q.shape[2]) // num_heads


def _project(x: jax.Array, w: Any, head_dim: int, rows: jax.Array) -> jax.Array:
    """x [T, D] into heads [T, h, head_dim] by w [D, h, head_dim] (or packed [D, h * head_dim])."""
    if isinstance(w, PackedWeight):
        return w.matmul(x, rows).reshape(x.shape[0], -1, head_dim)
    return layers.project_to_heads(x, w)


def _source_layers(a: Gemma4Args) -> dict[str, int]:
    """{"sliding" / "global": the layer whose K/V the shared layers of that type read (-1: none)}."""
    sources = {"sliding": -1, "global": -1}
    for j in range(a.num_cache_layers, a.num_layers):
        sources["sliding" if a.sliding[j] else "global"] = a.kv_source(j)
    return sources


def attention_block(x: jax.Array, p: dict, carry: dict, kv_cache: KVCache, i: jax.Array, batch: StepInput,
                    a: Gemma4Args) -> tuple[jax.Array, dict, KVCache]:
    """q (and, owning K/V, k and v) normed and rotated, paged attention at scale 1.0 over this
    layer's cache rows (a KV-shared layer: its source layer's), then o. Returns (out [T, D], the
    carry with a source layer's K/V kept for the shared layers, the cache)."""
    hd = _head_dim(p["q"], a.num_heads)
    sliding_of = _layer_table(a.sliding, jnp.bool_)
    if a.head_dim != a.global_head_dim:  # the head size tells the layer's type
        kind = "sliding" if hd == a.head_dim else "global"
        cos, sin = carry["rope"][kind]
    else:
        local = sliding_of[i]
        (gc, gs), (lc, ls) = carry["rope"]["global"], carry["rope"]["sliding"]
        cos, sin = jnp.where(local, lc, gc), jnp.where(local, ls, gs)
    eps = a.rms_norm_eps
    with jax.named_scope("qkv"):
        rows = batch.num_tokens
        q = layers.apply_rope(rms_norm(_project(x, p["q"], hd, rows), p["q_norm"], eps), cos, sin)  # [T, H, hd]
        if "k" in p:  # owns its K/V
            raw_k = _project(x, p["k"], hd, rows)  # [T, kv, hd]
            raw_v = _project(x, p["v"], hd, rows) if "v" in p else raw_k  # attention_k_eq_v
            k = _to_cache_shape(layers.apply_rope(rms_norm(raw_k, p["k_norm"], eps), cos, sin), a)
            v = _to_cache_shape(rms_norm(raw_v, None, eps), a)
            layer = i
            if "shared_kv" in carry:  # the source layers of the shared tail keep theirs
                shared_kv = dict(carry["shared_kv"])
                for kind, source in _source_layers(a).items():
                    old_k, old_v = shared_kv[kind]
                    shared_kv[kind] = (jnp.where(i == source, k, old_k), jnp.where(i == source, v, old_v))
                carry = {**carry, "shared_kv": shared_kv}
        else:  # KV-shared: the source layer's K/V, already in its cache rows
            (sk, sv), (gk, gv) = carry["shared_kv"]["sliding"], carry["shared_kv"]["global"]
            local = sliding_of[i]
            k, v = jnp.where(local, sk, gk), jnp.where(local, sv, gv)
            layer = _layer_table([a.kv_source(j) for j in range(a.num_layers)])[i]
        q = jnp.pad(q, ((0, 0), (0, 0), (0, a.cache_head_dim - hd)))
    windows = _layer_table([w or NO_SLIDING_WINDOW for w in a.sliding_windows])
    window = a.sliding_window if all(a.sliding) else (None if not any(a.sliding) else windows[i])
    with jax.named_scope("paged_attention"):
        out, kv_cache = paged_attention(q, k, v, kv_cache, batch, layer=layer, scale=1.0, sliding_window=window)
    with jax.named_scope("o"):
        return layers.project_from_heads(out[..., :hd], p["o"], None, batch.num_tokens), carry, kv_cache


def route(x: jax.Array, p: dict, cfg: moe.MoeConfig, eps: float) -> tuple[jax.Array, jax.Array]:
    """Gemma 4's router on the residual x [T, D]: (weights [T, k] float32, expert ids [T, k] int32).
    RMSNorm without weight, times the learned scale and D^-1/2, softmax over the experts, the top
    k renormalised to sum to 1, each times its expert's scale."""
    h = _times(rms_norm(x, None, eps) * p["scale"], x.shape[-1] ** -0.5)
    logits = jnp.einsum("td,de->te", h, p["proj"]).astype(jnp.float32)
    top, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.top_k)
    top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top * p["per_expert_scale"][ids].astype(jnp.float32), ids.astype(jnp.int32)


def decoder_layer(p: dict, carry: dict, kv_cache: KVCache, i: jax.Array, batch: StepInput, *,
                  args: Gemma4Args) -> tuple[dict, KVCache]:
    """Decoder layer `i` (a traced int32) of any kind: attention, the MLP (and the experts beside
    it), the per-layer input, the layer scalar."""
    a, eps, x = args, args.rms_norm_eps, carry["x"]
    h, carry, kv_cache = attention_block(rms_norm(x, p["input_norm"], eps), p, carry, kv_cache, i, batch, a)
    x = x + rms_norm(h, p["post_attn_norm"], eps)
    with jax.named_scope("mlp"):
        h = layers.gated_mlp(rms_norm(x, p["pre_ffw_norm"], eps), p["mlp"], rows=batch.num_tokens,
                             activation=layers.gelu_tanh)
    if a.moe is not None:
        with jax.named_scope("moe"):
            weights, ids = route(x, p["router"], a.moe, eps)
            experts = moe.routed_experts(rms_norm(x, p["pre_ffw_norm_2"], eps), weights, ids, p["experts"], a.moe,
                                         batch.num_tokens).astype(x.dtype)
            h = rms_norm(h, p["post_ffw_norm_1"], eps) + rms_norm(experts, p["post_ffw_norm_2"], eps)
    x = x + rms_norm(h, p["post_ffw_norm"], eps)
    if a.per_layer_dim:
        with jax.named_scope("per_layer_input"):
            per_layer = jax.lax.dynamic_index_in_dim(carry["per_layer"], i, axis=1, keepdims=False)  # [T, P]
            g = layers.gelu_tanh(layers.matmul(x, p["per_layer_gate"], batch.num_tokens)) * per_layer
            x = x + rms_norm(layers.matmul(g, p["per_layer_proj"], batch.num_tokens), p["post_per_layer_norm"], eps)
    return {**carry, "x": x * p["layer_scalar"].astype(x.dtype)}, kv_cache


def epilogue(params: dict, carry: dict, batch: StepInput, *, args: Gemma4Args) -> jax.Array:
    """Final norm, the (tied) LM head and the final soft cap on the rows at
    `batch.logits_indices`: logits [S, vocab] float32."""
    with jax.named_scope("lm_head"):
        x = rms_norm(carry["x"][batch.logits_indices], params["final_norm"], args.rms_norm_eps)  # [S, D]
        logits = llama.lm_head(params, x, batch, tied=args.tie_word_embeddings)
        return soft_cap(logits, args.final_logit_softcap)


def forward(params: dict, kv_cache: KVCache, batch: StepInput, *, args: Gemma4Args) -> tuple[jax.Array, KVCache]:
    """One serving step in one program: the prologue, each run of layers under a scan over its
    slice of its stack, the epilogue. Returns (logits [S, vocab] float32, kv_cache)."""
    carry = prologue(params, batch, args=args)

    def one_layer(state, per_layer):
        carry, kv_cache = state
        p, i = per_layer
        return decoder_layer(p, carry, kv_cache, i, batch, args=args), None

    taken, first = {}, 0
    for key, n in layer_stacks(args):
        start = taken.get(key, 0)
        with jax.named_scope(key):
            run = jax.tree.map(lambda w, start=start, n=n: w[start:start + n], params[key])
            per_layer = (run, jnp.arange(first, first + n, dtype=jnp.int32))
            (carry, kv_cache), _ = jax.lax.scan(one_layer, (carry, kv_cache), per_layer)
        taken[key], first = start + n, first + n
    return epilogue(params, carry, batch, args=args), kv_cache


def fuse_layer(p: dict) -> dict:
    """One layer's MLP gate and up joined ([D, 2F]), and its experts' ([E, D, 2F]): one product
    where there were two (models_jax/llama.py's fuse_layer says why). Attention's projections
    stay apart: their shapes tell the layer's kind."""
    mlp = llama._joined(p["mlp"], ("gate", "up"), "gate_up")
    out = {**p, "mlp": mlp}
    experts = p.get("experts")
    if experts is not None and "gate" in experts and all(
            isinstance(experts[n], jax.Array) and experts[n].dtype == jnp.float32 for n in ("gate", "up")):
        out["experts"] = {"gate_up": jnp.concatenate([experts["gate"], experts["up"]], axis=-1),
                          "down": experts["down"]}
    return out


def pack_layer(p: dict) -> dict:
    """One layer's matrices as runtime.ops.matmul.PackedWeight for the CPU kernels (q, k, v as
    [D, heads * hd], o, the joined MLP, the per-layer input's two), its float32 experts as
    PackedExperts; norms, scales and the router as they are."""
    out = dict(p)
    for name in ("q", "k", "v"):
        if name in p and isinstance(p[name], jax.Array):
            out[name] = pack_matrix(p[name].reshape(p[name].shape[0], -1))
    out["o"] = pack_matrix(p["o"], inputs=2)
    if "gate_up" in p["mlp"]:
        out["mlp"] = {**p["mlp"], "gate_up": pack_matrix(p["mlp"]["gate_up"]), "down": pack_matrix(p["mlp"]["down"])}
    for name in ("per_layer_gate", "per_layer_proj"):
        if name in p:
            out[name] = pack_matrix(p[name])
    if "experts" in p:
        out["experts"] = llama_moe.pack_moe_block({"experts": p["experts"]})["experts"]
    return out


ENTRY = ModelEntry(
    architectures=("Gemma4ForCausalLM",),
    config_from_hf=Gemma4Args.from_hf,
    weight_table=weight_table,
    forward=forward,
    stages=(prologue, decoder_layer, epilogue),
    layer_stacks=layer_stacks,
    fuse_layer=fuse_layer,
    pack_layer=pack_layer,
    pack_head=llama.pack_head,
    kv_spec=kv_spec,
    window_blocks=True,  # the sliding layers keep only their window's blocks (KV cache groups)
)
