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
zero-padded key gives the same logit; the padded output columns are dropped; the C++ kernel of
the cpu backend instead reads only each row's first head-size dims, so the smaller heads attend
over their own bytes), and
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

The config and its per-layer facts (`Gemma4Args`, `layer_stacks`) are in models_jax/gemma4_config.py,
the weight table in models_jax/gemma4_weights.py; this module is the KV cache's shape and the step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models_jax import ModelEntry, layers, llama, llama_moe, moe
from models_jax.gemma4_config import Gemma4Args, layer_stacks
from models_jax.gemma4_weights import weight_table
from models_jax.weights import joined_projections
from runtime.ops.attention import NO_SLIDING_WINDOW, paged_attention
from runtime.ops.attention_common import soft_cap
from runtime.ops.matmul import PackedWeight, pack_matrix
from runtime.ops.step import KVCache, KVCacheSpec, StepInput


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
        if kv_cache.attention_backend != "cpu":  # the C++ kernel reads the first hd dims of wider rows
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
    mlp = joined_projections(p["mlp"], ("gate", "up"), "gate_up")
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
