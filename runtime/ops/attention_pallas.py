"""Ragged paged attention as a Pallas kernel (the `attention_backend="pallas"` path).

Same contract as `runtime.ops.attention_xla.ragged_paged_attention`: the cache already holds this
step's K/V (see `attention_common.write_kv`), and each token attends causally over its own
sequence's context, read through its block table. The KV layout is the XLA path's,
[num_layers, num_blocks, kv_heads, block_size, head_dim] per K and V: the kernel reads a
block of one head as one contiguous [block_size, head_dim] copy, so the backends share the
cache and nothing is converted per step.

Work split. The step's tokens are ragged (whole prompts, chunks, single decodes), so the
grid is over *query tiles of one sequence*: each sequence's tokens are cut into tiles of
`query_tile` tokens, and program (i, h) computes tile i for KV head h and the `group`
query heads that read it (GQA), as a [query_tile * group, head_dim] block of queries.
A tile walks its sequence's pages up to its last token's position (from the first
position its sliding window can see), copying each page of K and V from the cache into
local memory (double-buffered: the next page's copy runs while this one is attended) and
folding it into an online softmax (flash-attention style). Tiles never straddle two
sequences, so the kernel needs no per-token block tables and each page is read once per
tile. The tile -> (sequence, first token) map and the gather of the tiles' rows back into
token order are plain XLA ops around the kernel.

The kernel is written against Pallas' TPU model (scalar prefetch of the tables into SMEM,
the cache left in HBM and read by async copies). On CPU it runs in Pallas' TPU interpret
mode (`interpret=True` by default there): slow, for tests, and the way the kernel is
checked against the NumPy oracle and the XLA path on a machine without an accelerator.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec

from runtime.ops.attention_common import MASK_VALUE, NO_SLIDING_WINDOW, per_kv_head_shard
from runtime.ops.step import StepInput

# Query tokens per program. A decode fills one row of a tile, a prefill whole tiles.
QUERY_TILE = 8


def _kernel(
    # scalar prefetch (SMEM)
    layer_ref, window_ref, tables_ref, seq_lens_ref, qsl_ref, prog_seq_ref, prog_q0_ref, num_progs_ref,
    # inputs (HBM) and output block
    q_hbm, k_hbm, v_hbm, out_ref,
    # scratch
    q_buf, k_buf, v_buf, sems,
    *, scale: float, group: int, query_tile: int, block_size: int, soft_cap: float | None,
):
    i, h = pl.program_id(0), pl.program_id(1)

    @pl.when(i < num_progs_ref[0])
    def _():
        seq, q0 = prog_seq_ref[i], prog_q0_ref[i]
        q_end, ctx = qsl_ref[seq + 1], seq_lens_ref[seq]
        rows = query_tile * group
        q_copy = pltpu.make_async_copy(q_hbm.at[h, pl.ds(q0 * group, rows)], q_buf, sems.at[0])
        q_copy.start()
        # Position of the tile's first token and of its last real one.
        first_pos = ctx - q_end + q0
        last_pos = ctx - q_end + jnp.minimum(q_end, q0 + query_tile) - 1
        num_pages = last_pos // block_size + 1
        window = window_ref[0]
        first_page = jnp.maximum(first_pos - window + 1, 0) // block_size

        def page_copies(page, slot):
            block = tables_ref[seq, page]
            return (pltpu.make_async_copy(k_hbm.at[layer_ref[0], block, h], k_buf.at[slot], sems.at[1 + slot]),
                    pltpu.make_async_copy(v_hbm.at[layer_ref[0], block, h], v_buf.at[slot], sems.at[3 + slot]))

        for c in page_copies(first_page, 0):
            c.start()
        q_copy.wait()
        q = q_buf[...].astype(jnp.float32) * scale  # [rows, d]
        q_pos = first_pos + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group

        def body(page, carry):
            m, l, acc = carry
            slot = (page - first_page) % 2

            @pl.when(page + 1 < num_pages)
            def _():
                for c in page_copies(page + 1, 1 - slot):
                    c.start()

            for c in page_copies(page, slot):
                c.wait()
            k = k_buf[slot].astype(jnp.float32)  # [block_size, d]
            v = v_buf[slot].astype(jnp.float32)
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            k_pos = page * block_size + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
            mask = (k_pos <= q_pos) & (q_pos - k_pos < window)
            s = jnp.where(mask, s, MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            correction = jnp.exp(m - m_new)
            l = l * correction + p.sum(axis=1, keepdims=True)
            acc = acc * correction + jnp.dot(p, v, preferred_element_type=jnp.float32)
            return m_new, l, acc

        init = (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
                jnp.zeros((rows, q.shape[1]), jnp.float32))
        _, l, acc = jax.lax.fori_loop(first_page, num_pages, body, init)
        out_ref[...] = (acc / jnp.where(l == 0, 1.0, l)).astype(out_ref.dtype)


def _tile_map(batch: StepInput, num_tokens: int, query_tile: int):
    """Query tiles of single sequences: (sequence [G], first token [G], real tiles, and
    each token's (tile, row)). G = ceil(T / tile) + S bounds the tiles of any batch."""
    qsl = batch.query_start_loc
    num_seqs = qsl.shape[0] - 1
    q_len = qsl[1:] - qsl[:-1]
    tiles = (q_len + query_tile - 1) // query_tile
    end = jnp.cumsum(tiles)
    begin = end - tiles
    num_programs = -(-num_tokens // query_tile) + num_seqs
    prog = jnp.arange(num_programs, dtype=jnp.int32)
    prog_seq = jnp.minimum(jnp.searchsorted(end, prog, side="right"), num_seqs - 1).astype(jnp.int32)
    prog_q0 = (qsl[prog_seq] + (prog - begin[prog_seq]) * query_tile).astype(jnp.int32)
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of_token = jnp.minimum(jnp.searchsorted(qsl[1:], tok, side="right"), num_seqs - 1)
    within = tok - qsl[seq_of_token]
    token_prog = begin[seq_of_token] + within // query_tile
    token_row = within % query_tile
    return prog_seq, prog_q0, end[-1:].astype(jnp.int32), token_prog, token_row


def pallas_ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_cache: jax.Array,  # [num_layers, num_blocks, kv_heads, block_size, head_dim]
    v_cache: jax.Array,
    layer: int | jax.Array,
    batch: StepInput,
    *,
    scale: float,
    sliding_window: int | jax.Array | None = None,
    logit_soft_cap: float | None = None,
    query_tile: int = QUERY_TILE,
    interpret: bool | None = None,
    mesh: jax.sharding.Mesh | None = None,
    cache_spec: PartitionSpec | None = None,
) -> jax.Array:  # [T, num_heads, head_dim], dtype of q; zeros for padding tokens
    """Causal paged attention of every token over its sequence's cached context (which
    includes the step's own K/V, already written), as one Pallas kernel.

    Args:
        layer: which layer of the stacked cache (an int or a traced int32).
        sliding_window: attend only to positions with q_pos - k_pos < W (transformers'
            convention): an int, a traced int32 (NO_SLIDING_WINDOW for none), or None.
        logit_soft_cap: scores become cap * tanh(scores / cap) (Gemma 2), or None.
        query_tile: query tokens per program.
        interpret: run in Pallas' TPU interpret mode (default: on CPU only).
        mesh, cache_spec: the mesh the cache is sharded over and the cache's PartitionSpec.
            On a mesh of several devices the kernel runs per shard (shard_map): each device
            attends with its own KV heads and the query heads that read them.
    """
    batch = jax.tree.map(jnp.asarray, batch)
    window = NO_SLIDING_WINDOW if sliding_window is None else sliding_window
    attend = functools.partial(_attend, scale=scale, logit_soft_cap=logit_soft_cap, query_tile=query_tile,
                               interpret=interpret)
    return per_kv_head_shard(attend, q, k_cache, v_cache, layer, window, batch, mesh=mesh, cache_spec=cache_spec,
                             kernel="Pallas kernel")


def _attend(q, k_cache, v_cache, layer, window, batch: StepInput, *, scale: float, logit_soft_cap: float | None,
            query_tile: int, interpret: bool | None) -> jax.Array:
    """pallas_ragged_paged_attention on one device's arrays."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, kv_heads, block_size, _ = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of kv_heads={kv_heads}")
    group = num_heads // kv_heads
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    prog_seq, prog_q0, num_progs, token_prog, token_row = _tile_map(batch, num_tokens, query_tile)
    num_programs = prog_seq.shape[0]
    rows = query_tile * group
    # Queries by KV head, each head's (token, group) rows contiguous: a tile is one copy.
    # One spare tile of padding keeps the last tile's copy in bounds.
    qt = jnp.pad(q.reshape(num_tokens, kv_heads, group, head_dim), ((0, query_tile), (0, 0), (0, 0), (0, 0)))
    qt = qt.transpose(1, 0, 2, 3).reshape(kv_heads, (num_tokens + query_tile) * group, head_dim)
    kernel = functools.partial(
        _kernel, scale=scale, group=group, query_tile=query_tile, block_size=block_size, soft_cap=logit_soft_cap,
    )
    as_scalar = lambda x: jnp.reshape(jnp.asarray(x, jnp.int32), (1,))  # noqa: E731
    scalars = (as_scalar(layer), as_scalar(window), batch.block_tables, batch.seq_lens,
               batch.query_start_loc, prog_seq, prog_q0, num_progs)
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(num_programs, kv_heads),
            in_specs=[any_space, any_space, any_space],
            out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda i, h, *_: (i, h, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((rows, head_dim), q.dtype),
                pltpu.VMEM((2, block_size, head_dim), k_cache.dtype),
                pltpu.VMEM((2, block_size, head_dim), v_cache.dtype),
                pltpu.SemaphoreType.DMA((5,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((num_programs, kv_heads, rows, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="servax_ragged_paged_attention",
    )(*scalars, qt, k_cache, v_cache)
    out = out.reshape(num_programs, kv_heads, query_tile, group, head_dim)[token_prog, :, token_row]
    is_real = jnp.arange(num_tokens) < batch.num_tokens
    return jnp.where(is_real[:, None, None], out.reshape(num_tokens, num_heads, head_dim), 0).astype(q.dtype)
