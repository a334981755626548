"""The execution plan: how an engine will run its model, decided once at startup and logged.

How many KV blocks the cache holds (and from which budget), which attention backend reads
them, whether the model steps as one program or a few decoder layers per program (and
whether those multiply packed weights), the (tokens, sequences) buckets every step is
padded to, and whether buckets compile in the background. The runner and the engine read
the plan; `ExecutionPlan.step_bucket` is the only place a step's bucket is chosen.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from runtime.engine.config import EngineConfig
from runtime.ops.attention import resolve_attention_backend
from runtime.ops.attention_cpu import READS as CPU_KERNEL_READS
from runtime.ops.cpu_kernels import kernel_available
from runtime.ops.matmul import packed_matmul_available
from runtime.ops.mesh import num_shards
from runtime.ops.quantization import count_quantized
from runtime.ops.step import HALF, KVCacheSpec, LoadedModel

logger = logging.getLogger("servax.engine")

# The KV budget on a device that reports no memory (XLA:CPU) when no setting names one.
# A device that reports no memory (XLA:CPU): the KV cache takes at most this much of each
# device's share of the host's available memory by default (vLLM's CPU backend: 4 GiB).
CPU_DEFAULT_KV_BYTES = 4 * 1024**3


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    """How an engine runs its model (see the module docstring).

    Attributes:
        kv_spec: what one cache block stores (the model's, or quantized by kv_cache_dtype).
        num_kv_blocks / block_size: the paged cache's geometry (block 0 is the null block).
        kv_budget: where num_kv_blocks came from, in words.
        attention_backend: "xla", "cpu" or "pallas"; the cache is laid out for it.
        layered: the model steps a few decoder layers per program (runtime/ops/layered.py).
        packed_weights: those programs multiply weights packed for the C++ matmuls.
        int8_activations: packed int8 and 4-bit weights multiply int8-quantized activations at
            decode sizes (EngineConfig.int8_activations; runtime/ops/matmul.py PackedWeight.dot).
        compute_float32: a bfloat16 / float16 model stepped layer by layer on CPU computes in
            float32 (XLA:CPU has no fast half-precision arithmetic; the packed kernels widen
            the stored weights in registers, XLA's dots convert them); its K/V cache keeps the
            model's dtype (held as uint16 bits on CPU: runtime.ops.step.KVCache.half_bits).
        layer_seqs: every layer program runs at this many sequence slots (the C++ attention
            costs nothing for empty ones, so one program per token bucket), or None.
        token_buckets / seq_buckets: padded sizes compiled ahead of time.
        compile_in_background: only the largest bucket compiles before serving.
        mla_prefill: latent attention's prefill form (EngineConfig.mla_prefill; the KV cache carries it).
    """

    kv_spec: KVCacheSpec
    num_kv_blocks: int
    block_size: int
    kv_budget: str
    attention_backend: str
    layered: bool
    packed_weights: bool
    compute_float32: bool
    layer_seqs: int | None
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    compile_in_background: bool
    int8_activations: bool = False
    mla_prefill: str = "absorbed"

    def step_bucket(self, num_tokens: int, num_rows: int) -> tuple[int, int]:
        """The (tokens, sequences) bucket a step of `num_tokens` tokens in `num_rows` rows runs in."""
        return step_bucket(num_tokens, num_rows, list(self.token_buckets), list(self.seq_buckets))

    @property
    def bucket_pairs(self) -> list[tuple[int, int]]:
        """Every (tokens, sequences) bucket a step can use."""
        return step_buckets(list(self.token_buckets), list(self.seq_buckets))

    @property
    def largest_bucket(self) -> tuple[int, int]:
        return max(self.bucket_pairs)

    def compiled_bucket(self, t: int, s: int, compiled: Callable[[tuple[int, int]], bool]) -> tuple[int, int] | None:
        """While buckets compile in the background: the smallest compiled bucket that holds a
        step of bucket (t, s), or None (the largest bucket compiles first: wait for it)."""
        fits = [b for b in self.bucket_pairs if b[0] >= t and b[1] >= s and compiled(b)]
        return min(fits) if fits else None

    def describe(self) -> str:
        groups = self.kv_spec.groups
        kv_groups = "" if groups.num_groups == 1 else (
            f" in {groups.num_groups} KV cache groups of {groups.num_rows} layers (windows "
            f"{['full' if w is None else w for w in groups.windows]})")
        stepping = ("layered" + (", packed weights" if self.packed_weights else "")
                    + (", int8 activations" if self.int8_activations else "")
                    + (", computing in float32" if self.compute_float32 else "")) if self.layered else "one program"
        return (f"{self.num_kv_blocks} KV blocks x {self.block_size} tokens{kv_groups} ({self.kv_budget}); attention "
                f"{self.attention_backend}; {stepping}; {len(self.bucket_pairs)} buckets (tokens "
                f"{list(self.token_buckets)}, seqs {list(self.seq_buckets)})"
                + ("; compiling in the background" if self.compile_in_background else ""))


def make_plan(config: EngineConfig, model: LoadedModel, mesh: Mesh, *, max_model_len: int,
              multi_process: bool = False) -> ExecutionPlan:
    """Decide the plan of an engine serving `model` on `mesh` with `config` (`multi_process`:
    the mesh spans processes, whose workers compile every bucket before serving).

    Raises:
        ValueError: the settings cannot work (a KV cache too small for one max_model_len
            sequence, a backend that cannot read this cache).
    """
    kv_spec = model.kv_spec
    if config.kv_cache_dtype in ("int8", "fp8", "fp8_e4m3"):
        stored = np.int8 if config.kv_cache_dtype == "int8" else jax.numpy.float8_e4m3fn
        kv_spec = dataclasses.replace(model.kv_spec, cache_dtype=stored)
    elif config.kv_cache_dtype != "auto":  # float32, bfloat16, float16: the cache's dtype whatever the model's
        kv_spec = dataclasses.replace(model.kv_spec, dtype=jax.numpy.dtype(config.kv_cache_dtype))
    platform = mesh.devices.flat[0].platform
    layered = config.layered and model.stages is not None
    packed = layered and platform == "cpu" and _packs(model)
    compute_float32 = layered and platform == "cpu" and np.dtype(model.kv_spec.dtype) in HALF
    backend = _attention_backend(config, kv_spec, platform, mesh.size)
    num_blocks, budget = _num_kv_blocks(config, model, kv_spec, mesh, max_model_len)
    on_cpu_kernel = backend == "cpu"
    tokens, seqs = token_buckets(config.max_num_batched_tokens), seq_buckets(config.max_num_seqs)
    if packed:
        tokens, seqs = packed_weight_buckets(tokens, seqs)
    plan = ExecutionPlan(
        kv_spec=kv_spec, num_kv_blocks=num_blocks, block_size=config.block_size, kv_budget=budget,
        attention_backend=backend, layered=layered, packed_weights=packed, compute_float32=compute_float32,
        int8_activations=(packed and config.int8_activations is not False and count_quantized(model.params) > 0
                          and kernel_available("matmul_dot")),
        layer_seqs=seqs[-1] if layered and on_cpu_kernel else None,
        token_buckets=tuple(tokens), seq_buckets=tuple(seqs), mla_prefill=config.mla_prefill,
        compile_in_background=config.compile_in_background and not config.enforce_eager and not multi_process,
    )
    logger.info("execution plan: %s", plan.describe())
    return plan


# -- buckets ---------------------------------------------------------------------------
def _pow2_range(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return sorted(set(out))


# Steps of at most this many tokens (small decode batches) get their own exact power-of-two
# buckets: XLA:CPU's own matmuls of a few rows cost several times less than padded to 16,
# being far from the bandwidth floor once M grows past a few rows (not so on packed weights,
# see packed_weight_buckets; benchmarks/RESULTS.md has the measurements).
SMALL_STEP_TOKENS = 8


# From this many tokens up, a bucket halfway (1.5x) between powers of two as well: a step of
# 32 decodes and one ~100-token prompt (what serving under load runs between pure decode steps)
# then pays for 192 tokens, not 256.
MID_BUCKETS_FROM = 128


def token_buckets(max_num_batched_tokens: int, smallest: int = 16) -> list[int]:
    """Padded token counts: 1, 2, 4, 8, then powers of two from `smallest` up to the budget,
    with 1.5x steps between them from MID_BUCKETS_FROM (192, 384, ...)."""
    small = [b for b in (1, 2, 4, 8) if b <= min(SMALL_STEP_TOKENS, max_num_batched_tokens)]
    pow2 = _pow2_range(min(smallest, max_num_batched_tokens), max_num_batched_tokens)
    mid = [b * 3 // 2 for b in pow2 if b >= MID_BUCKETS_FROM and b * 3 // 2 < max_num_batched_tokens]
    return sorted(set(small + pow2 + mid))


def packed_weight_buckets(tokens: list[int], seqs: list[int]) -> tuple[list[int], list[int]]:
    """(token buckets, sequence buckets) for steps whose products run on packed weights
    (runtime/ops/matmul.py). That kernel multiplies only a step's real rows, so padding 2-8
    tokens to 16 costs little and the small-step buckets 2, 4 and 8 would only be programs
    to compile (a shorter warmup without them). The bucket of 1 token stays, with a sequence
    bucket of 1 beside the others: a lone sequence's decode step still pays for the
    elementwise work of padding rows and for the sampler's rows. The largest token bucket
    stays when the budget is that small."""
    kept = [b for b in tokens if b == 1 or b > SMALL_STEP_TOKENS]
    return (kept if len(kept) > 1 else sorted({1, tokens[-1]})), sorted({1, *seqs})


def seq_buckets(max_num_seqs: int, smallest: int = 8) -> list[int]:
    """Padded sequence counts: powers of two from `smallest` (cheap to pad) up to max_num_seqs."""
    return _pow2_range(min(smallest, max_num_seqs), max_num_seqs)


def step_bucket(num_tokens: int, num_rows: int, tokens: list[int], seqs: list[int]) -> tuple[int, int]:
    """The (tokens, sequences) bucket of a step: small steps pad rows to the token bucket
    (one program each), larger ones pick their sequence bucket independently."""
    t = bucket_for(num_tokens, tokens)
    if t <= SMALL_STEP_TOKENS:
        return t, min(t, seqs[-1])
    return t, bucket_for(num_rows, seqs)


def step_buckets(tokens: list[int], seqs: list[int]) -> list[tuple[int, int]]:
    """Every (tokens, sequences) bucket `step_bucket` can return (a row has at least one token)."""
    small = [(t, min(t, seqs[-1])) for t in tokens if t <= SMALL_STEP_TOKENS]
    return small + [(t, s) for t in tokens if t > SMALL_STEP_TOKENS for s in seqs if s <= t]


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket >= n. Raises ValueError when n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def _packs(model: LoadedModel) -> bool:
    """Whether the layered step will run its products on packed weights: the kernel is built,
    the model can pack its layers, and every weight is whole on each device (the packed
    matmul is not partitioned)."""
    stages = model.stages
    return (packed_matmul_available() and stages is not None and stages.pack_layer is not None
            and all(x.sharding.is_fully_replicated for x in jax.tree.leaves(model.params)))


def _attention_backend(config: EngineConfig, kv_spec: KVCacheSpec, platform: str, mesh_size: int = 1) -> str:
    requested = config.attention_backend
    backend = resolve_attention_backend(requested, platform)
    # The CPU kernel reads a quantized cache on one device (scaling each block as it reads it)
    if kv_spec.quantized and (backend == "pallas" or (backend == "cpu" and mesh_size > 1)):
        if requested == backend:
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype} runs on attention_backend='xla'"
                             + (" or on 'cpu' on one device" if backend == "cpu" else
                                " or 'cpu' (the pallas kernel reads an unquantized cache)"))
        logger.info("kv_cache_dtype=%s: attention backend xla", config.kv_cache_dtype)
        return "xla"
    if backend == "pallas" and kv_spec.values_in_keys:
        if requested == backend:
            raise ValueError("a latent KV cache (values kept in the keys: multi-head latent attention) runs on "
                             "attention_backend='xla' or 'cpu' (the pallas kernel reads separate values)")
        logger.info("latent KV cache (values in the keys): attention backend xla")
        return "xla"
    if backend == "cpu" and not kv_spec.quantized and np.dtype(kv_spec.dtype) not in CPU_KERNEL_READS:
        if requested == "cpu":
            raise ValueError(f"attention_backend='cpu' reads a float32, bfloat16 or float16 KV cache; this one is "
                             f"{np.dtype(kv_spec.dtype)} (use kv_cache_dtype='float32' or attention_backend='xla')")
        logger.info("%s KV cache: attention backend xla", np.dtype(kv_spec.dtype))
        return "xla"
    return backend


def _blocks_per_seq(config: EngineConfig, spec: KVCacheSpec, num_tokens: int) -> int:
    """The most blocks one sequence of `num_tokens` tokens holds (over its KV cache groups)."""
    return spec.groups.blocks_per_seq(num_tokens, config.block_size, config.max_num_batched_tokens)


def _local_devices(mesh: Mesh) -> list:
    """The mesh's devices in this process (all of them unless the mesh spans processes;
    every process holds the same share, so this process's memory decides)."""
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def _num_kv_blocks(config: EngineConfig, model: LoadedModel, spec: KVCacheSpec, mesh: Mesh,
                   max_model_len: int) -> tuple[int, str]:
    block_size = config.block_size
    per_block = spec.bytes_per_block(block_size)
    if config.num_kv_blocks is not None:
        num, source = config.num_kv_blocks, "num_kv_blocks"
    elif config.kv_cache_memory_bytes is not None:
        num, source = config.kv_cache_memory_bytes // per_block, f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}"
    elif config.gpu_memory_utilization is not None:
        num, source = _blocks_for_memory_share(config, model, mesh, per_block, max_model_len)
    else:
        devices = _local_devices(mesh)
        stats = devices[0].memory_stats()
        if stats and "bytes_limit" in stats:
            free = min(d.memory_stats()["bytes_limit"] - d.memory_stats().get("bytes_in_use", 0) for d in devices)
            # A cache sharded over mesh axes puts 1/shards of it on each device; a
            # replicated one (P()) puts all of it on every device.
            budget = int(free * config.kv_cache_memory_fraction) * num_shards(model.kv_partition_spec, mesh)
            source = f"{config.kv_cache_memory_fraction:.0%} of free device memory"
            num = budget // per_block
        else:
            num, source = _host_memory_blocks(config, model, mesh, per_block, max_model_len)
    needed = _blocks_per_seq(config, spec, max_model_len) + 1  # + the null block
    if num < needed:
        raise ValueError(
            f"the KV cache has {num} blocks of {block_size} tokens ({source}), but one "
            f"max_model_len={max_model_len} sequence needs {needed} (null block included); "
            f"raise the KV budget to >= {needed * per_block} bytes or lower max_model_len"
        )
    logger.info("KV cache: %d blocks x %d tokens = %d token slots, %.1f MiB (%s)",
                num, block_size, (num - 1) * block_size, num * per_block / 2**20, source)
    return int(num), source


def _host_memory_blocks(config: EngineConfig, model: LoadedModel, mesh: Mesh, per_block: int,
                        max_model_len: int) -> tuple[int, str]:
    """The default KV blocks where devices report no memory (XLA:CPU): kv_cache_memory_fraction
    of the host's available memory, shared by the process's devices, at most
    CPU_DEFAULT_KV_BYTES each, and no more than twice what max_num_seqs full-length sequences
    need (the rest would only ever hold prefix-cache entries)."""
    available = _available_host_memory()
    devices = len(_local_devices(mesh))
    per_device = min(CPU_DEFAULT_KV_BYTES, int(available * config.kv_cache_memory_fraction) // devices)
    wanted = 2 * config.max_num_seqs * _blocks_per_seq(config, model.kv_spec, max_model_len) + 1
    num = min(per_device * num_shards(model.kv_partition_spec, mesh) // per_block, wanted)
    return num, (f"{config.kv_cache_memory_fraction:.0%} of {available / 2**30:.1f} GiB available host memory "
                 f"over {devices} device(s), at most {CPU_DEFAULT_KV_BYTES / 2**30:.0f} GiB each, capped at "
                 f"{wanted} blocks")


def _available_host_memory() -> int:
    """Bytes of host memory available to a new allocation (Linux's MemAvailable; else all of it)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _blocks_for_memory_share(config: EngineConfig, model: LoadedModel, mesh: Mesh, per_block: int,
                             max_model_len: int) -> tuple[int, str]:
    """KV blocks under gpu_memory_utilization: the share of device (on CPU, host) memory
    the whole engine may use, less the weights, capped at twice what max_num_seqs
    full-length sequences need (the rest would only ever hold prefix-cache entries)."""
    share = config.gpu_memory_utilization
    devices = _local_devices(mesh)
    stats = devices[0].memory_stats()
    if stats and "bytes_limit" in stats:
        total, where = min(d.memory_stats()["bytes_limit"] for d in devices), "device"
    else:
        total, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host"
    shards = num_shards(model.kv_partition_spec, mesh)
    weights = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(model.params))
    budget = int(total * share) - weights  # per device
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={share} of {total / 2**30:.1f} GiB of {where} memory leaves nothing "
            f"for the KV cache after the weights ({weights / 2**30:.2f} GiB per device); raise it"
        )
    wanted = 2 * config.max_num_seqs * _blocks_per_seq(config, model.kv_spec, max_model_len) + 1
    num = min(budget * shards // per_block, wanted)
    return num, (f"gpu_memory_utilization={share} of {total / 2**30:.1f} GiB {where} memory, "
                 f"less {weights / 2**20:.0f} MiB of weights, capped at {wanted} blocks")
