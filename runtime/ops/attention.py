"""Ragged paged attention: the one dispatch point models call, and the choice of backend.

`paged_attention` writes a step's K/V into the paged cache (attention_common.py) and attends
with the backend the cache was allocated for: the pure-JAX implementation (attention_xla.py),
servax's C++ kernel for XLA:CPU (attention_cpu.py) or its Pallas kernel (attention_pallas.py).
`resolve_attention_backend` decides that backend once, from the `attention_backend` setting and
the platform. Only this module imports the backends; they share attention_common.py.
`rotated_paged_attention` is the CPU kernel's form that also rotates q and k and writes the cache
(one call from a layer's joined q/k/v product), where `rotated_attention_takes` says it applies.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from runtime.ops.attention_common import (
    NO_SLIDING_WINDOW, ExpandedLatent, ScaledCache, ValuesInKeys, Window, as_stored, readable, stored_dtype,
    write_kv, write_kv_quantized,
)
from runtime.ops.attention_cpu import cpu_ragged_paged_attention, cpu_rotated_paged_attention
from runtime.ops.attention_xla import CACHED_CHUNK_TOKENS, CACHED_TILE, NEW_TOKEN_TILE, xla_paged_attention
from runtime.ops.cpu_kernels import kernel_status
from runtime.ops.step import HALF, KVCache, StepInput

__all__ = ["NO_SLIDING_WINDOW", "expanded_latent_attention", "paged_attention", "resolve_attention_backend",
           "rotated_attention_takes", "rotated_paged_attention", "write_step_kv"]

# Query tile of the expanded form's per-sequence cached read: each tile expands the context it
# reads once, so the tile is long (the expansion costs about as much as a few hundred queries'
# attention over the same context).
EXPANDED_CACHED_TILE = 512

logger = logging.getLogger("servax.engine")


def resolve_attention_backend(requested: str, platform: str) -> str:
    """The attention backend an engine on `platform` ("cpu", "gpu", "tpu") runs for the
    `attention_backend` setting: "xla", "pallas" or "cpu".

    auto takes the Pallas kernel (runtime/ops/attention_pallas.py) on TPU, the C++ kernel
    (runtime/ops/attention_cpu.py) on CPU where it builds, and the XLA implementation
    (runtime/ops/attention_xla.py) elsewhere. pallas on CPU runs the kernel in Pallas' TPU interpret mode (for tests:
    correct and slow).

    Raises:
        ValueError: an unknown setting; pallas on a GPU (the kernel is written for TPU's
            Mosaic compiler: async copies and scalar prefetch; it has no GPU lowering); cpu
            on another platform, or where its kernel cannot be built (the reason is given).
    """
    if requested not in ("auto", "xla", "pallas", "cpu"):
        raise ValueError(f"attention_backend must be auto, xla, pallas or cpu, got {requested!r}")
    if requested == "pallas" and platform not in ("tpu", "cpu"):
        raise ValueError(
            f"attention_backend='pallas' runs on TPU (and on CPU in interpret mode), not on {platform}: servax's "
            "Pallas kernel uses TPU async copies and scalar prefetch; use attention_backend='xla' or 'auto'"
        )
    if requested == "cpu" and platform != "cpu":
        raise ValueError(f"attention_backend='cpu' is a kernel for XLA:CPU, not for {platform}; use 'auto'")
    if requested in ("cpu", "auto") and platform == "cpu":
        status = kernel_status("paged_attention")
        if status == "ok":
            backend = "cpu"
        elif requested == "cpu":
            raise ValueError(f"attention_backend='cpu': the kernel cannot be built here: {status}")
        else:
            logger.warning("the CPU attention kernel is not available (%s): attention runs on the slower xla "
                           "backend", status)
            backend = "xla"
    else:
        backend = "pallas" if requested == "pallas" or (requested == "auto" and platform == "tpu") else "xla"
    if backend == "pallas" and platform == "cpu":
        logger.warning("attention_backend='pallas' on CPU: the Pallas kernel runs in interpret mode (slow; for tests)")
    else:
        logger.info("attention backend: %s (%s requested, %s platform)", backend, requested, platform)
    return backend


def paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k: jax.Array,  # [T, kv_heads, head_dim]
    v: jax.Array | None,  # [T, kv_heads, head_dim]; None with value_dims
    kv_cache: KVCache | tuple[jax.Array, jax.Array],
    batch: StepInput,
    *,
    layer: int | jax.Array | None = None,
    scale: float,
    sliding_window: Window = None,
    logit_soft_cap: float | None = None,
    kv_chunk_blocks: int | None = None,
    new_token_tile: int = NEW_TOKEN_TILE,
    cached_tile: int = CACHED_TILE,
    cached_chunk_tokens: int = CACHED_CHUNK_TOKENS,
    sinks: jax.Array | None = None,
    value_dims: int | None = None,
    write: bool = True,
) -> tuple[jax.Array, KVCache | tuple[jax.Array, jax.Array]]:
    """Write this step's K/V into the cache and attend. Returns (out [T, H, D], the cache);
    D is value_dims where that is given.

    `kv_cache` is the stacked KVCache of all layers, with `layer` (an int, or a traced
    int32 under a scan over layers) naming the one this call writes and reads (with KV cache
    groups, runtime.ops.step.KVCacheGroups, through its group's block tables); or one
    layer's (k_cache, v_cache), each [num_blocks, kv_heads, block_size, head_dim], with
    `layer` None. The cache comes back in the form it was given.

    The backend is the one the cache was allocated for (`kv_cache.attention_backend`: "xla",
    "cpu" or "pallas"; a one-layer tuple runs on xla). Masks and conventions are
    attention_xla.ragged_paged_attention's.

    Args:
        kv_chunk_blocks, new_token_tile, cached_tile, cached_chunk_tokens: the XLA path's
            tiling (see attention_xla.xla_paged_attention); the kernels ignore them.
        sinks: [num_heads] attention-sink logits (gpt-oss): each softmax's denominator gains
            exp(sink). The kernels do not take them: such layers attend on the XLA path, which
            reads the same cache layout.
        value_dims: the values are the first value_dims dims of each key, and the cache keeps
            keys only (multi-head latent attention: a KVCache allocated for a KVCacheSpec with
            value_dims; v is None). Such layers attend on the XLA path or the CPU kernel
            (which reads the keys as values in place), not the Pallas kernel.
        write: False: the cache already holds this step's K/V (`write_step_kv` wrote them) and
            is returned as it is.

    q may hold only the step's first tokens (latent attention's decodes): all of k and v are
    written, those tokens attend.

    Raises:
        ValueError: heads that do not group over the KV heads, a KVCache without `layer`, or
            value_dims with a cache that stores values (or v given with it).
        NotImplementedError: a quantized cache on the Pallas backend.
    """
    if not isinstance(kv_cache, KVCache):
        out, cache = paged_attention(
            q, k, v, KVCache(kv_cache[0][None], kv_cache[1][None]), batch, layer=0, scale=scale,
            sliding_window=sliding_window, logit_soft_cap=logit_soft_cap, kv_chunk_blocks=kv_chunk_blocks,
            new_token_tile=new_token_tile, cached_tile=cached_tile, cached_chunk_tokens=cached_chunk_tokens,
            sinks=sinks, value_dims=value_dims, write=write,
        )
        return out, (cache.k[0], cache.v[0])
    if layer is None:
        raise ValueError("paged_attention on a stacked KVCache needs the layer to use")
    if value_dims is not None and (v is not None or kv_cache.v.size):
        raise ValueError("value_dims reads the values from the keys: pass v=None, with a cache allocated for a "
                         f"KVCacheSpec with value_dims (this one stores values of shape {kv_cache.v.shape})")
    batch = jax.tree.map(jnp.asarray, batch)
    if kv_cache.groups is not None:  # KV cache groups: the layer's row, read through its group's block tables
        layer, batch = kv_cache.groups.row_and_batch(layer, batch)
    if kv_cache.k_scale is not None:  # a quantized cache: read back through its scales
        if kv_cache.attention_backend == "pallas":
            raise NotImplementedError("a quantized KV cache (kv_cache_dtype) runs on the xla or cpu attention backend")
        if write:
            kv_cache = write_kv_quantized(kv_cache, k, v, batch.slot_mapping, layer)
        if kv_cache.attention_backend == "cpu" and sinks is None:  # the kernel scales each block as it reads it
            in_keys = value_dims is not None
            out = cpu_ragged_paged_attention(
                jnp.asarray(q), kv_cache.k, kv_cache.k if in_keys else kv_cache.v, layer, batch, scale=scale,
                sliding_window=sliding_window, logit_soft_cap=logit_soft_cap, mesh=kv_cache.mesh,
                cache_spec=kv_cache.partition_spec, value_dims=value_dims, k_scale=kv_cache.k_scale,
                v_scale=kv_cache.k_scale if in_keys else kv_cache.v_scale)
            return out, kv_cache
        k_cache, v_cache = ScaledCache(kv_cache.k, kv_cache.k_scale), ScaledCache(kv_cache.v, kv_cache.v_scale)
        written = {}
    elif write:
        k_cache, v_cache = write_kv(kv_cache.k, kv_cache.v, k, v, batch.slot_mapping, layer,
                                    half_bits=kv_cache.half_bits)
        written = {"k": k_cache, "v": v_cache}
    else:
        k_cache, v_cache, written = kv_cache.k, kv_cache.v, {}
    k, v = k[:q.shape[0]], None if v is None else v[:q.shape[0]]  # the new K/V of the tokens that attend
    if kv_cache.k_scale is not None:  # as the quantized cache holds them (attention_common.as_stored)
        k, v = as_stored(k, kv_cache.k.dtype), None if v is None else as_stored(v, kv_cache.v.dtype)
    elif (half := stored_dtype(kv_cache)) in HALF and k.dtype != half:  # a model computing in float32
        k, v = _rounded(k, half), None if v is None else _rounded(v, half)
    if value_dims is not None and kv_cache.attention_backend == "cpu" and sinks is None and kv_cache.k_scale is None:
        out = cpu_ragged_paged_attention(  # values read in place from the keys' leading dims
            jnp.asarray(q), k_cache, k_cache, layer, batch, scale=scale, sliding_window=sliding_window,
            logit_soft_cap=logit_soft_cap, mesh=kv_cache.mesh, cache_spec=kv_cache.partition_spec,
            value_dims=value_dims, half_bits=kv_cache.half_bits)
        return out, dataclasses.replace(kv_cache, **written)
    if value_dims is not None:  # the Pallas kernel reads separate values: the XLA path reads them from the keys
        k_cache = readable(kv_cache, k_cache)
        v, v_cache = k[..., :value_dims], ValuesInKeys(k_cache, value_dims)
    elif kv_cache.attention_backend in ("cpu", "pallas") and sinks is None:  # a kernel reads the whole context
        if kv_cache.attention_backend == "cpu":
            kernel = functools.partial(cpu_ragged_paged_attention, half_bits=kv_cache.half_bits)
        else:  # imported on use: Pallas' TPU modules add to every start's import time, and few engines use them
            from runtime.ops.attention_pallas import pallas_ragged_paged_attention as kernel
        out = kernel(
            jnp.asarray(q), k_cache, v_cache, layer, batch, scale=scale, sliding_window=sliding_window,
            logit_soft_cap=logit_soft_cap, mesh=kv_cache.mesh, cache_spec=kv_cache.partition_spec,
        )
        return out, dataclasses.replace(kv_cache, k=k_cache, v=v_cache)
    else:
        k_cache, v_cache = readable(kv_cache, k_cache), readable(kv_cache, v_cache)
    out = xla_paged_attention(
        q, k, v, k_cache, v_cache, layer, batch, scale=scale, sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap, kv_chunk_blocks=kv_chunk_blocks, new_token_tile=new_token_tile,
        cached_tile=cached_tile, cached_chunk_tokens=cached_chunk_tokens, sinks=sinks,
    )
    return out, dataclasses.replace(kv_cache, **written)


# The most tokens (a step's padded rows) `rotated_paged_attention` takes: it rotates and writes on the
# kernel's calling thread, where with more rows XLA's own programs share that over the cores (a
# 500-token prefill ran slower in one call: benchmarks/RESULTS.md, stop 64).
ROTATED_MAX_TOKENS = 16


def rotated_attention_takes(kv_cache: KVCache, qkv: jax.Array, cos: jax.Array, num_heads: int, head_dim: int,
                            joined: bool = True) -> bool:
    """Whether `rotated_paged_attention` takes this layer: the CPU kernel's cache (float32, or a
    16-bit float's bits; its values its own, no scales, KV cache groups or mesh of several
    devices), a float32 joined q/k/v product [T, (num_heads + 2 kv_heads) head_dim] and a rotation
    over whole heads, for a step of at most ROTATED_MAX_TOKENS tokens. With `joined` False, qkv
    stands for any float32 array of the step's rows (its width unchecked)."""
    if not isinstance(kv_cache, KVCache) or kv_cache.attention_backend != "cpu":
        return False
    if qkv.shape[0] > ROTATED_MAX_TOKENS:
        return False
    kv_heads = kv_cache.k.shape[2]
    stored = jnp.uint16 if kv_cache.half_bits else jnp.float32
    return (kv_cache.k_scale is None and kv_cache.groups is None
            and kv_cache.k.dtype == stored and kv_cache.v.shape == kv_cache.k.shape
            and kv_cache.k.shape[-1] == head_dim and (kv_cache.mesh is None or kv_cache.mesh.size == 1)
            and qkv.dtype == jnp.float32 and (not joined or qkv.shape[1] == (num_heads + 2 * kv_heads) * head_dim)
            and cos.shape == (qkv.shape[0], head_dim) and kernel_status("paged_attention") == "ok")


def rotated_paged_attention(qkv: jax.Array, cos: jax.Array, sin: jax.Array, kv_cache: KVCache, batch: StepInput, *,
                            layer: int | jax.Array, num_heads: int, scale: float,
                            sliding_window: Window = None) -> tuple[jax.Array, KVCache]:
    """A layer's attention from its joined q/k/v product [T, >= (num_heads + 2 kv_heads) head_dim]
    (not yet rotated, no biases or norms left to add): what `models_jax.layers.apply_rope` on q
    and k, then `paged_attention` compute, in one call of the CPU kernel that rotates, writes
    the cache in place and attends (attention_cpu.cpu_rotated_paged_attention): no XLA programs
    between a one-token step's products. Returns (out [T, H, head_dim], the cache). Only where
    `rotated_attention_takes`."""
    out, k, v = cpu_rotated_paged_attention(qkv, cos, sin, kv_cache.k, kv_cache.v, layer, batch, num_heads=num_heads,
                                            scale=scale, sliding_window=sliding_window, half_bits=kv_cache.half_bits)
    return out, dataclasses.replace(kv_cache, k=k, v=v)


def write_step_kv(kv_cache: KVCache, k: jax.Array, v: jax.Array | None, batch: StepInput, *,
                  layer: int | jax.Array) -> KVCache:
    """This step's K/V (v None: a cache that keeps the values in the keys) written into layer
    `layer` of the cache, as `paged_attention` writes them, for calls that then attend with
    write=False."""
    batch = jax.tree.map(jnp.asarray, batch)
    if kv_cache.groups is not None:
        layer, batch = kv_cache.groups.row_and_batch(layer, batch)
    if kv_cache.k_scale is not None:
        return write_kv_quantized(kv_cache, k, v, batch.slot_mapping, layer)
    k_cache, v_cache = write_kv(kv_cache.k, kv_cache.v, k, v, batch.slot_mapping, layer, half_bits=kv_cache.half_bits)
    return dataclasses.replace(kv_cache, k=k_cache, v=v_cache)


def _rounded(x: jax.Array, dtype) -> jax.Array:
    """x as a cache of `dtype` gives it back, in x's dtype: what the step's own tokens attend with,
    as their context written by earlier steps is (and as the C++ kernel reads them)."""
    return x.astype(dtype).astype(x.dtype)


def expanded_latent_attention(
    q: jax.Array,  # [T, H, nope + rope], the queries as the model makes them (rope applied)
    latent: jax.Array,  # [T, 1, rank + rope], this step's latents, already written to the cache
    kv_cache: KVCache,
    batch: StepInput,
    *,
    layer: int | jax.Array,
    scale: float,
    w_uk: jax.Array,  # [rank, H, nope]
    w_uv: jax.Array,  # [rank, H, v]
    first_token: int = 0,
    cached_tile: int = EXPANDED_CACHED_TILE,
) -> jax.Array:  # [T, H, v], dtype of q; rows before first_token not meaningful
    """Multi-head latent attention in the expanded form, over a cache of latents (a KVCache for a
    KVCacheSpec with value_dims) that already holds this step's: per head, keys [c W_UK_h, k_rope]
    and values c W_UV_h, made from the step's own latents directly and from the cached context's
    as the XLA path gathers its blocks (attention_common.ExpandedLatent); the cache keeps only the
    latent. Tokens from `first_token` on attend, on the XLA path whatever backend the cache was
    allocated for (the kernels read the latent as it is stored).

    Raises:
        ValueError: a cache that stores values (not latents).
    """
    if kv_cache.v.size:
        raise ValueError("expanded_latent_attention reads a cache of latents (allocated with value_dims)")
    batch = jax.tree.map(jnp.asarray, batch)
    if kv_cache.groups is not None:
        layer, batch = kv_cache.groups.row_and_batch(layer, batch)
    cache = readable(kv_cache, kv_cache.k) if kv_cache.k_scale is None else ScaledCache(kv_cache.k, kv_cache.k_scale)
    k_cache, v_cache = ExpandedLatent(cache, w_uk, with_rope=True), ExpandedLatent(cache, w_uv, with_rope=False)
    if kv_cache.k_scale is not None:  # the step's own latents as the cache holds them
        new = as_stored(latent, kv_cache.k.dtype)
    else:
        new = _rounded(latent, stored_dtype(kv_cache)).astype(jnp.float32)
    k, v = k_cache.expand(new, heads_axis=1), v_cache.expand(new, heads_axis=1)  # [T, H, nope + rope], [T, H, v]
    return xla_paged_attention(q, k, v, k_cache, v_cache, layer, batch, scale=scale, cached_tile=cached_tile,
                               first_token=first_token)
