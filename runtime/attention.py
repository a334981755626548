"""Ragged paged attention in pure JAX.

One call serves a batch that mixes whole prefills, chunks of prefills that start
mid-sequence, and single-token decodes. Keys and values live in a paged cache
([num_blocks, block_size, kv_heads, head_dim] per layer); each sequence reaches its
blocks through its row of `block_tables`.

The kernel walks the KV axis in chunks of whole blocks with an online softmax
(flash-attention style), so the live memory is tokens x chunk, and the work is real
tokens x the longest context in the batch, never padded batch x max_model_len.
It is jittable on every backend; on CPU it is what runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from runtime.step import StepInput

# A finite stand-in for -inf keeps exp() and max() free of NaNs on fully masked rows.
_MASK_VALUE = -1e30


def write_kv(
    k_cache: jax.Array,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: jax.Array,  # [num_blocks, block_size, kv_heads, head_dim]
    k: jax.Array,  # [T, kv_heads, head_dim]
    v: jax.Array,  # [T, kv_heads, head_dim]
    slot_mapping: jax.Array,  # [T] int32, negative for padding tokens
) -> tuple[jax.Array, jax.Array]:
    """Scatter the new K/V of each token into its cache slot; padding tokens write nowhere."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    num_slots = num_blocks * block_size
    # Out-of-range indices are dropped by the scatter; negative ones would wrap around.
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)

    def scatter(cache: jax.Array, new: jax.Array) -> jax.Array:
        flat = cache.reshape(num_slots, kv_heads, head_dim)
        flat = flat.at[slots].set(new.astype(cache.dtype), mode="drop")
        return flat.reshape(cache.shape)

    return scatter(k_cache, k), scatter(v_cache, v)


def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_cache: jax.Array,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: jax.Array,  # [num_blocks, block_size, kv_heads, head_dim]
    batch: StepInput,
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    kv_chunk_blocks: int | None = None,
) -> jax.Array:  # [T, num_heads, head_dim], dtype of q
    """Causal attention of each token over its own sequence's cached context.

    The cache must already hold this step's K/V (see `write_kv`). Token t of sequence s
    attends to positions p with p <= positions[t], p < seq_lens[s] and, with a sliding
    window W, positions[t] - p < W (transformers' convention). Grouped-query attention:
    num_heads must be a multiple of kv_heads; query head h reads kv head h // group.

    Args:
        scale: multiplier of q.k (usually head_dim ** -0.5).
        sliding_window: attend only to the last W positions, or None.
        logit_soft_cap: if set, scores become cap * tanh(scores / cap) (Gemma 2).
        kv_chunk_blocks: blocks processed per loop iteration (default: ~16 tokens, the
            fastest on XLA:CPU, where the per-token batched dots favour short chunks).
    """
    q, k_cache, v_cache = jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of kv_heads={kv_heads}")
    group = num_heads // kv_heads
    num_seqs, max_blocks = batch.block_tables.shape
    chunk = kv_chunk_blocks or max(1, 16 // block_size)
    chunk = min(chunk, max_blocks)
    num_chunks_max = -(-max_blocks // chunk)
    chunk_tokens = chunk * block_size

    tok = jnp.arange(num_tokens)
    seq_of_token = jnp.searchsorted(batch.query_start_loc[1:], tok, side="right")
    seq_of_token = jnp.minimum(seq_of_token, num_seqs - 1)  # [T]
    is_real = tok < batch.num_tokens
    q_pos = batch.positions  # [T]
    ctx_len = jnp.where(is_real, batch.seq_lens[seq_of_token], 0)  # [T]
    # Pad the tables to whole chunks; the padded entries are masked by ctx_len.
    tables = jnp.pad(batch.block_tables, ((0, 0), (0, num_chunks_max * chunk - max_blocks)))
    tables = tables[seq_of_token]  # [T, num_chunks_max * chunk]

    qg = (q.astype(jnp.float32) * scale).reshape(num_tokens, kv_heads, group, head_dim)

    # Only visit the chunks some real token needs.
    last_chunk = (jnp.max(ctx_len) + chunk_tokens - 1) // chunk_tokens
    if sliding_window is None:
        first_chunk = jnp.int32(0)
    else:
        lowest = jnp.where(is_real, q_pos - sliding_window + 1, jnp.iinfo(jnp.int32).max)
        first_chunk = jnp.maximum(jnp.min(lowest), 0) // chunk_tokens
        first_chunk = jnp.minimum(first_chunk, last_chunk)

    def body(j, carry):
        m, l, acc = carry
        blocks = jax.lax.dynamic_slice_in_dim(tables, j * chunk, chunk, axis=1)  # [T, chunk]
        k = k_cache[blocks].reshape(num_tokens, chunk_tokens, kv_heads, head_dim)
        v = v_cache[blocks].reshape(num_tokens, chunk_tokens, kv_heads, head_dim)
        s = jnp.einsum("tkgd,tckd->tkgc", qg, k.astype(jnp.float32))
        if logit_soft_cap is not None:
            s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
        k_pos = j * chunk_tokens + jnp.arange(chunk_tokens)  # [C]
        mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < ctx_len[:, None])
        if sliding_window is not None:
            mask &= q_pos[:, None] - k_pos[None, :] < sliding_window
        s = jnp.where(mask[:, None, None, :], s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None]) * mask[:, None, None, :]
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("tkgc,tckd->tkgd", p, v.astype(jnp.float32))
        return m_new, l, acc

    init = (
        jnp.full((num_tokens, kv_heads, group), _MASK_VALUE, jnp.float32),
        jnp.zeros((num_tokens, kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, kv_heads, group, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(first_chunk, last_chunk, body, init)
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]  # padding tokens have l == 0 -> zeros
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k: jax.Array,  # [T, kv_heads, head_dim]
    v: jax.Array,  # [T, kv_heads, head_dim]
    layer_cache: tuple[jax.Array, jax.Array],
    batch: StepInput,
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Write this step's K/V into the layer's cache, then attend. Returns (out [T, H, D], cache)."""
    k_cache, v_cache = write_kv(*layer_cache, k, v, batch.slot_mapping)
    out = ragged_paged_attention(
        q, k_cache, v_cache, batch,
        scale=scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
    )
    return out, (k_cache, v_cache)
