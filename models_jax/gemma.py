"""Gemma 2 and Gemma 3 (text) in plain JAX, on the Llama decoder's scan and stages.

What differs from models_jax/llama.py, all read from the Hugging Face config:
- RMSNorm scales by (1 + weight), multiplied in float32 before the cast back (the checkpoints
  store zero-centred norm weights);
- the embedding is multiplied by sqrt(hidden_size), that factor rounded to the model dtype
  first, as transformers does; the LM head is tied to the embedding (unless the config unties it);
- four norms per layer: before and after attention, before and after the feed-forward block,
  whose outputs are normed before they join the residual;
- the feed-forward block is GeGLU: down(gelu_tanh(gate(x)) * up(x));
- attention scales by query_pre_attn_scalar ** -1/2 (not head_dim ** -1/2);
- sliding-window and global layers interleave by `layer_types`, the window a per-layer value
  (llama.layer_windows: a traced per-layer window under the scan); the sliding layers keep only
  their window's blocks of the paged cache (`window_blocks`: the global layers form one KV cache
  group and the sliding ones others, runtime.ops.step.KVCacheGroups), so a long sequence holds
  its global layers' context plus the windows (Gemma 3: ~1/6 of every layer's full context);
- Gemma 2: attention logits soft-capped (cap * tanh(s / cap), `attn_logit_softcapping`) in
  paged_attention on every backend, and the final logits likewise (`final_logit_softcapping`);
- Gemma 3: per-head RMSNorm of q and k (QK-norm, with Gemma's (1 + weight)); each layer type its
  own rotary table (sliding layers `rope_local_base_freq`, global ones `rope_theta` with its
  scaling, e.g. linear), so the carry holds two tables when they differ and each layer picks
  its own; final logits soft-capped when the config sets it (transformers' Gemma 3 ignores
  `attn_logit_softcapping`, so this does too).

Refused with ModelLoadError (transformers-compatible results could not be promised):
`use_bidirectional_attention` (embedding-style Gemma 3 configs; servax attends causally),
activations other than gelu_pytorch_tanh. Gemma3ForConditionalGeneration (the multimodal
4B/12B/27B checkpoints, weights under `model.language_model.`) is not declared: it falls
back to torchax. LoRA adapters are not served on these models.

Gemma 4 (`Gemma4ForCausalLM`) is models_jax/gemma4.py: its layers differ in head shape and
weights by kind, its norms are plain weights, and it adds per-layer inputs, KV sharing and experts.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models_jax import ModelEntry, layers, llama
from models_jax.weights import WeightSpec, vector, zeros
from runtime.ops.attention import paged_attention
from runtime.ops.attention_common import soft_cap
from runtime.ops.step import KVCache, StepInput

ACTIVATIONS = ("gelu_pytorch_tanh",)
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class GemmaArgs(llama.LlamaArgs):
    """The Llama family's hyperparameters plus Gemma's (hashable)."""

    # The sliding layers' rotary settings where they differ from the global layers' `rope`
    # (Gemma 3); None: every layer uses `rope`.
    local_rope: layers.RopeConfig | None = None
    query_pre_attn_scalar: float = 256.0  # attention scale: its -1/2 power
    attn_logit_softcap: float | None = None  # Gemma 2
    final_logit_softcap: float | None = None

    @classmethod
    def from_hf(cls, cfg: Any) -> "GemmaArgs":
        """Raises ValueError on config features these models do not implement."""
        arch = (cfg.architectures or ["Gemma2ForCausalLM"])[0]
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or ACTIVATIONS[0]
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_activation {act!r} is not supported (only {', '.join(ACTIVATIONS)})")
        if getattr(cfg, "use_bidirectional_attention", None):
            raise ValueError("use_bidirectional_attention is not supported (servax attends causally); "
                             "use model_impl='torchax'")
        num_layers = cfg.num_hidden_layers
        layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * num_layers)
        if len(layer_types) != num_layers or not set(layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types {layer_types} must name {num_layers} layers, each one of {LAYER_TYPES}")
        window = getattr(cfg, "sliding_window", None)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope, local_rope = _rope_configs(cfg, head_dim)
        bias = bool(getattr(cfg, "attention_bias", False))
        attn_cap = getattr(cfg, "attn_logit_softcapping", None) if arch == "Gemma2ForCausalLM" else None
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=num_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope=rope,
            sliding_windows=tuple(window if t == "sliding_attention" else None for t in layer_types),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=arch == "Gemma3ForCausalLM",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
            initializer_range=float(getattr(cfg, "initializer_range", 0.02)),
            local_rope=local_rope,
            query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
            attn_logit_softcap=float(attn_cap) if attn_cap else None,
            final_logit_softcap=_cap(getattr(cfg, "final_logit_softcapping", None)),
        )


def _cap(value: Any) -> float | None:
    return float(value) if value else None


def _rope_configs(cfg: Any, head_dim: int) -> tuple[layers.RopeConfig, layers.RopeConfig | None]:
    """(global layers' rope, sliding layers' rope or None where it is the same).

    transformers 5 keys Gemma 3's `rope_parameters` by layer type ({"full_attention": {...},
    "sliding_attention": {...}}); Gemma 2's is one dict for all layers."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if not set(params) & set(LAYER_TYPES):
        return layers.RopeConfig.from_hf(cfg, head_dim), None

    def of(layer_type: str) -> layers.RopeConfig:
        one = types.SimpleNamespace(rope_parameters=params.get(layer_type) or {"rope_type": "default"},
                                    max_position_embeddings=cfg.max_position_embeddings)
        return layers.RopeConfig.from_hf(one, head_dim)

    rope, local = of("full_attention"), of("sliding_attention")
    return rope, (None if local == rope else local)


def weight_table(a: GemmaArgs) -> dict:
    """The Llama family's table (q/k/v/o, Gemma 3's q/k norms, gate/up/down, a tied or separate
    head) with Gemma's four norms per layer; norms initialise to zeros (scale 1 + weight)."""
    d = a.hidden_size
    pre = "model.layers.{layer}."
    layer = llama.layer_table(a)
    layer["pre_ffw_norm"] = vector(pre + "pre_feedforward_layernorm.weight", d, ("embed",))
    layer["post_ffw_norm"] = vector(pre + "post_feedforward_layernorm.weight", d, ("embed",))
    table = llama.weight_table(a, {k: _zero_centred(w) if k.endswith("norm") else w for k, w in layer.items()})
    return {**table, "final_norm": _zero_centred(table["final_norm"])}


def _zero_centred(w: WeightSpec) -> WeightSpec:
    """A norm weight that transformers stores as an offset from 1: random init draws zeros."""
    return dataclasses.replace(w, init=zeros)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm over the last axis: x / rms(x) * (1 + weight), all in float32, then cast
    to x's dtype (Llama casts before the multiply; transformers' Gemma after). x: [..., D]."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


# ---- the step in three stages (see models_jax/__init__.py) --------------------------------


def prologue(params: dict, batch: StepInput, *, args: GemmaArgs) -> tuple[jax.Array, ...]:
    """Scaled embeddings and rotary tables: the carry (x [T, D], cos [T, hd], sin [T, hd]) and,
    where the sliding layers have their own rope, (local_cos, local_sin) after them."""
    x, cos, sin = llama.prologue(params, batch, args=args)
    with jax.named_scope("embed_scale"):
        x = x * jnp.asarray(np.float32(args.hidden_size**0.5)).astype(x.dtype)  # as transformers rounds it
    if args.local_rope is None:
        return x, cos, sin
    with jax.named_scope("local_rope"):
        local_cos, local_sin = layers.rope_cos_sin(args.local_rope, batch.positions, llama.token_seq_lens(batch))
    return x, cos, sin, local_cos, local_sin


def layer_rope(args: GemmaArgs, tables: tuple[jax.Array, ...], i: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Layer i's (cos, sin) [T, hd]: the sliding layers' tables for a sliding layer, else the
    global ones (chosen by a traced per-layer flag where the two kinds interleave)."""
    if len(tables) == 2:
        return tables
    cos, sin, local_cos, local_sin = tables
    sliding = [w is not None for w in args.sliding_windows]
    if all(sliding):
        return local_cos, local_sin
    if not any(sliding):
        return cos, sin
    local = jnp.asarray(sliding)[i]
    return jnp.where(local, local_cos, cos), jnp.where(local, local_sin, sin)


def attention_block(
    x: jax.Array,  # [T, D], normed
    p: dict,  # one layer's weights
    kv_cache: KVCache,
    i: jax.Array,  # [] int32, the layer index
    batch: StepInput,
    cos: jax.Array,  # [T, hd]
    sin: jax.Array,  # [T, hd]
    a: GemmaArgs,
    window: int | jax.Array | None,
) -> tuple[jax.Array, KVCache]:  # [T, D], the cache with layer i written
    """q/k/v (Gemma 3: QK-norm), rope, paged attention scaled by query_pre_attn_scalar and
    soft-capped where the model caps, then o."""
    with jax.named_scope("qkv"):
        if "qkv" in p:  # joined by fuse_layer
            kv_heads = a.num_kv_heads * a.kv_repeat
            q, k, v = layers.project_to_joined_heads(x, p["qkv"], p.get("qkv_bias"),
                                                     (a.num_heads, kv_heads, kv_heads), a.head_dim, batch.num_tokens)
        else:
            q = layers.project_to_heads(x, p["q"], p.get("q_bias"))  # [T, H, hd]
            k = layers.project_to_heads(x, p["k"], p.get("k_bias"))  # [T, KV, hd]
            v = layers.project_to_heads(x, p["v"], p.get("v_bias"))
        if a.qk_norm:
            q = rms_norm(q, p["q_norm"], a.rms_norm_eps)
            k = rms_norm(k, p["k_norm"], a.rms_norm_eps)
        q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
    with jax.named_scope("paged_attention"):
        out, kv_cache = paged_attention(q, k, v, kv_cache, batch, layer=i, scale=a.query_pre_attn_scalar**-0.5,
                                        sliding_window=window, logit_soft_cap=a.attn_logit_softcap)
    with jax.named_scope("o"):
        return layers.project_from_heads(out, p["o"], p.get("o_bias"), batch.num_tokens), kv_cache


def decoder_layer(p: dict, carry: tuple, kv_cache: KVCache, i: jax.Array, batch: StepInput, *,
                  args: GemmaArgs) -> tuple[tuple, KVCache]:
    """Decoder layer `i`: x + norm(attention(norm(x))), then + norm(geglu(norm(x)))."""
    x, tables = carry[0], carry[1:]
    cos, sin = layer_rope(args, tables, i)
    window, windows = llama.layer_windows(args)
    eps = args.rms_norm_eps
    h, kv_cache = attention_block(rms_norm(x, p["input_norm"], eps), p, kv_cache, i, batch, cos, sin, args,
                                  window if windows is None else windows[i])
    x = x + rms_norm(h, p["post_attn_norm"], eps)
    with jax.named_scope("mlp"):
        h = layers.gated_mlp(rms_norm(x, p["pre_ffw_norm"], eps), p["mlp"], rows=batch.num_tokens,
                             activation=layers.gelu_tanh)
        x = x + rms_norm(h, p["post_ffw_norm"], eps)
    return (x, *tables), kv_cache


def epilogue(params: dict, carry: tuple, batch: StepInput, *, args: GemmaArgs) -> jax.Array:
    """Final norm, the (tied) LM head and the final soft cap on the rows at
    `batch.logits_indices`: logits [S, vocab] float32."""
    with jax.named_scope("lm_head"):
        x = rms_norm(carry[0][batch.logits_indices], params["final_norm"], args.rms_norm_eps)  # [S, D]
        logits = llama.lm_head(params, x, batch, tied=args.tie_word_embeddings)
        return soft_cap(logits, args.final_logit_softcap)


# One serving step: these three stages, the decoder layers under the Llama family's scan.
forward = functools.partial(llama.forward, layer_fn=decoder_layer, prologue_fn=prologue, epilogue_fn=epilogue)


ENTRY = ModelEntry(
    architectures=("Gemma2ForCausalLM", "Gemma3ForCausalLM"),
    config_from_hf=GemmaArgs.from_hf,
    weight_table=weight_table,
    forward=forward,
    stages=(prologue, decoder_layer, epilogue),
    fuse_layer=llama.fuse_layer,  # q/k/v and gate/up joined, as the Llama family joins them
    pack_layer=llama.pack_layer,
    pack_head=llama.pack_head,
    window_blocks=True,  # the sliding layers keep only their window's blocks (KV cache groups)
)
