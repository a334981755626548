"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over a latent cache: the absorbed and
expanded forms of one step's attention, and the choice between them.

The paged cache keeps one latent per token and layer, [c, k_rope] (kv_lora_rank +
qk_rope_head_dim dims, the first kv_lora_rank also the values); models_jax/deepseek.py makes the
queries and the latents and takes the output through o_proj.

kv_b_proj holds W_UK [r, H, nope] and W_UV [r, H, v]; head h's score without rope is
q_nope . (c W_UK_h) = (W_UK_h q_nope) . c. Attention runs in one of two forms (`latent_attention`):

- absorbed (decodes always, as vLLM and tpu-inference decode): each query is multiplied into the
  latent space, attention runs over [c, k_rope] as one KV head shared by all H query heads
  (runtime.ops.attention.paged_attention with value_dims), and each head's latent output goes
  out through W_UV. Per query and context token it costs H (2r + rope) products and nothing
  per context token, which is what a decode needs.
- expanded (prefills, as vLLM's MLA backends compute a prefill and its context): the context's
  latents become per-head keys [c W_UK_h, k_rope] and values c W_UV_h as the XLA path reads their
  blocks (runtime.ops.attention.expanded_latent_attention), the step's own from its latents
  directly; scores over nope + rope dims and values over v dims per head. That costs a product
  with W_UK and W_UV per context token and query tile, and H (nope + rope + v) per query and
  context token instead of H (2r + rope): cheaper once enough queries share the expansion.
  The cache keeps only the latent either way.

A step puts its running decodes first (its first S tokens, S its padded sequence slots), so the
split is by position: those slots are absorbed and the tokens after them (prefills, chunks of
them, prompts after prefix hits) take the form `mla_prefill` names (EngineConfig; the KV cache
carries it): absorbed, expanded, or auto, which asks `expanded_is_cheaper` of the step's real
tokens after the decodes' slots, in the program (lax.cond: one compiled program, whichever runs).
Each token's softmax runs whole in one form; the two forms' running states live in different
value spaces (the latent, each head's v) and are never merged: a token attends every key of its
context, cached and new, in its own form, and only the outputs ([T, H, v]) are joined.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from runtime.ops.attention import expanded_latent_attention, paged_attention, write_step_kv
from runtime.ops.matmul import PackedExperts
from runtime.ops.step import KVCache, StepInput

# mla_prefill "auto": the tokens after a step's decodes attend expanded from this many on, per
# attention backend (benchmarks/mla_prefill.py measures the two forms; figures in RESULTS.md).
EXPANDED_MIN_TOKENS = {"cpu": 256, "xla": 192}


def expanded_is_cheaper(batch: StepInput, decodes: int, backend: str) -> jax.Array:
    """Whether the tokens after a step's `decodes` slots attend more cheaply expanded (a [] bool):
    when there are at least EXPANDED_MIN_TOKENS[backend] of them. Expanding costs about the same per new
    token as absorbing a query and un-absorbing its output, and per cached context token and
    query tile a fixed product with W_UK and W_UV; in exchange every score and value product runs
    over nope + rope and v dims per head instead of kv_lora_rank + rope and kv_lora_rank."""
    return batch.num_tokens - decodes >= EXPANDED_MIN_TOKENS.get(backend, EXPANDED_MIN_TOKENS["xla"])


def per_head(x: jax.Array, w: PackedExperts) -> jax.Array:
    """x [T, H, in] times head h's matrix w[h] [in, out] for each head -> [T, H, out], by the
    grouped kernel (PackedExperts [H, in, out]), the heads' rows as its groups."""
    t, h, d = x.shape
    y = w.grouped_matmul(x.transpose(1, 0, 2).reshape(h * t, d), jnp.full((h,), t, jnp.int32))
    return y.reshape(h, t, -1).transpose(1, 0, 2).astype(x.dtype)


def latent_attention(
    q_nope: jax.Array,  # [T, H, nope]
    q_rope: jax.Array,  # [T, H, rope], rotated
    key: jax.Array,  # [T, 1, r + rope]: the step's latents and rotary keys, what the cache keeps
    kv_cache: KVCache,
    i: jax.Array,  # [] int32, the layer
    batch: StepInput,
    w_uk: jax.Array,  # [r, H, nope]
    w_uv: jax.Array,  # [r, H, v]
    *,
    scale: float,
    heads_first: tuple[PackedExperts, PackedExperts] | None = None,  # W_UK [H, nope, r], W_UV [H, r, v]
) -> tuple[jax.Array, KVCache]:  # [T, H, v], the cache with the step's latents written
    """Multi-head latent attention of a step, in the form kv_cache.mla_prefill asks for (see the
    module docstring): every token absorbed, or the decodes' slots (the first S tokens) absorbed
    and the tokens after them expanded; auto picks between the two where `expanded_is_cheaper`,
    by lax.cond after the step's latents are written, so one compiled program serves both and
    each token attends once.

    `heads_first`: the same W_UK and W_UV packed head-major for the grouped kernel, where the
    model keeps them so (models_jax/deepseek.py's pack_layer); else the absorbed products read
    w_uk and w_uv, which XLA:CPU then transposes every step."""
    r = w_uk.shape[0]
    uk, uv = heads_first if heads_first is not None else (None, None)

    def absorbed_query(tokens: slice) -> jax.Array:  # [n, H, r + rope]: queries in the latent space
        with jax.named_scope("absorb"):
            if uk is not None:
                q_latent = per_head(q_nope[tokens], uk)
            else:
                q_latent = jnp.einsum("thn,rhn->thr", q_nope[tokens], w_uk)
            return jnp.concatenate([q_latent, q_rope[tokens]], axis=-1)

    def unabsorb(out: jax.Array) -> jax.Array:  # [n, H, r] -> [n, H, v]
        if uv is not None:
            return per_head(out, uv)
        return jnp.einsum("thr,rhv->thv", out, w_uv)

    num_tokens = q_nope.shape[0]
    decodes = min(batch.block_tables.shape[0], num_tokens)  # the scheduler puts running decodes first
    form = kv_cache.mla_prefill
    if form == "absorbed" or decodes == num_tokens:
        with jax.named_scope("paged_attention"):
            out, kv_cache = paged_attention(absorbed_query(slice(None)), key, None, kv_cache, batch, layer=i,
                                            scale=scale, value_dims=r)  # [T, H, r]
        return unabsorb(out), kv_cache
    with jax.named_scope("paged_attention"):
        kv_cache = write_step_kv(kv_cache, key, None, batch, layer=i)

        def absorbed_attention(tokens: slice, kv_cache: KVCache) -> jax.Array:  # [n, H, v], the first n tokens
            out, _ = paged_attention(absorbed_query(tokens), key, None, kv_cache, batch, layer=i, scale=scale,
                                     value_dims=r, write=False)
            return unabsorb(out)

        def split(kv_cache: KVCache) -> jax.Array:  # [T, H, v]: the decodes' slots absorbed, the rest expanded
            q = jnp.concatenate([q_nope, q_rope], axis=-1)  # [T, H, nope + rope]
            tail = expanded_latent_attention(q, key, kv_cache, batch, layer=i, scale=scale, w_uk=w_uk, w_uv=w_uv,
                                             first_token=decodes)[decodes:]
            head = absorbed_attention(slice(0, decodes), kv_cache)
            return jnp.concatenate([head, tail.astype(head.dtype)])

        if form == "expanded":
            return split(kv_cache), kv_cache
        cheaper = expanded_is_cheaper(batch, decodes, kv_cache.attention_backend)
        return jax.lax.cond(cheaper, split, functools.partial(absorbed_attention, slice(None)), kv_cache), kv_cache
