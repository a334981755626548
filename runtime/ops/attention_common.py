"""What every attention backend shares: the paged KV cache's writes, its quantized form, the values
read from the keys and the per-head keys and values expanded from them (latent attention), the
sliding-window and soft-cap conventions, and running a backend per shard of the KV heads.

The cache is stacked over layers ([num_layers, num_blocks, kv_heads, block_size, head_dim],
runtime.ops.step.KVCache); a write scatters just the step's new slots of one layer, indexing
(layer, block, offset) at once, so the cache is never sliced per layer nor reshaped (a reshaped
view of a scan's carry makes XLA copy it). The backends (attention_xla.py, attention_cpu.py,
attention_pallas.py) import this module; runtime/ops/attention.py picks among them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from runtime.ops.step import KVCache, StepInput

# A finite stand-in for -inf keeps exp() and max() free of NaNs on fully masked rows.
MASK_VALUE = -1e30

# A traced sliding window this wide masks nothing (any context fits): "no window" for a
# layer scanned together with sliding-window layers. Small enough that q_pos - W cannot overflow.
NO_SLIDING_WINDOW = 1 << 30

# A sliding window: a static int, a traced int32 scalar, or None.
Window = int | jax.Array | None


@dataclasses.dataclass(frozen=True)
class ScaledCache:
    """A quantized cache array and its per-token-head scales, read as float (kv_cache_dtype int8/fp8)."""

    values: jax.Array  # [num_layers, num_blocks, kv_heads, block_size, head_dim], int8 / float8
    scales: jax.Array  # [num_layers, num_blocks, kv_heads, block_size] float32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


@dataclasses.dataclass(frozen=True)
class HalfBits:
    """A bfloat16 / float16 cache array kept as its bits (runtime.ops.step.KVCache.half_bits), read
    as `dtype`: XLA gathers the uint16 blocks in place, then reinterprets the few it read."""

    bits: jax.Array  # [num_layers, num_blocks, kv_heads, block_size, head_dim] uint16
    dtype: str  # "bfloat16" or "float16"

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape

    def read(self, bits: jax.Array) -> jax.Array:
        """Gathered uint16 bits -> float32 values."""
        return jax.lax.bitcast_convert_type(bits, jnp.dtype(self.dtype)).astype(jnp.float32)


def stored_dtype(cache: KVCache) -> jnp.dtype:
    """The dtype a cache holds its K/V in: the 16-bit float of one kept as bits, else its arrays'."""
    return jnp.dtype(cache.half_bits) if cache.half_bits else cache.k.dtype


def readable(cache: KVCache, array: jax.Array) -> jax.Array | HalfBits:
    """One of the cache's arrays as the XLA path reads it (HalfBits for a cache kept as bits)."""
    return HalfBits(array, cache.half_bits) if cache.half_bits else array


@dataclasses.dataclass(frozen=True)
class ValuesInKeys:
    """The values of a cache that keeps them in its keys (multi-head latent attention, where
    runtime.ops.step.KVCacheSpec.value_dims is set): the first `dims` dims of each key."""

    keys: jax.Array | ScaledCache  # [num_layers, num_blocks, kv_heads, block_size, head_dim]
    dims: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.keys.shape[:-1], self.dims)


@dataclasses.dataclass(frozen=True)
class ExpandedLatent:
    """Per-head keys or values made from a cache of latents as its blocks are read (multi-head
    latent attention's expanded form): keys [c W_UK_h, k_rope], values c W_UV_h, where c is each
    cached token's first `rank` dims and k_rope the rest (one rotary key shared by every head).
    The cache keeps the latent; a read gathers the latent blocks and expands them per head."""

    latent: jax.Array | ScaledCache  # [num_layers, num_blocks, 1, block_size, rank + rope]
    weight: jax.Array  # [rank, heads, dims]: W_UK (keys) or W_UV (values)
    with_rope: bool  # keys: the rotary part follows each head's dims

    @property
    def rank(self) -> int:
        return self.weight.shape[0]

    @property
    def shape(self) -> tuple[int, ...]:
        layers, blocks, _, block_size, dims = self.latent.shape
        rope = dims - self.rank if self.with_rope else 0
        return (layers, blocks, self.weight.shape[1], block_size, self.weight.shape[2] + rope)

    def expand(self, x: jax.Array, heads_axis: int) -> jax.Array:
        """Latent blocks x (float32, a KV-head axis of size 1 at `heads_axis`, tokens' dims last)
        -> the same with that axis the heads', each token's dims expanded for its head."""
        x = jnp.moveaxis(x, heads_axis, -3)[..., 0, :, :]  # [..., block_size, rank + rope]
        out = jnp.einsum("...cr,rhn->...hcn", x[..., :self.rank], self.weight.astype(jnp.float32))
        if self.with_rope:
            rope = x[..., None, :, self.rank:]
            out = jnp.concatenate([out, jnp.broadcast_to(rope, (*out.shape[:-1], rope.shape[-1]))], axis=-1)
        return jnp.moveaxis(out, -3, heads_axis)


# Largest magnitude each quantized cache dtype holds (a token-head's largest |value| maps to it).
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [T, kv_heads, head_dim] -> (stored values, float32 scales [T, kv_heads]), one scale per
    token and head (its largest |value| / the dtype's largest)."""
    qmax = _QMAX[jnp.dtype(dtype)]
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax == 0, 1.0, amax / qmax)
    scaled = xf / scale[..., None]
    if jnp.issubdtype(jnp.dtype(dtype), jnp.integer):
        scaled = jnp.clip(jnp.round(scaled), -qmax, qmax)
    return scaled.astype(dtype), scale


def as_stored(x: jax.Array, dtype) -> jax.Array:
    """x [T, kv_heads, head_dim] as a cache of quantized `dtype` gives it back (quantized, then
    scaled; float32): what a step's own tokens attend with, so that a token's attention is the
    same whether its context was written by this step or an earlier one (chunked prefill,
    prefix-cache hits) and on every backend (the C++ kernel reads the step's tokens back from
    the cache)."""
    values, scale = quantize_kv(x, dtype)
    return values.astype(jnp.float32) * scale[..., None]


def write_kv_quantized(cache: KVCache, k: jax.Array, v: jax.Array | None, slot_mapping: jax.Array,
                       layer: int | jax.Array) -> KVCache:
    """write_kv for a quantized cache: values and their per-token-head scales, in place (v None:
    the keys alone, for a cache that keeps the values in them)."""
    out = {}
    for name, new in (("k", k), ("v", v)) if v is not None else (("k", k),):
        values, scales = quantize_kv(new, getattr(cache, name).dtype)
        out[name] = _put(getattr(cache, name), values, layer, slot_mapping)
        out[name + "_scale"] = _put(getattr(cache, name + "_scale"), scales, layer, slot_mapping)
    return dataclasses.replace(cache, **out)


def write_kv(
    k_cache: jax.Array,  # [num_blocks, kv_heads, block_size, head_dim], or stacked [num_layers, ...]
    v_cache: jax.Array,  # the same
    k: jax.Array,  # [T, kv_heads, head_dim]
    v: jax.Array | None,  # [T, kv_heads, head_dim]; None: the values are in the keys (v_cache is left as it is)
    slot_mapping: jax.Array,  # [T] int32, negative for padding tokens
    layer: int | jax.Array | None = None,  # which layer of a stacked cache (None: one layer's cache)
    *,
    half_bits: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter the new K/V of each token into its cache slot; padding tokens write nowhere.

    A stacked cache is updated in place at `layer` (a scatter of T rows, under jit with
    the cache donated or carried through a scan). half_bits: the caches hold the bits of this
    16-bit float as uint16 (KVCache.half_bits); the new K/V are rounded to it.
    """
    if layer is None:
        k_cache, v_cache = write_kv(k_cache[None], v_cache[None], k, v, slot_mapping, 0, half_bits=half_bits)
        return k_cache[0], v_cache[0]
    if half_bits:
        bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.dtype(half_bits)), k_cache.dtype)  # noqa: E731
        k, v = bits(k), None if v is None else bits(v)
    return _put(k_cache, k, layer, slot_mapping), v_cache if v is None else _put(v_cache, v, layer, slot_mapping)


def _put(cache: jax.Array, new: jax.Array, layer: int | jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """A stacked cache [num_layers, num_blocks, kv_heads, block_size, ...] with `new` [T, kv_heads,
    ...] at each token's slot of `layer`; padding tokens (negative slots) write nowhere."""
    num_blocks, block_size = cache.shape[1], cache.shape[3]
    new = new.astype(cache.dtype)
    if new.shape[0] == 1:
        # One token (a lone decode): a dynamic-update-slice at scalar indices. A scatter's index
        # rows would differ per layer, and XLA:CPU computes and bounds-checks each layer's in
        # small programs of their own at the step's start (~0.2 ms a step on the demo model).
        slot = slot_mapping[0]
        real = (slot >= 0) & (slot < num_blocks * block_size)
        at = jnp.where(real, slot, 0)
        start = (jnp.asarray(layer, jnp.int32), at // block_size, jnp.int32(0), at % block_size,
                 *(jnp.int32(0),) * (cache.ndim - 4))
        update = new.reshape(1, 1, new.shape[1], 1, *new.shape[2:])
        old = jax.lax.dynamic_slice(cache, start, update.shape)
        return jax.lax.dynamic_update_slice(cache, jnp.where(real, update, old), start)
    # Out-of-range indices are dropped by the scatter; negative ones would wrap around.
    blocks = jnp.where(slot_mapping < 0, num_blocks, slot_mapping // block_size)  # [T]
    offsets = slot_mapping % block_size  # [T]
    # (layer, block, :, offset) indexes [T, kv_heads, ...]: the advanced indices, split by the
    # heads' slice, put the token axis first, as `new` has it.
    return cache.at[layer, blocks, :, offsets].set(new, mode="drop")


def soft_cap(s: jax.Array, cap: float | None) -> jax.Array:
    """Scores capped as cap * tanh(s / cap) (Gemma 2), or as they are with cap None."""
    return s if cap is None else cap * jnp.tanh(s / cap)


def per_kv_head_shard(attend, q, k_cache, v_cache, layer, window, batch: StepInput, *, mesh, cache_spec,
                      kernel: str) -> jax.Array:
    """attend(q, k_cache, v_cache, layer, window, batch) -> out [T, H, D], run per shard of the
    KV cache's heads (shard_map) on a mesh of several devices, or as it is on one.

    Each device attends with its own KV heads and the query heads that read them; the layer,
    window and batch are replicated. `kernel` names the caller in the error for a cache
    sharded along any other axis.
    """
    layer, window = jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)
    if mesh is None or mesh.size == 1:
        return attend(q, k_cache, v_cache, layer, window, batch)
    spec = tuple(cache_spec or ()) + (None,) * (5 - len(tuple(cache_spec or ())))
    if any(axis is not None for i, axis in enumerate(spec) if i != 2):
        raise NotImplementedError(f"the {kernel} shards the KV cache by heads only, not {cache_spec}")
    heads = jax.sharding.PartitionSpec(None, spec[2], None)  # q and out: query heads split as their KV heads are
    replicated = jax.sharding.PartitionSpec()
    cache = jax.sharding.PartitionSpec(*spec)
    return jax.shard_map(
        attend, mesh=mesh, check_vma=False,
        in_specs=(heads, cache, cache, replicated, replicated, jax.tree.map(lambda _: replicated, batch)),
        out_specs=heads,
    )(q, k_cache, v_cache, layer, window, batch)
