"""Reading the paged KV cache in whole blocks: the gathers of pure-JAX attention (attention_xla.py).

A read gathers just the blocks it needs, indexing (layer, block) at once, never copying a
layer's whole cache; the cache forms of attention_common.py (quantized with scales, 16-bit
floats kept as bits, values kept in the keys, an expanded latent) are undone as the blocks are
read. Tables are walked in chunks of whole blocks, and a sliding window lets a read start at the
first chunk a query can see.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from runtime.ops.attention_common import ExpandedLatent, HalfBits, ScaledCache, ValuesInKeys, Window


def read_blocks(
    cache: jax.Array | ScaledCache | HalfBits,  # [num_layers, num_blocks, kv_heads, block_size, head_dim]
    layer: int | jax.Array,
    blocks: jax.Array,  # [...] int32, block ids of `layer`
) -> jax.Array:  # [..., kv_heads, block_size, head_dim], float32
    """One gather of the given blocks of one layer (no copy of the layer's whole cache);
    a quantized cache is dequantized as it is read, values in the keys are the keys' first dims,
    an expanded latent is expanded per head."""
    if isinstance(cache, ExpandedLatent):  # the same gather for keys and values, then two expansions
        return cache.expand(read_blocks(cache.latent, layer, blocks), heads_axis=-3)
    if isinstance(cache, ValuesInKeys):  # the same gather as the keys' (XLA reads the blocks once)
        return read_blocks(cache.keys, layer, blocks)[..., :cache.dims]
    if isinstance(cache, ScaledCache):
        return cache.values[layer, blocks].astype(jnp.float32) * cache.scales[layer, blocks][..., None]
    if isinstance(cache, HalfBits):
        return cache.read(cache.bits[layer, blocks])
    return cache[layer, blocks].astype(jnp.float32)


def read_blocks_heads_major(
    cache: jax.Array | ScaledCache | HalfBits,  # [num_layers, num_blocks, kv_heads, block_size, head_dim]
    layer: int | jax.Array,
    blocks: jax.Array,  # [chunk] int32, block ids of `layer`
) -> jax.Array:  # [kv_heads, chunk, block_size, head_dim], float32
    """`read_blocks` of one sequence's blocks, gathered with the KV head leading (the batch
    axis of the dots that consume them), so no transpose follows the gather."""
    if isinstance(cache, ExpandedLatent):
        return cache.expand(read_blocks_heads_major(cache.latent, layer, blocks), heads_axis=0)
    if isinstance(cache, ValuesInKeys):
        return read_blocks_heads_major(cache.keys, layer, blocks)[..., :cache.dims]
    idx = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), blocks.shape), blocks], axis=-1)
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(0, 2, 3), collapsed_slice_dims=(0, 1), start_index_map=(0, 1))

    def gather(x: jax.Array) -> jax.Array:
        return jax.lax.gather(x, idx, dims, slice_sizes=(1, 1, *x.shape[2:]), mode="clip")

    if isinstance(cache, ScaledCache):
        return gather(cache.values).astype(jnp.float32) * gather(cache.scales[..., None])
    if isinstance(cache, HalfBits):
        return cache.read(gather(cache.bits))
    return gather(cache).astype(jnp.float32)


def chunked_tables(tables: jax.Array, chunk: int, block_size: int) -> tuple[jax.Array, int, int]:
    """Tables padded to whole chunks of blocks (padded entries are masked by the context
    length); returns (tables, blocks per chunk, tokens per chunk)."""
    max_blocks = tables.shape[1]
    chunk = min(chunk, max_blocks)
    padded = -(-max_blocks // chunk) * chunk
    return jnp.pad(tables, ((0, 0), (0, padded - max_blocks))), chunk, chunk * block_size


def first_visible_chunk(q_pos: jax.Array, active: jax.Array, sliding_window: Window,
                        chunk_tokens: int, last: jax.Array) -> jax.Array:
    """The first context chunk any active query can see through its sliding window."""
    if sliding_window is None:
        return jnp.int32(0)
    lowest = jnp.where(active, q_pos - sliding_window + 1, jnp.iinfo(jnp.int32).max)
    return jnp.minimum(jnp.maximum(jnp.min(lowest), 0) // chunk_tokens, last)
