"""Ragged paged attention in pure JAX (the `attention_backend="xla"` path; what runs on GPU).

One call serves a batch that mixes whole prefills, chunks of prefills that start
mid-sequence, and single-token decodes, over one layer of the paged cache
(runtime/ops/attention_common.py), each sequence reaching its blocks through its row of
`block_tables`. A read gathers just the blocks it needs (attention_blocks.py).

`xla_paged_attention` (paged_attention's XLA path) splits each token's context in two and
merges the halves with an online softmax (flash-attention style):

- the *cached* context, written by earlier steps: a loop over the paged cache in chunks
  of whole blocks, gathering each token's blocks through its sequence's table. Only
  decodes and continued prefill chunks have any; a fresh prompt skips this part.
- the step's *own new tokens*: dense, tiled attention on the K/V just computed, masked to
  the same sequence, causal by position and by the sliding window. Prefills cost
  matmuls here instead of one gather per query token.

The live memory is bounded by tokens x chunk (cache part) and tile x tile (new part),
and the work by real tokens x the longest context, never padded batch x max_model_len.
It is jittable on every backend; on CPU it serves what the C++ kernel does not (quantized or
bfloat16 caches, attention sinks, values kept in the keys, a machine where the kernel cannot be built).

The sliding window may be a traced int32 (layers with different windows under one scan),
with NO_SLIDING_WINDOW for a layer without one; None (static) leaves the mask out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from runtime.ops.attention_blocks import chunked_tables, first_visible_chunk, read_blocks, read_blocks_heads_major
from runtime.ops.attention_common import ExpandedLatent, MASK_VALUE, ScaledCache, ValuesInKeys, Window, soft_cap
from runtime.ops.step import StepInput

# Query/key tile of the dense new-token part: scores live as tile x tile per head. Smaller
# tiles waste less on causal and cross-sequence masking; larger ones make fewer, bigger dots
# (tile sizes measured in benchmarks/RESULTS.md).
NEW_TOKEN_TILE = 64
CACHED_TILE, CACHED_CHUNK_TOKENS = 64, 128  # query tile, context tokens of the per-sequence cached read
DECODE_CHUNK_TOKENS = 32  # context tokens a step of the per-token (decode) read: XLA:CPU favours short

_State = tuple[jax.Array, jax.Array, jax.Array]  # (running max, denominator, numerator) per query token and head


def _empty_state(num_tokens: int, kv_heads: int, group: int, head_dim: int) -> _State:
    return (
        jnp.full((num_tokens, kv_heads, group), MASK_VALUE, jnp.float32),
        jnp.zeros((num_tokens, kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, kv_heads, group, head_dim), jnp.float32),
    )


def _online_update(state: _State, s: jax.Array, mask: jax.Array, pv) -> _State:
    """Fold one block of scores s [t, kvh, g, c] (mask broadcastable) into the state.

    `pv(p)` contracts probabilities p [t, kvh, g, c] with the block's values.
    """
    m, l, acc = state
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None]) * mask
    correction = jnp.exp(m - m_new)
    l = l * correction + p.sum(axis=-1)
    acc = acc * correction[..., None] + pv(p)
    return m_new, l, acc


def _finish(state: _State, num_heads: int, dtype, sinks: jax.Array | None = None) -> jax.Array:
    """The attention output [T, H, D] of the folded state. `sinks` [H]: a logit per head that
    joins every softmax's denominator and contributes no value (gpt-oss's attention sinks)."""
    m, l, acc = state
    if sinks is not None:  # no context: m is -1e30, the term inf, the output 0
        l = l + jnp.exp(sinks.astype(jnp.float32).reshape(l.shape[1:])[None] - m)
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]  # tokens with no context -> zeros
    return out.reshape(out.shape[0], num_heads, out.shape[-1]).astype(dtype)


def _pad_to_tile(x: jax.Array, tile: int, value=0) -> jax.Array:
    """Pad axis 0 up to a multiple of `tile` (buckets need not be powers of two)."""
    extra = -x.shape[0] % tile
    if extra == 0:
        return x
    return jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def _tiles_heads_major(x: jax.Array, tile: int, value=0) -> jax.Array:
    """[T, kvh, ...] -> [num_tiles, kvh, tile, ...], padded to whole tiles with `value`."""
    x = _pad_to_tile(x, tile, value)
    return jnp.moveaxis(x.reshape(-1, tile, *x.shape[1:]), 2, 1)


def _tokens_from_tiles(x: jax.Array, num_tokens: int) -> jax.Array:
    """[num_tiles, kvh, tile, ...] -> [T, kvh, ...], the inverse of `_tiles_heads_major`."""
    return jnp.moveaxis(x, 1, 2).reshape(-1, x.shape[1], *x.shape[3:])[:num_tokens]


def _token_layout(batch: StepInput, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(sequence slot of each token [T], whether the token is real [T])."""
    num_seqs = batch.block_tables.shape[0]
    tok = jnp.arange(num_tokens)
    seq_of_token = jnp.searchsorted(batch.query_start_loc[1:], tok, side="right")
    return jnp.minimum(seq_of_token, num_seqs - 1), tok < batch.num_tokens


def _paged_context(
    qg: jax.Array,  # [T, kvh, g, d], float32, scaled
    k_cache: jax.Array,  # [num_layers, num_blocks, kvh, block_size, d]
    v_cache: jax.Array,
    layer: int | jax.Array,
    tables: jax.Array,  # [T, max_blocks], each token's sequence's block table
    q_pos: jax.Array,  # [T]
    ctx_len: jax.Array,  # [T], attend to cache positions < ctx_len (0 for none)
    state: _State,
    *,
    chunk: int,
    sliding_window: Window,
    logit_soft_cap: float | None,
) -> _State:
    """Fold each token's context from the paged cache into its softmax state."""
    num_tokens, kv_heads, group, head_dim = qg.shape
    block_size = k_cache.shape[3]
    tables, chunk, chunk_tokens = chunked_tables(tables, chunk, block_size)
    # Only visit the chunks some token needs.
    last_chunk = (jnp.max(ctx_len) + chunk_tokens - 1) // chunk_tokens
    first_chunk = first_visible_chunk(q_pos, ctx_len > 0, sliding_window, chunk_tokens, last_chunk)

    def body(j, state):
        blocks = jax.lax.dynamic_slice_in_dim(tables, j * chunk, chunk, axis=1)  # [T, chunk]
        k = read_blocks(k_cache, layer, blocks)  # [T, chunk, kvh, block_size, d]
        v = read_blocks(v_cache, layer, blocks)
        s = jnp.einsum("tkgd,tbkcd->tkgbc", qg, k).reshape(num_tokens, kv_heads, group, chunk_tokens)
        s = soft_cap(s, logit_soft_cap)
        k_pos = j * chunk_tokens + jnp.arange(chunk_tokens)  # [C]
        mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < ctx_len[:, None])
        if sliding_window is not None:
            mask &= q_pos[:, None] - k_pos[None, :] < sliding_window
        pv = lambda p: jnp.einsum(
            "tkgbc,tbkcd->tkgd", p.reshape(num_tokens, kv_heads, group, chunk, block_size), v
        )
        return _online_update(state, s, mask[:, None, None, :], pv)

    return jax.lax.fori_loop(first_chunk, last_chunk, body, state)


def _paged_context_by_sequence(
    qg: jax.Array,  # [T, kvh, g, d], float32, scaled
    k_cache: jax.Array,  # [num_layers, num_blocks, kvh, block_size, d]
    v_cache: jax.Array,
    layer: int | jax.Array,
    block_tables: jax.Array,  # [S, max_blocks]
    seq_of_token: jax.Array,  # [T]
    q_pos: jax.Array,  # [T]
    ctx_len: jax.Array,  # [T], attend to cache positions < ctx_len (0 for none)
    seq_ctx_len: jax.Array,  # [S], the same per sequence
    first_token: int,  # tokens before this one are left alone
    state: _State,
    *,
    tile: int,
    chunk: int,
    sliding_window: Window,
    logit_soft_cap: float | None,
) -> _State:
    """The paged context of multi-token sequences, read once per sequence, not per token.

    Query tokens go in tiles; for each sequence a tile touches, its cached context is
    gathered a chunk of blocks at a time and attended by the whole tile as one matmul
    (masked to that sequence's tokens). For a continued prefill chunk or a prompt with a
    prefix-cache hit this reads the context once per tile instead of once per token.
    Heads-major inside, like `_new_token_context`, for the same reason.
    """
    num_tokens, kv_heads, group, head_dim = qg.shape
    block_size = k_cache.shape[3]
    tables, chunk, chunk_tokens = chunked_tables(block_tables, chunk, block_size)
    wanted = (jnp.arange(num_tokens) >= first_token) & (ctx_len > 0)
    t_seq = jnp.where(wanted, seq_of_token, -1)
    num_tiles = -(-num_tokens // tile)
    tiled = lambda x, value=0: _pad_to_tile(x, tile, value).reshape(num_tiles, tile, *x.shape[1:])
    heads_major = lambda x: _tiles_heads_major(x, tile)
    xs = (heads_major(qg), tiled(t_seq, -1), tiled(q_pos), tiled(ctx_len), jax.tree.map(heads_major, state))

    def one_tile(args):
        q, seqs, pos, ctx, st = args
        lo = jnp.min(jnp.where(seqs >= 0, seqs, jnp.iinfo(jnp.int32).max))
        hi = jnp.max(seqs) + 1  # no wanted token: lo = max int, hi = 0 -> no trips

        def per_sequence(s, st):
            last = (seq_ctx_len[s] + chunk_tokens - 1) // chunk_tokens
            first = first_visible_chunk(pos, seqs == s, sliding_window, chunk_tokens, last)

            def per_chunk(j, st):
                blocks = jax.lax.dynamic_slice_in_dim(tables[s], j * chunk, chunk)
                k = read_blocks_heads_major(k_cache, layer, blocks)  # [kvh, chunk, block_size, d]
                v = read_blocks_heads_major(v_cache, layer, blocks)
                sc = jnp.einsum("ktgd,kbcd->ktgbc", q, k).reshape(*q.shape[:3], chunk_tokens)
                sc = soft_cap(sc, logit_soft_cap)
                k_pos = j * chunk_tokens + jnp.arange(chunk_tokens)
                mask = (seqs[:, None] == s) & (k_pos[None, :] < ctx[:, None])
                if sliding_window is not None:
                    mask &= pos[:, None] - k_pos[None, :] < sliding_window
                pv = lambda p: jnp.einsum("ktgbc,kbcd->ktgd", p.reshape(*p.shape[:3], chunk, block_size), v)
                return _online_update(st, sc, mask[None, :, None, :], pv)

            return jax.lax.fori_loop(first, last, per_chunk, st)

        return jax.lax.fori_loop(lo, jnp.maximum(lo, hi), per_sequence, st)

    out = jax.lax.map(one_tile, xs)
    return jax.tree.map(lambda x: _tokens_from_tiles(x, num_tokens), out)


def _new_token_context(
    qg: jax.Array,  # [T, kvh, g, d], float32, scaled
    k: jax.Array,  # [T, kvh, d], this step's keys
    v: jax.Array,  # [T, kvh, d]
    seq_of_token: jax.Array,  # [T]
    q_pos: jax.Array,  # [T]
    is_real: jax.Array,  # [T]
    seq_start: jax.Array,  # [T], index of the first token of each token's sequence
    state: _State,
    *,
    tile: int,
    sliding_window: Window,
    logit_soft_cap: float | None,
) -> _State:
    """Fold attention over the step's own tokens (same sequence, causal) into the state.

    Tokens are tiled by `tile`; a query tile only visits the key tiles from its first
    token's sequence start up to itself, so long ragged batches stay near-causal in cost.
    The work runs heads-major ([kvh, T, ...]): the KV head is then the leading batch axis
    of every tile's dots, which XLA:CPU runs without transposing operands per tile (a
    token-major layout transposes them in every tile).
    """
    num_tokens = qg.shape[0]
    tile = min(tile, num_tokens)
    num_tiles = -(-num_tokens // tile)
    # Pad to whole tiles with tokens that are not real (they attend to and feed nothing).
    pad = lambda x, value=0: _pad_to_tile(x, tile, value)
    heads_major = lambda x: jnp.moveaxis(pad(x), 1, 0)  # [T, kvh, ...] -> [kvh, T', ...]
    q, k, v = heads_major(qg), heads_major(k.astype(jnp.float32)), heads_major(v.astype(jnp.float32))
    q_pos, seq_start, seq_of_token, is_real = pad(q_pos), pad(seq_start), pad(seq_of_token, -1), pad(is_real, False)
    tiled_state = jax.tree.map(lambda x: _tiles_heads_major(x, tile), state)  # [num_tiles, kvh, tile, ...]
    token_window = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * tile, tile)
    head_window = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * tile, tile, axis=1)

    def fold(st, qq, qs, qp, qr, kk, vv, ks, kp, kr):
        """Fold keys kk/vv [kvh, tile, d] (sequence ks, position kp, real kr) into queries qq's state."""
        sc = soft_cap(jnp.einsum("ktgd,kud->ktgu", qq, kk), logit_soft_cap)
        mask = (qs[:, None] == ks[None, :]) & (kp[None, :] <= qp[:, None]) & qr[:, None] & kr[None, :]
        if sliding_window is not None:
            mask &= qp[:, None] - kp[None, :] < sliding_window
        pv = lambda p: jnp.einsum("ktgu,kud->ktgd", p, vv)
        return _online_update(st, sc, mask[None, :, None, :], pv)

    if num_tiles == 1:  # decode-sized steps: one fold, no loop
        tokens = (seq_of_token, q_pos, is_real)
        out = fold(jax.tree.map(lambda x: x[0], tiled_state), q, *tokens, k, v, *tokens)
        return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1)[:num_tokens], out)

    def one_query_tile(args):
        i, st = args
        qq = head_window(q, i)  # [kvh, tile, g, d]
        qs, qp, qr = (token_window(x, i) for x in (seq_of_token, q_pos, is_real))
        # Key tiles from the start of the tile's first sequence up to the tile itself.
        lo = seq_start[i * tile] // tile
        hi = jnp.where(is_real[i * tile], i + 1, lo)  # a tile of padding attends to nothing

        def body(j, st):
            keys = (head_window(k, j), head_window(v, j), *(token_window(x, j) for x in (seq_of_token, q_pos, is_real)))
            return fold(st, qq, qs, qp, qr, *keys)

        return jax.lax.fori_loop(lo, hi, body, st)

    out = jax.lax.map(one_query_tile, (jnp.arange(num_tiles), tiled_state))
    return jax.tree.map(lambda x: _tokens_from_tiles(x, num_tokens), out)


def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_cache: jax.Array,  # [num_blocks, kv_heads, block_size, head_dim]
    v_cache: jax.Array,  # [num_blocks, kv_heads, block_size, head_dim]
    batch: StepInput,
    *,
    scale: float,
    sliding_window: Window = None,
    logit_soft_cap: float | None = None,
    kv_chunk_blocks: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:  # [T, num_heads, head_dim], dtype of q
    """Causal attention of each token over its own sequence's context, all read from the cache.

    The cache must already hold this step's K/V (see attention_common.write_kv). Token t of sequence s
    attends to positions p with p <= positions[t], p < seq_lens[s] and, with a sliding
    window W, positions[t] - p < W (transformers' convention). Grouped-query attention:
    num_heads must be a multiple of kv_heads; query head h reads kv head h // group.

    `xla_paged_attention` computes the same with the step's own tokens taken densely; this
    all-cache form is its reference and suits steps that are nearly all decodes.

    Args:
        scale: multiplier of q.k (usually head_dim ** -0.5).
        sliding_window: attend only to the last W positions (an int or a traced int32,
            NO_SLIDING_WINDOW for none), or None.
        logit_soft_cap: if set, scores become cap * tanh(scores / cap) (Gemma 2).
        kv_chunk_blocks: blocks processed per loop iteration (default: DECODE_CHUNK_TOKENS
            tokens' worth: XLA:CPU's per-token batched dots favour short chunks).
        sinks: [num_heads] attention-sink logits (gpt-oss), or None.
    """
    q, k_cache, v_cache = jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache)
    batch = jax.tree.map(jnp.asarray, batch)
    num_tokens, num_heads, head_dim = q.shape
    _, kv_heads, block_size, _ = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of kv_heads={kv_heads}")
    group = num_heads // kv_heads
    seq_of_token, is_real = _token_layout(batch, num_tokens)
    ctx_len = jnp.where(is_real, batch.seq_lens[seq_of_token], 0)
    qg = (q.astype(jnp.float32) * scale).reshape(num_tokens, kv_heads, group, head_dim)
    state = _paged_context(
        qg, k_cache[None], v_cache[None], 0, batch.block_tables[seq_of_token], batch.positions, ctx_len,
        _empty_state(num_tokens, kv_heads, group, head_dim),
        chunk=kv_chunk_blocks or max(1, DECODE_CHUNK_TOKENS // block_size),
        sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
    )
    return _finish(state, num_heads, q.dtype, sinks)


def xla_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k: jax.Array,  # [T, kv_heads, head_dim], this step's keys (already written to the cache)
    v: jax.Array,  # [T, kv_heads, head_dim]
    k_cache: jax.Array | ScaledCache | ExpandedLatent,  # [num_layers, num_blocks, kv_heads, block_size, head_dim]
    v_cache: jax.Array | ScaledCache | ValuesInKeys | ExpandedLatent,  # the same, or made from the keys (MLA)
    layer: int | jax.Array,
    batch: StepInput,
    *,
    scale: float,
    sliding_window: Window = None,
    logit_soft_cap: float | None = None,
    kv_chunk_blocks: int | None = None,
    new_token_tile: int = NEW_TOKEN_TILE,
    cached_tile: int = CACHED_TILE,
    cached_chunk_tokens: int = CACHED_CHUNK_TOKENS,
    sinks: jax.Array | None = None,
    first_token: int = 0,
) -> jax.Array:  # [T, num_heads, v's head_dim], dtype of q
    """`ragged_paged_attention` with the step's own tokens attended densely from k/v; only the
    context cached by earlier steps is read through the block tables (paged_attention's XLA path).

    The cached context is read two ways. The first S tokens (S = padded sequence slots;
    the scheduler puts running decodes first) read it per token, as decodes must. Tokens
    after them (continued prefill chunks, prompts with a prefix-cache hit) read it per
    sequence and query tile, so a long chunk gathers its context once per tile rather
    than once per token. Fresh prompts have no cached context and skip both.

    Args:
        new_token_tile / cached_tile: query tiles of the dense new-token part and of the
            per-sequence cached part.
        cached_chunk_tokens: context tokens gathered per iteration of the per-sequence part.
        first_token: tokens before this one read no cached context (their rows of the output
            are not meaningful): latent attention's expanded form attends only the tokens after
            the decodes, whose context it would otherwise expand per token.

    Raises:
        ValueError: heads that do not group over the KV heads.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    num_tokens, num_heads, head_dim = q.shape
    _, _, kv_heads, block_size, _ = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of kv_heads={kv_heads}")
    group = num_heads // kv_heads
    seq_of_token, is_real = _token_layout(batch, num_tokens)
    query_len = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
    seq_cached_len = batch.seq_lens - query_len  # [S], context written by earlier steps
    cached_len = jnp.where(is_real, seq_cached_len[seq_of_token], 0)  # [T]
    seq_start = batch.query_start_loc[seq_of_token]
    q_pos = batch.positions[:num_tokens]  # q may hold only the step's first tokens
    qg = (q.astype(jnp.float32) * scale).reshape(num_tokens, kv_heads, group, head_dim)
    empty = _empty_state(num_tokens, kv_heads, group, v.shape[-1])
    chunk = kv_chunk_blocks or max(1, DECODE_CHUNK_TOKENS // block_size)

    # Decodes (and whatever else is among the first S tokens): per token.
    head = max(min(batch.block_tables.shape[0], num_tokens), first_token)
    state = empty
    if first_token < head:
        part = slice(first_token, head)
        state = _paged_context(
            qg[part], k_cache, v_cache, layer, batch.block_tables[seq_of_token[part]], q_pos[part],
            cached_len[part], jax.tree.map(lambda x: x[part], empty),
            chunk=chunk, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
        )
        state = jax.tree.map(lambda a, e: jnp.concatenate([e[:first_token], a, e[head:]]), state, empty)
    # Multi-token sequences with cached context beyond them: per sequence and query tile.
    if head < num_tokens:
        state = _paged_context_by_sequence(
            qg, k_cache, v_cache, layer, batch.block_tables, seq_of_token, q_pos, cached_len,
            seq_cached_len, head, state,
            tile=min(cached_tile, num_tokens), chunk=max(1, cached_chunk_tokens // block_size),
            sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
        )
    state = _new_token_context(
        qg, k, v, seq_of_token, q_pos, is_real, seq_start, state,
        tile=new_token_tile, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
    )
    return _finish(state, num_heads, q.dtype, sinks)
