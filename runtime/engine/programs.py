"""The device side of an engine: params, KV cache and the compiled programs that run on them.

`ModelPrograms` jits the model's step (one program, or a `LayeredStep` of a few decoder
layers per program) and the sampler, compiles every bucket of the execution plan ahead of
time (`warmup`; with `compile_in_background` only the largest bucket before serving, see
compilation.BucketPrograms), runs them (`run_step`, `run_sample`) and times them
(`step_seconds`). Nothing here knows about requests: the runner builds the inputs. A
multi-process engine wraps it (runtime/engine/distributed.py's MirroredPrograms) so that
every call is repeated on the workers.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from runtime.engine.compilation import BucketPrograms, lower_thread_priority
from runtime.engine.plan import ExecutionPlan
from runtime.engine.runner_inputs import InputBuilder
from runtime.engine.sampler import SamplerOutput, SamplingBatch, sample
from runtime.ops.cpu_kernels import kernel_available
from runtime.ops.huge_pages import advise_huge_pages, host_ranges, huge_pages_allowed
from runtime.ops.layered import LayeredStep, layered_forward
from runtime.ops.lora import LoRASlots
from runtime.ops.step import LoadedModel, allocate_kv_cache

logger = logging.getLogger("servax.engine")

# The CPU backend cannot donate the KV cache; its lowering-time warning is noise.
_DONATION_WARNING = "Some donated buffers were not usable"


class ModelPrograms:
    """Owns the params, the KV cache and the compiled programs of one engine.

    Args:
        model: what registry.load returned (a layered plan takes over its params).
        mesh: the mesh the params live on (the KV cache is sharded on it too).
        plan: the execution plan (cache geometry, backend, buckets, layered or not).
        max_model_len: the context limit (block tables, penalty histories).
        max_logprobs: K of the sampler's top-K logprobs.
    """

    def __init__(self, model: LoadedModel, mesh: Mesh, plan: ExecutionPlan, *, max_model_len: int,
                 max_logprobs: int, pooled_epilogue: Any = None):
        self.model = model
        # A pooling engine's epilogue (runtime/ops/pooling.py): every step program then returns
        # (logits, pooled rows); None: the model's own epilogue, programs as they always were.
        self.pools = pooled_epilogue is not None
        self.mesh = mesh
        self.plan = plan
        self.num_logprobs = max(1, min(max_logprobs, model.vocab_size))
        kv_sharding = NamedSharding(mesh, model.kv_partition_spec)
        self.kv_cache = allocate_kv_cache(plan.kv_spec, plan.num_kv_blocks, plan.block_size, kv_sharding,
                                          plan.attention_backend, plan.mla_prefill)
        kv_shardings = jax.tree.map(lambda a: a.sharding, self.kv_cache)  # with the cache's static fields
        # Logits come out replicated whichever way the step runs, so the sampler programs
        # compiled ahead of time for that sharding are the ones serving calls.
        self.replicated = NamedSharding(mesh, PartitionSpec())
        own_epilogue = model.stages.epilogue if model.stages is not None else None
        if self.pools:  # a pooling engine steps layer by layer (Engine checks it)
            model.stages = dataclasses.replace(model.stages, epilogue=pooled_epilogue)
        try:
            self.layered = (LayeredStep(model, mesh, kv_shardings, plan.layer_seqs, pack=plan.packed_weights,
                                        compute_float32=plan.compute_float32, int8_activations=plan.int8_activations,
                                        feed_rows=plan.largest_bucket[1])
                            if plan.layered else None)
        finally:  # the LoadedModel keeps its own epilogue for any later engine (the layered step has jitted ours)
            if self.pools:
                model.stages = dataclasses.replace(model.stages, epilogue=own_epilogue)
                model.step_fn = functools.partial(layered_forward, stages=model.stages)
        if self.layered is not None and self.layered.packed != plan.packed_weights:
            logger.warning("the plan expected %spacked weights; the layers are %spacked (buckets stay as planned)",
                           "" if plan.packed_weights else "un", "" if self.layered.packed else "un")
        self._step = jax.jit(model.step_fn, donate_argnums=(1,), out_shardings=(self.replicated, kv_shardings))
        self.lora = LoRASlots.of(model)  # None without adapter slots
        self.inputs = InputBuilder(max_model_len=max_model_len, block_size=plan.block_size,
                                   vocab_size=model.vocab_size, lora=self.lora is not None,
                                   num_kv_groups=plan.kv_spec.groups.num_groups)
        self._sample = jax.jit(functools.partial(_sample_feeding, feed_rows=plan.largest_bucket[1]),
                               static_argnames=("num_logprobs", "use_penalties", "cpu_kernel"),
                               out_shardings=self.replicated)
        self.sample_kernel = _sample_kernel_usable(mesh)  # top-k / top-p cut by the C++ kernel
        self.compiled = BucketPrograms(self._lower)
        # The weights in their final form onto 2 MiB pages (runtime/ops/huge_pages.py), on a
        # thread of its own while the programs compile; warmup waits for it.
        ranges = host_ranges(model.params) if huge_pages_allowed() else []
        self._paging = threading.Thread(target=_advise_in_background, args=(ranges,), name="servax-huge-pages",
                                        daemon=True)
        self._paging.start()

    # -- running -------------------------------------------------------------------------
    @property
    def feeds_input_ids(self) -> bool:
        """Whether a step can take input ids still on the device, the previous step's samples
        (`run_step`'s prev / input_from): what async scheduling needs (a layered step)."""
        return self.layered is not None and not self.pools

    def run_step(self, batch, prev: jax.Array | None = None, input_from: np.ndarray | None = None) -> jax.Array:
        """Enqueue the model's step on `batch`; the logits (the KV cache is updated). With
        `input_from` (where feeds_input_ids), the tokens it marks (>= 0) take their ids from
        `prev`, a previous step's SamplerOutput.next_ids, at that row."""
        if self.pools:
            return self.run_pooling_step(batch)[0]
        if self.layered is not None:
            logits, self.kv_cache = self.layered(self.kv_cache, batch, prev, input_from)
        else:
            logits, self.kv_cache = self._step(self.model.params, self.kv_cache, batch)
        return logits

    def run_pooling_step(self, batch) -> tuple[jax.Array, jax.Array | None]:
        """Enqueue the model's step on `batch`: (logits, each sequence slot's pooled row [S, D]
        or None where this engine does not pool)."""
        if self.layered is not None:
            out, self.kv_cache = self.layered(self.kv_cache, batch)
        else:
            out, self.kv_cache = self._step(self.model.params, self.kv_cache, batch)
        return out if self.pools else (out, None)

    def run_sample(self, logits: jax.Array, sb: SamplingBatch | dict[str, np.ndarray], *, use_penalties: bool) -> Any:
        """Enqueue the sampler on the step's logits (a SamplerOutput of device arrays)."""
        if not isinstance(sb, SamplingBatch):
            sb = SamplingBatch(**sb)
        return self._sample(logits, sb, num_logprobs=self.num_logprobs, cpu_kernel=self.sample_kernel,
                            use_penalties=use_penalties)

    def write_lora_slot(self, slot: int, adapter) -> None:
        """Write an adapter (runtime.ops.lora.LoRAAdapter; None: zeros) into device slot `slot`."""
        self.lora.write(self.model, slot, adapter)

    # -- compiling -----------------------------------------------------------------------
    def warmup(self, show_progress: bool = True) -> float:
        """Compile (or load from the persistent cache) every program serving can call, then
        run one step and sampler of the largest bucket as a check. Returns the seconds taken.

        With the plan's compile_in_background, only the largest bucket's programs are compiled
        before this returns; the rest compile on a background thread while the engine serves."""
        start = time.perf_counter()
        later = self.compile_programs(show_progress, background=self.plan.compile_in_background)
        self._paging.join()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DONATION_WARNING)
            if self.lora is not None:
                self.write_lora_slot(1, None)  # compiles the slot writers (slot 1 is empty anyway)
            t, s = self.plan.largest_bucket
            logits = self.run_step(self.inputs.padding_step(t, s))
            jax.block_until_ready(self.run_sample(logits, self.inputs.padding_sampling(s, False), use_penalties=False))
        if later:
            self.compiled.start(later)
        return time.perf_counter() - start

    def compile_programs(self, show_progress: bool = True, background: bool = False) -> list:
        """Compile the step of every bucket and the sampler variants of every sequence bucket.

        Programs are traced and lowered one by one (Python, this thread) and each is handed
        to a thread pool to compile ahead of time as soon as it is lowered (XLA compiles
        outside the GIL, so compiling overlaps the tracing of the next ones and the cores
        share the work); nothing runs.

        With `background`, only the largest bucket (every step fits it) and its sampler
        without penalties are compiled here; the programs left are returned, in the order the
        background thread should compile them (BucketPrograms.start).
        """
        pairs = self.plan.bucket_pairs
        largest = self.plan.largest_bucket
        samplers = [("sampler", s, p) for s, p in
                    sorted({(s, p) for _, s in pairs for p in (False, True)}, key=lambda k: (k[1], -k[0]))]
        if background:
            first = [("step", *largest), ("sampler", largest[1], False)]
            # Then the buckets from the smallest up (a lone decode runs in (1, 1)), the penalties
            # sampler of the largest bucket right after the smallest (a request with penalties
            # waits for it), the other samplers last.
            rest = [key for t, s in sorted(pairs) for key in (("step", t, s), ("sampler", s, False))]
            rest.insert(2, ("sampler", largest[1], True))
            rest = [k for k in dict.fromkeys(rest + samplers) if k not in first]
        else:  # samplers first: they take longest to compile
            first, rest = samplers + [("step", *p) for p in sorted(pairs)], []
        workers = max(1, min(8, os.cpu_count() or 1))
        pool = ThreadPoolExecutor(workers, thread_name_prefix="servax-compile")
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_DONATION_WARNING)
                futures = self.compiled.submit(first, pool, show_progress)
                for future in tqdm(as_completed(futures), total=len(futures), desc="servax: compiling programs",
                                   disable=not show_progress):
                    future.result()
        finally:
            pool.shutdown()
        if rest:  # one core left to serving
            self.compiled.pool = ThreadPoolExecutor(1, thread_name_prefix="servax-compile-background",
                                                    initializer=lower_thread_priority)
        return rest

    @property
    def compiling_in_background(self) -> bool:
        """Whether programs are still compiling in the background (steps may run padded to a
        larger bucket meanwhile)."""
        return not self.compiled.all_ready

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until no program compiles in the background; whether none does."""
        return self.compiled.wait(timeout)

    def runnable_bucket(self, t: int, s: int, use_penalties: bool) -> tuple[int, int]:
        """The plan's bucket (t, s), or while programs compile in the background the smallest
        compiled one that holds it."""
        if self.compiled.all_ready:
            return t, s
        found = self.plan.compiled_bucket(t, s, lambda b: self.compiled.step_ready(b, use_penalties))
        if found is not None:
            return found
        largest = self.plan.largest_bucket
        self.compiled.wait_for_sampler(largest[1], use_penalties)
        return largest

    def _lower(self, key: tuple, seen: set) -> list:
        """The programs of ("step", tokens, seqs) or ("sampler", seqs, penalties), lowered
        (for a step, only those not shared with a bucket lowered before: see LayeredStep.lower)."""
        if key[0] == "sampler":
            return [self.lower_sampler(key[1], key[2])]
        return self.lower_step(self.inputs.padding_step(key[1], key[2]), seen)

    def lower_step(self, batch, seen: set | None = None) -> list:
        """The step programs of `batch`'s bucket, lowered (not compiled)."""
        if self.layered is not None:
            return self.layered.lower(self.kv_cache, batch, seen)
        return [self._step.lower(self.model.params, self.kv_cache, batch)]

    def lower_sampler(self, s: int, penalties: bool) -> Any:
        """The sampler of sequence bucket `s` with penalties or without (logits as the step
        leaves them)."""
        logits = jax.ShapeDtypeStruct((s, self.model.vocab_size), jnp.float32, sharding=self.replicated)
        return self._sample.lower(logits, self.inputs.padding_sampling(s, penalties), num_logprobs=self.num_logprobs,
                                  use_penalties=penalties, cpu_kernel=self.sample_kernel)

    # -- timing probe --------------------------------------------------------------------
    def step_seconds(self, num_tokens: int, context: int = 128, repeats: int = 3) -> float:
        """Median time of a compiled step plus greedy sampling of `num_tokens` single-token
        sequences with `context` tokens of context each (reads of the null block: cost, not
        results), from dispatch to results on the host; what a verification step costs. Waits
        for any programs still compiling in the background first."""
        self.wait_compiled()
        t_pad, s_pad = self.plan.step_bucket(num_tokens, num_tokens)
        batch = self.inputs.decode_probe(num_tokens, t_pad, s_pad, context)
        sb = self.inputs.padding_sampling(s_pad, False)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = self.run_sample(self.run_step(batch), sb, use_penalties=False)
            jax.device_get(out.sampled)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))


def _sample_feeding(logits: jax.Array, sb: SamplingBatch, *, feed_rows: int, **kwargs) -> SamplerOutput:
    """`sample`, with the sampled ids also padded to `feed_rows` rows (SamplerOutput.next_ids:
    one shape for the next step's prologue whatever this step's bucket)."""
    out = sample(logits, sb, **kwargs)
    return out.replace(next_ids=jnp.zeros(feed_rows, jnp.int32).at[:out.sampled.shape[0]].set(out.sampled))


def as_arrays(sb: SamplingBatch) -> dict[str, np.ndarray]:
    """A SamplingBatch as a dict of its host arrays (what crosses to a worker process)."""
    return {f.name: getattr(sb, f.name) for f in dataclasses.fields(sb)}


def _sample_kernel_usable(mesh: Mesh) -> bool:
    """Whether the sampler cuts top-k / top-p with the C++ kernel: XLA:CPU, a one-device mesh
    (the kernel is not partitioned), and the kernel built (runtime.ops.cpu_kernels)."""
    devices = mesh.devices.flat
    if mesh.devices.size != 1 or next(iter(devices)).platform != "cpu":
        return False
    return kernel_available("truncation")


def _advise_in_background(ranges: list[tuple[int, int]]) -> None:
    """advise_huge_pages at a lower priority than the compilers beside it."""
    lower_thread_priority()
    advise_huge_pages(ranges)
