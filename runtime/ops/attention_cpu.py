"""Ragged paged attention as a C++ kernel for XLA:CPU (the `attention_backend="cpu"` path).

XLA:CPU has no way to read a paged cache in place: the pure-JAX attention
(runtime/ops/attention_xla.py) gathers each token's blocks into a fresh array before its dots,
and that copy, not the arithmetic, is most of a decode step's attention there. This kernel
(runtime/ops/kernels/paged_attention.cc) reads every cached block where it lies, once per
(sequence, KV head, query tile), with an online softmax; it runs on XLA's own intra-op threads.
runtime/ops/cpu_kernels.py builds and loads it on first use; where that fails,
`kernel_status("paged_attention")` says why and attention_backend "auto" keeps the XLA path.

Float32 caches, bfloat16 / float16 ones or their bits as uint16 (how servax keeps them on CPU;
each block widened to float32 as it is read: half the bytes a step reads of its context), or int8 / float8 e4m3 ones with their scales (each block
scaled to float32 as it is read, on one device); a bfloat16 model's queries are read as float32
and its output cast back. A latent cache (values in the keys'
leading dims, DeepSeek's multi-head latent attention) is read as keys and values in place.

`cpu_rotated_paged_attention` takes a layer from its joined q/k/v product instead: it rotates q
and k, writes the step's K/V into the (float32 or 16-bit) cache in place and attends, in one call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from runtime.ops.attention_common import NO_SLIDING_WINDOW, per_kv_head_shard
from runtime.ops.cpu_kernels import PAGED_ATTENTION_TARGET, PAGED_ATTENTION_WRITE_TARGET, kernel_status
from runtime.ops.step import StepInput

NO_WINDOW = 0  # the kernel's "no sliding window"
# The cache dtypes the kernel reads without scales (runtime/engine/plan.py keeps a half model's cache so).
READS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The kernel's half_bits attribute for a uint16 cache holding each 16-bit float's bits.
HALF_BITS = {"bfloat16": 1, "float16": 2}


def cpu_ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_cache: jax.Array,  # [num_layers, num_blocks, kv_heads, block_size, head_dim], float32 / bfloat16 / float16
    v_cache: jax.Array,
    layer: int | jax.Array,
    batch: StepInput,
    *,
    scale: float,
    sliding_window: int | jax.Array | None = None,
    logit_soft_cap: float | None = None,
    mesh: jax.sharding.Mesh | None = None,
    cache_spec: PartitionSpec | None = None,
    value_dims: int | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    half_bits: str | None = None,
) -> jax.Array:  # [T, num_heads, head_dim (or value_dims)], dtype of q; zeros for padding tokens
    """Causal paged attention of every token over its sequence's cached context (which
    includes the step's own K/V, already written), read in place by the C++ kernel.

    value_dims: the values are each key's first value_dims dims (multi-head latent attention's
    cache of latents: v_cache is then the key cache itself, read twice in place).
    k_scale, v_scale: a quantized cache's (int8 or float8_e4m3fn values) float32 scales per
    token and head, [num_layers, num_blocks, kv_heads, block_size]: the kernel scales each
    block it reads into float32 (one device only).
    half_bits: the caches hold this 16-bit float's bits as uint16 ("bfloat16" / "float16";
    runtime.ops.step.KVCache.half_bits).

    Same contract as runtime.ops.attention_xla.ragged_paged_attention. On a mesh of several devices
    the kernel runs per shard (shard_map): each device attends with its own KV heads.

    Raises:
        RuntimeError: the kernel is not available (`kernel_status("paged_attention")` says why).
    """
    status = kernel_status("paged_attention")
    if status != "ok":
        raise RuntimeError(f"the CPU attention kernel is not available: {status}")
    if half_bits is not None and (k_cache.dtype != jnp.uint16 or half_bits not in HALF_BITS):
        raise ValueError(f"half_bits={half_bits!r} names the bfloat16 or float16 bits of a uint16 cache, "
                         f"not of a {k_cache.dtype} one")
    if k_scale is None and half_bits is None and k_cache.dtype not in READS:
        raise NotImplementedError(f"the CPU attention kernel reads a float32, bfloat16 or float16 cache (or a "
                                  f"quantized one with its scales), not {k_cache.dtype}")
    batch = jax.tree.map(jnp.asarray, batch)
    window = NO_WINDOW if sliding_window is None else sliding_window
    if k_scale is not None:
        if mesh is not None and mesh.size > 1:
            raise NotImplementedError("the CPU attention kernel reads a quantized cache on one device only")
        return _attend(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32), batch,
                       scale=scale, soft_cap=logit_soft_cap, value_dims=value_dims, scales=(k_scale, v_scale))
    attend = functools.partial(_attend, scale=scale, soft_cap=logit_soft_cap, value_dims=value_dims,
                               half_bits=HALF_BITS.get(half_bits, 0))
    return per_kv_head_shard(attend, q, k_cache, v_cache, layer, window, batch, mesh=mesh, cache_spec=cache_spec,
                             kernel="CPU attention kernel")


def _attend(q, k_cache, v_cache, layer, window, batch: StepInput, *, scale: float,
            soft_cap: float | None, value_dims: int | None, scales: tuple | None = None, half_bits: int = 0) -> jax.Array:
    """cpu_ragged_paged_attention on one device's arrays."""
    none = jnp.zeros((1,), jnp.float32)  # a float32 cache's scales: none
    k_scale, v_scale = scales or (none, none)
    # The XLA path's "no window" (a huge traced width) is the kernel's too.
    window = jnp.where(window >= NO_SLIDING_WINDOW, NO_WINDOW, window)
    as_scalar = lambda x: jnp.reshape(jnp.asarray(x, jnp.int32), (1,))  # noqa: E731
    out_shape = (*q.shape[:2], value_dims or q.shape[2])
    call = jax.ffi.ffi_call(PAGED_ATTENTION_TARGET, jax.ShapeDtypeStruct(out_shape, jnp.float32))
    out = call(
        q.astype(jnp.float32), k_cache, v_cache, k_scale, v_scale, as_scalar(layer),
        batch.block_tables.astype(jnp.int32),
        batch.seq_lens.astype(jnp.int32), batch.query_start_loc.astype(jnp.int32),
        batch.positions.astype(jnp.int32), as_scalar(batch.num_tokens), as_scalar(window),
        scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0), value_dims=np.int64(value_dims or 0),
        half_bits=np.int64(half_bits),
    )
    return out.astype(q.dtype)


def cpu_rotated_paged_attention(
    qkv: jax.Array,  # [T, >= (num_heads + 2 kv_heads) head_dim] float32: q, k, v side by side, before rotation
    cos: jax.Array,  # [T, head_dim]
    sin: jax.Array,
    k_cache: jax.Array,  # [num_layers, num_blocks, kv_heads, block_size, head_dim] float32, or uint16 half_bits
    v_cache: jax.Array,
    layer: int | jax.Array,
    batch: StepInput,
    *,
    num_heads: int,
    scale: float,
    sliding_window: int | jax.Array | None = None,
    half_bits: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # out [T, num_heads, head_dim], the two caches
    """The kernel's attention from a layer's joined q/k/v product, in one call: q and k rotated
    (`models_jax.layers.apply_rope`), this step's K/V written into the layer's cache slots (as
    attention_common.write_kv: padding tokens, with negative slots, write nowhere; half_bits:
    the caches hold this 16-bit float's bits as uint16, the new rows rounded to it), then
    `cpu_ragged_paged_attention` on the rotated queries. The caches are updated in place (the
    call's results aliased to its operands). One device, caches holding their values; the caller
    checks that (`runtime.ops.attention.rotated_attention_takes`)."""
    window = NO_WINDOW if sliding_window is None else sliding_window
    window = jnp.where(jnp.asarray(window) >= NO_SLIDING_WINDOW, NO_WINDOW, window)
    as_scalar = lambda x: jnp.reshape(jnp.asarray(x, jnp.int32), (1,))  # noqa: E731
    t, head_dim = qkv.shape[0], k_cache.shape[-1]
    shapes = (jax.ShapeDtypeStruct((t, num_heads, head_dim), jnp.float32),
              jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    call = jax.ffi.ffi_call(PAGED_ATTENTION_WRITE_TARGET, shapes, input_output_aliases={3: 1, 4: 2})
    return call(
        qkv.astype(jnp.float32), cos.astype(jnp.float32), sin.astype(jnp.float32), k_cache, v_cache, as_scalar(layer),
        batch.slot_mapping.astype(jnp.int32), batch.block_tables.astype(jnp.int32), batch.seq_lens.astype(jnp.int32),
        batch.query_start_loc.astype(jnp.int32), batch.positions.astype(jnp.int32), as_scalar(batch.num_tokens),
        as_scalar(window), scale=np.float32(scale), num_heads=np.int64(num_heads),
        half_bits=np.int64(HALF_BITS.get(half_bits, 0)),
    )
