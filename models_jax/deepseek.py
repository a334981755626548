"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention and experts with shared experts.

Attention (MLA). kv_a_proj_with_mqa compresses each token to a latent c (kv_lora_rank dims,
RMS-normed) and a rotary key k_rope (qk_rope_head_dim dims, shared by every head). The paged
cache keeps just [c, k_rope] per token and layer, one "head" of kv_lora_rank + qk_rope_head_dim
dims whose first kv_lora_rank dims are also the values (the model's own KVCacheSpec, see
`kv_spec`), instead of every head's keys and values.

kv_b_proj holds W_UK [r, H, nope] and W_UV [r, H, v]. Attention runs absorbed (decodes always,
and every token under mla_prefill "absorbed") or expanded (the tokens after the decodes under
"expanded", or "auto" where it is cheaper): models_jax/mla.py describes both forms and the choice.

Queries: q_proj (DeepSeek-V2-Lite, q_lora_rank None), or q_a_proj -> RMSNorm -> q_b_proj.
Rotary: YaRN with DeepSeek's mscale (cos and sin scaled by the attention factor, the softmax
scale by mscale(factor, mscale_all_dim)^2), on dims in interleaved pairs (V2 always, V3 with
`rope_interleave`): q and k are de-interleaved alike before the rotate-half form, which leaves
every score as transformers computes it.

Feed-forward: the first `first_k_dense_replace` layers have a dense SwiGLU MLP; the others the
MoE block (models_jax/moe.py) with DeepSeek's router: V2 softmax, greedy or group-limited;
V3 sigmoid scores chosen with `e_score_correction_bias` (choosing, not weighting) among the best
`topk_group` of `n_group` groups; both scaled by `routed_scaling_factor`, with
`n_shared_experts` shared experts (one ungated MLP) beside them.

The layers are not uniform, so their weights lie in two stacks over one KV cache (params
"dense_layers", then "layers"): `forward` scans each; the runtime's layered step
(runtime/ops/layered.py) runs a layer program per stack on per-layer weights, packed for the
CPU kernels where it runs them (`pack_layer`: q/kv_a/o and the MLPs; the routed experts through
the grouped kernel). LoRA adapters are not served on these models. Multi-token-prediction
layers (V3's model.layers.61) are not read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from models_jax import ModelEntry, layers, llama, llama_moe, moe
from models_jax.mla import latent_attention
from models_jax.weights import (
    WeightSpec, embedding, is_weight_spec, joined_projections, linear, linear_from_heads, linear_to_heads, stacked,
    vector, zeros,
)
from runtime.ops.matmul import PackedExperts, PackedWeight, pack_matrix
from runtime.ops.step import KVCache, KVCacheSpec, StepInput

# The RMSNorms inside attention (q_a_layernorm, kv_a_layernorm) keep transformers' default eps,
# whatever the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class DeepseekArgs:
    """Static hyperparameters of one model (hashable: closed over by the jitted step)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    num_layers: int
    num_dense_layers: int  # first_k_dense_replace: layers [0, this) dense, the rest MoE
    num_heads: int
    q_lora_rank: int | None  # None: one q projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope: layers.RopeConfig
    rope_interleave: bool
    softmax_scale: float
    moe: moe.MoeConfig
    shared_intermediate_size: int  # n_shared_experts * moe_intermediate_size; 0: none
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    num_kv_heads: int = 1  # the latent: one KV head that every query head reads
    kv_repeat: int = 1  # never repeated (kv_spec: the latent is whole on every device)

    @property
    def head_dim(self) -> int:
        """What the cache holds per token and layer: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, cfg: Any) -> "DeepseekArgs":
        """Raises ValueError on config features these models do not implement."""
        v3 = "DeepseekV3ForCausalLM" in (cfg.architectures or []) or getattr(cfg, "model_type", None) == "deepseek_v3"
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        num_experts, top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        if v3:  # transformers' V3 router: sigmoid, correction bias, groups ranked by their best two
            routing, groups, norm = "sigmoid_topk", (cfg.n_group or 1, cfg.topk_group or 1), bool(cfg.norm_topk_prob)
        else:  # V2: softmax, greedy or group-limited greedy; transformers' V2 router never renormalizes
            method = getattr(cfg, "topk_method", "greedy") or "greedy"
            if method not in ("greedy", "group_limited_greedy"):
                raise ValueError(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)")
            limited = method == "group_limited_greedy"
            routing, groups, norm = "softmax_topk", (cfg.n_group, cfg.topk_group) if limited else (1, 1), False
        if num_experts % groups[0] or top_k > groups[1] * (num_experts // groups[0]):
            raise ValueError(f"{num_experts} experts in n_group={groups[0]} groups, top {groups[1]} groups, "
                             f"cannot route each token to num_experts_per_tok={top_k}")
        config = moe.MoeConfig(
            num_experts=num_experts, top_k=top_k, intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=norm,
            routing=routing, num_groups=groups[0], topk_groups=groups[1],
            routed_scaling_factor=float(cfg.routed_scaling_factor),
        )
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_dense_layers=min(int(cfg.first_k_dense_replace or 0), cfg.num_hidden_layers),
            num_heads=cfg.num_attention_heads,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope=layers.RopeConfig.from_hf(cfg, cfg.qk_rope_head_dim),
            rope_interleave=bool(getattr(cfg, "rope_interleave", True)),  # V2 rotates pairs always
            softmax_scale=softmax_scale(cfg),
            moe=config,
            shared_intermediate_size=cfg.moe_intermediate_size * (cfg.n_shared_experts or 0),
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            initializer_range=float(getattr(cfg, "initializer_range", 0.02)),
        )


def softmax_scale(cfg: Any) -> float:
    """1 / sqrt(qk head dim), times mscale(factor, mscale_all_dim)^2 under a scaled rope
    (transformers' yarn_apply_mscale)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    mscale_all_dim = params.get("mscale_all_dim")
    if params.get("rope_type", params.get("type", "default")) != "default" and mscale_all_dim:
        factor = params["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def kv_spec(a: DeepseekArgs, dtype: Any) -> KVCacheSpec:
    """One latent per token and layer: [c, k_rope], whose first kv_lora_rank dims are the values."""
    return KVCacheSpec(a.num_layers, 1, a.head_dim, dtype, value_dims=a.kv_lora_rank)


# ---- weights ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _FromLayer(WeightSpec):
    """A stacked WeightSpec whose layers are the checkpoint's layers first_layer, first_layer + 1, ...
    (the MoE layers after the first dense ones)."""

    first_layer: int = 0

    @property
    def hf_names(self) -> list[str]:
        names = [self.hf_name.replace("{layer}", str(self.first_layer + i)) for i in range(self.num_layers)]
        if self.num_experts:
            names = [n.replace("{expert}", str(e)) for n in names for e in range(self.num_experts)]
        return names


def _stacked_from(layer_table: dict, first: int, count: int) -> dict:
    """`stacked(layer_table, count)` over the checkpoint's layers first .. first + count - 1."""
    return jax.tree.map(lambda w: _FromLayer(**vars(w), first_layer=first), stacked(layer_table, count),
                        is_leaf=is_weight_spec)


def weight_table(a: DeepseekArgs) -> dict:
    """The params tree as WeightSpecs: the dense layers and the MoE layers as two stacks.

    Sharded as the Llama family's (models_jax/llama.py): query heads, kv_b and o by head, MLP
    features, the vocabulary; the latent projection (kv_a) and its norm whole on every device,
    as is the cache it fills. Routed experts as the MoE block lays them out."""
    d, k = a.hidden_size, a.num_dense_layers
    normal = jax.nn.initializers.normal(a.initializer_range)
    table = {
        "embed": embedding("model.embed_tokens.weight", a.vocab_size, d, normal),
        "final_norm": vector("model.norm.weight", d, ("embed",)),
    }
    if k:
        table["dense_layers"] = _stacked_from({**attention_table(a), "mlp": dense_mlp_table(a)}, 0, k)
    if a.num_layers > k:
        table["layers"] = _stacked_from({**attention_table(a), "mlp": moe_table(a)}, k, a.num_layers - k)
    if not a.tie_word_embeddings:
        table["lm_head"] = linear("lm_head.weight", d, a.vocab_size, ("embed", "vocab"), normal)
    return table


def attention_table(a: DeepseekArgs) -> dict:
    """One layer's norms and latent attention (hf_names with `{layer}`)."""
    d, h, r, rope = a.hidden_size, a.num_heads, a.kv_lora_rank, a.qk_rope_head_dim
    qk, nope_v = a.qk_nope_head_dim + rope, a.qk_nope_head_dim + a.v_head_dim
    normal = jax.nn.initializers.normal(a.initializer_range)
    pre = "model.layers.{layer}."
    attn = pre + "self_attn."
    w = {
        "input_norm": vector(pre + "input_layernorm.weight", d, ("embed",)),
        "kv_a": linear(attn + "kv_a_proj_with_mqa.weight", d, r + rope, ("embed", None), normal),
        "kv_a_norm": vector(attn + "kv_a_layernorm.weight", r),
        # [r, H, nope + v]: W_UK and W_UV side by side per head
        "kv_b": WeightSpec(attn + "kv_b_proj.weight", (h * nope_v, r), (None, "q_heads", "head_dim"), normal,
                           view=(h, nope_v, r), perm=(2, 0, 1)),
        "o": linear_from_heads(attn + "o_proj.weight", h, a.v_head_dim, d, normal),
        "post_attn_norm": vector(pre + "post_attention_layernorm.weight", d, ("embed",)),
    }
    if a.q_lora_rank is None:
        w["q"] = linear_to_heads(attn + "q_proj.weight", d, h, qk, "q_heads", normal)
    else:
        w["q_a"] = linear(attn + "q_a_proj.weight", d, a.q_lora_rank, ("embed", None), normal)
        w["q_a_norm"] = vector(attn + "q_a_layernorm.weight", a.q_lora_rank)
        w["q_b"] = linear_to_heads(attn + "q_b_proj.weight", a.q_lora_rank, h, qk, "q_heads", normal)
    if a.attention_bias:
        w["kv_a_bias"] = vector(attn + "kv_a_proj_with_mqa.bias", r + rope, (None,), zeros)
        w["o_bias"] = vector(attn + "o_proj.bias", d, ("embed",), zeros)
        if a.q_lora_rank is not None:
            w["q_a_bias"] = vector(attn + "q_a_proj.bias", a.q_lora_rank, (None,), zeros)
    return w


def _swiglu_table(prefix: str, d: int, f: int, init: Any) -> dict:
    return {
        "gate": linear(prefix + "gate_proj.weight", d, f, ("embed", "mlp"), init),
        "up": linear(prefix + "up_proj.weight", d, f, ("embed", "mlp"), init),
        "down": linear(prefix + "down_proj.weight", f, d, ("mlp", "embed"), init),
    }


def dense_mlp_table(a: DeepseekArgs) -> dict:
    return _swiglu_table("model.layers.{layer}.mlp.", a.hidden_size, a.intermediate_size,
                         jax.nn.initializers.normal(a.initializer_range))


def moe_table(a: DeepseekArgs) -> dict:
    """The MoE block: the router (float32, as transformers keeps it), V3's correction bias, the
    routed experts and the shared experts."""
    d, m = a.hidden_size, a.moe
    normal = jax.nn.initializers.normal(a.initializer_range)
    pre = "model.layers.{layer}.mlp."
    block = {
        "router": dataclasses.replace(moe.router_weight(pre + "gate.weight", d, m.num_experts, normal),
                                      dtype=jnp.float32),
        "experts": moe.expert_weights(pre + "experts", ("gate_proj", "up_proj", "down_proj"), d,
                                      m.intermediate_size, m.num_experts, normal, m.expert_parallel),
    }
    if m.routing == "sigmoid_topk":
        block["correction_bias"] = dataclasses.replace(
            vector(pre + "gate.e_score_correction_bias", m.num_experts, (None,), zeros), dtype=jnp.float32)
    if a.shared_intermediate_size:
        block["shared"] = _swiglu_table(pre + "shared_experts.", d, a.shared_intermediate_size, normal)
    return block


# ---- the step --------------------------------------------------------------------------


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """Rotary embedding of x [T, heads, rope] (cos, sin [T, rope]); interleaved pairs
    (x0, x1), (x2, x3), ... come out as [rotated evens, rotated odds] (transformers' V3 layout;
    V2 keeps the pairs interleaved, and q . k is the same either way)."""
    if interleaved:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return layers.apply_rope(x, cos, sin)


def _linear(x: jax.Array, w: Any, b: jax.Array | None, rows: jax.Array) -> jax.Array:
    """x [T, in] @ w [in, out] (or w packed; rows: see layers.matmul) (+ b)."""
    y = layers.matmul(x, w, rows)
    return y if b is None else y + b


def _to_heads(x: jax.Array, w: Any, heads: int, rows: jax.Array) -> jax.Array:
    """x [T, in] @ w [in, heads, dims] (or that packed as [in, heads * dims]) -> [T, heads, dims]."""
    if isinstance(w, PackedWeight):
        return w.matmul(x, rows).reshape(x.shape[0], heads, -1)
    return layers.project_to_heads(x, w)




def attention_block(
    x: jax.Array,  # [T, D]
    p: dict,  # one layer's weights
    kv_cache: KVCache,
    i: jax.Array,  # [] int32, the layer index in the cache
    batch: StepInput,
    cos: jax.Array,  # [T, rope]
    sin: jax.Array,  # [T, rope]
    a: DeepseekArgs,
) -> tuple[jax.Array, KVCache]:  # [T, D], the cache with layer i's latents written
    """Latent attention: queries, the step's latents, `latent_attention`, o_proj."""
    nope, r = a.qk_nope_head_dim, a.kv_lora_rank
    with jax.named_scope("q"):
        rows, h = batch.num_tokens, a.num_heads
        if "q" in p:
            q = _to_heads(x, p["q"], h, rows)  # [T, H, nope + rope]
        else:
            q_a = layers.rms_norm(_linear(x, p["q_a"], p.get("q_a_bias"), rows), p["q_a_norm"], LATENT_NORM_EPS)
            q = _to_heads(q_a, p["q_b"], h, rows)
        q_rope = rope(q[..., nope:], cos, sin, a.rope_interleave)  # [T, H, rope]
    with jax.named_scope("latent"):
        kv = _linear(x, p["kv_a"], p.get("kv_a_bias"), rows)  # [T, r + rope]
        latent = layers.rms_norm(kv[:, :r], p["kv_a_norm"], LATENT_NORM_EPS)  # [T, r]
        k_rope = rope(kv[:, None, r:], cos, sin, a.rope_interleave)  # [T, 1, rope]
        key = jnp.concatenate([latent[:, None, :], k_rope], axis=-1)  # [T, 1, r + rope]: what the cache keeps
    w_uk, w_uv = p["kv_b"][..., :nope], p["kv_b"][..., nope:]  # [r, H, nope], [r, H, v]
    heads_first = (p["uk_heads"], p["uv_heads"]) if "uk_heads" in p else None  # (pack_layer's)
    out, kv_cache = latent_attention(q[..., :nope], q_rope, key, kv_cache, i, batch, w_uk, w_uv,
                                     scale=a.softmax_scale, heads_first=heads_first)
    with jax.named_scope("o"):
        return layers.project_from_heads(out, p["o"], p.get("o_bias"), batch.num_tokens), kv_cache


def feed_forward(x: jax.Array, p: dict, a: DeepseekArgs, batch: StepInput) -> jax.Array:
    """A dense layer's SwiGLU MLP, or a MoE layer's experts and shared experts: [T, D] -> [T, D]."""
    if "router" not in p:
        return layers.gated_mlp(x, p, rows=batch.num_tokens)
    shared = functools.partial(layers.gated_mlp, p=p["shared"], rows=batch.num_tokens) if "shared" in p else None
    return moe.moe_block(x, p, a.moe, batch.num_tokens, shared)


def decoder_layer(p: dict, carry: tuple, kv_cache: KVCache, i: jax.Array, batch: StepInput, *,
                  args: DeepseekArgs) -> tuple[tuple, KVCache]:
    """Decoder layer `i` (dense or MoE, as its weights are): (carry, kv_cache) updated."""
    x, cos, sin = carry
    h, kv_cache = attention_block(layers.rms_norm(x, p["input_norm"], args.rms_norm_eps), p, kv_cache, i, batch,
                                  cos, sin, args)
    x = x + h
    with jax.named_scope("mlp"):
        x = x + feed_forward(layers.rms_norm(x, p["post_attn_norm"], args.rms_norm_eps), p["mlp"], args, batch)
    return (x, cos, sin), kv_cache


def forward(params: dict, kv_cache: KVCache, batch: StepInput, *, args: DeepseekArgs) -> tuple[jax.Array, KVCache]:
    """One serving step: the Llama family's prologue (embeddings, rope tables of the rotary
    dims), the dense layers and then the MoE layers each under a scan, its epilogue. Returns
    (logits [S, vocab] float32, the updated kv_cache)."""
    carry = llama.prologue(params, batch, args=args)

    def one_layer(state, per_layer):
        carry, kv_cache = state
        p, i = per_layer
        return decoder_layer(p, carry, kv_cache, i, batch, args=args), None

    stacks = (("dense_layers", 0, args.num_dense_layers), ("layers", args.num_dense_layers, args.num_layers))
    for key, first, end in stacks:
        if end > first:
            with jax.named_scope(key):
                per_layer = (params[key], jnp.arange(first, end, dtype=jnp.int32))
                (carry, kv_cache), _ = jax.lax.scan(one_layer, (carry, kv_cache), per_layer)
    return llama.epilogue(params, carry, batch, args=args), kv_cache


def layer_stacks(a: DeepseekArgs) -> tuple[tuple[str, int], ...]:
    """The two stacks of layers (runtime.ops.step.LayerStages.stacks): dense, then MoE."""
    stacks = (("dense_layers", a.num_dense_layers), ("layers", a.num_layers - a.num_dense_layers))
    return tuple((key, n) for key, n in stacks if n)


def fuse_layer(p: dict) -> dict:
    """A dense layer's gate and up joined ([D, 2F]); a MoE layer's experts' and shared expert's
    likewise (models_jax/llama_moe.py)."""
    if "router" in p["mlp"]:
        return llama_moe.fuse_layer(p)
    return {**p, "mlp": joined_projections(p["mlp"], ("gate", "up"), "gate_up")}


def pack_layer(p: dict) -> dict:
    """One layer's projections as runtime.ops.matmul.PackedWeight where the kernels take them:
    q (or q_a, q_b) and kv_a, o, the MLP (dense, or the experts and shared expert). kv_b stays
    an array (the expanded form's); its W_UK and W_UV are also packed head-major ("uk_heads"
    [H, nope, r], "uv_heads" [H, r, v]) for the grouped kernel, the heads as its groups, since
    the absorbed form multiplies them per head: read from kv_b, XLA:CPU would transpose them
    every step (most of a decode step's time)."""
    out = dict(p)
    if "uk_heads" not in p:
        nope = p["kv_b"].shape[-1] - p["o"].shape[1]  # kv_b [r, H, nope + v], o [H, v, D]
        out["uk_heads"] = PackedExperts.pack(p["kv_b"][..., :nope].transpose(1, 2, 0))
        out["uv_heads"] = PackedExperts.pack(p["kv_b"][..., nope:].transpose(1, 0, 2))
    for name in ("q", "q_b"):  # [in, H, nope + rope] -> [in, H * (nope + rope)]
        if name in p and isinstance(p[name], jax.Array):
            out[name] = pack_matrix(p[name].reshape(p[name].shape[0], -1))
    for name in ("q_a", "kv_a"):
        if name in p:
            out[name] = pack_matrix(p[name])
    out["o"] = pack_matrix(p["o"], inputs=2)  # [H, v, D] -> [H * v, D]
    mlp = p["mlp"]
    if "router" in mlp:
        out["mlp"] = llama_moe.pack_moe_block(mlp)
    elif "gate_up" in mlp:
        out["mlp"] = {**mlp, "gate_up": pack_matrix(mlp["gate_up"]), "down": pack_matrix(mlp["down"])}
    return out


ENTRY = ModelEntry(
    architectures=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
    config_from_hf=DeepseekArgs.from_hf,
    weight_table=weight_table,
    forward=forward,
    stages=(llama.prologue, decoder_layer, llama.epilogue),
    layer_stacks=layer_stacks,
    fuse_layer=fuse_layer,
    pack_layer=pack_layer,
    pack_head=llama.pack_head,
    kv_spec=kv_spec,
)
