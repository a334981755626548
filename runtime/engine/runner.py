"""The model runner: scheduler output -> padded StepInput -> jitted step + sampler -> host.

All inputs are built in NumPy and padded to a precompiled (tokens, sequences) bucket, so
serving never compiles (see compilation.CompileCounter). The KV cache is donated to the
step so that its update is in place.

Rows: normally one sequence slot per scheduled request. A request that still needs prompt
logprobs, or verifies draft tokens (runtime/engine/speculative.py), has each of its scheduled
tokens in a slot of its own (same block table, seq_len = position + 1). Because a layer
writes all new K/V before it attends, the result equals one ragged prefill, and every
position yields logits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from runtime.engine.compilation import BucketPrograms, lower_thread_priority, packed_weight_buckets, step_bucket, step_buckets
from runtime.ops.layered import LayeredStep
from runtime.engine.sampler import BIAS_WIDTH, SamplingBatch, empty_sampling_batch, sample
from runtime.engine.scheduler import SchedulerOutput
from runtime.ops.step import LoadedModel, allocate_kv_cache, make_step_input
from runtime.engine.stop import suppressed_token_ids
from runtime.engine.structured_output import fill_token_masks, mask_words

logger = logging.getLogger("servax.engine")
_SUPPRESS = -1e30


@dataclasses.dataclass
class RowResult:
    """Sampler results of one row, on the host."""

    chosen_logprob: float
    chosen_rank: int
    top_ids: np.ndarray  # [K]
    top_logprobs: np.ndarray  # [K]


@dataclasses.dataclass
class RunnerOutput:
    # Per scheduled request its row's token (meaningless for partial prefill chunks), or with
    # drafts one token per row.
    sampled: list[list[int]]
    sample_logprobs: dict[str, list[RowResult]]  # request id -> its sampled tokens' logprobs, as `sampled`
    # request id -> (prompt index of the token, result) for newly computed prompt logprobs
    prompt_logprobs: dict[str, list[tuple[int, RowResult]]]


@dataclasses.dataclass
class InFlightStep:
    """A step enqueued on the device whose results have not been fetched yet."""

    sched: SchedulerOutput
    out: Any  # SamplerOutput of device arrays
    sample_rows: list[list[int]]  # per scheduled request, the rows whose samples count
    prompt_rows: list[tuple[str, int, int]]


class ModelRunner:
    """Owns the params, the KV cache and the compiled programs of one engine.

    Args:
        model: what registry.load returned.
        mesh: the mesh the params live on (the KV cache is sharded on it too).
        num_blocks, block_size, max_model_len: the KV cache geometry.
        token_buckets, seq_buckets: padded sizes to compile (fewer small
            ones where the products run on packed weights: compilation.packed_weight_buckets).
        max_logprobs: K of the sampler's top-K logprobs.
        layerwise: step a model that offers LayerStages a few decoder layers per call
            (runtime/ops/layered.py; it takes over the model's params), else one program.
        attention_backend: "xla" or "pallas" (resolved: see runtime.ops.attention.resolve_backend);
            the KV cache is allocated for it.
        kv_spec: the cache to allocate (default the model's; the engine's kv_cache_dtype may
            make it a quantized one).
        peers: the runtime.engine.distributed.ProcessGroup of a mesh that spans processes: every
            device call below is sent to its workers first, which run the same on their shards.
    """

    def __init__(
        self, model: LoadedModel, mesh: Mesh, *, num_blocks: int, block_size: int, max_model_len: int,
        token_buckets: list[int], seq_buckets: list[int], max_logprobs: int, layerwise: bool = True,
        attention_backend: str = "xla", kv_spec: Any = None, peers: Any = None,
    ):
        self.peers = peers
        self.busy_since: float | None = None  # time.monotonic() of the dispatched step not collected yet
        if peers is not None:  # the workers build the same runner over their shards
            peers.call("build_runner", dict(
                tensor_parallel_size=mesh.shape["model"], data_parallel_size=mesh.shape["data"],
                num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                token_buckets=token_buckets, seq_buckets=seq_buckets, max_logprobs=max_logprobs,
                layerwise=layerwise, attention_backend=attention_backend, kv_spec=kv_spec))
        self.model = model
        self.mesh = mesh
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.token_buckets = token_buckets
        self.seq_buckets = seq_buckets
        self.num_logprobs = max(1, min(max_logprobs, model.vocab_size))
        kv_sharding = NamedSharding(mesh, model.kv_partition_spec)
        self.kv_cache = allocate_kv_cache(kv_spec or model.kv_spec, num_blocks, block_size, kv_sharding,
                                          attention_backend)
        kv_shardings = jax.tree.map(lambda a: a.sharding, self.kv_cache)  # with the cache's static fields
        # Logits come out replicated whichever way the step runs, so the sampler programs
        # compiled ahead of time for that sharding are the ones serving calls.
        self.replicated = NamedSharding(mesh, PartitionSpec())
        # With the C++ attention kernel, empty sequence slots cost nothing: the layer programs
        # then take every batch at the largest sequence bucket and compile once per token bucket;
        # the matmuls run on packed weights by the C++ kernel there too (runtime/ops/matmul.py).
        cpu_kernels = self.kv_cache.attention_backend == "cpu"
        self.layered = (LayeredStep(model, mesh, kv_shardings, seq_buckets[-1] if cpu_kernels else None,
                                    pack=cpu_kernels)
                        if layerwise and model.stages is not None else None)
        if self.layered is not None and self.layered.packed:
            self.token_buckets, self.seq_buckets = packed_weight_buckets(token_buckets, seq_buckets)
        self._step = jax.jit(model.step_fn, donate_argnums=(1,),
                             out_shardings=(self.replicated, kv_shardings))
        self.lora_targets = model.lora_targets if self._has_lora_slots() else None
        self._slot_writers: dict[Any, Any] = {}
        self.mask_words = mask_words(model.vocab_size)  # packed token-mask row of the logits' vocabulary
        self._sample = jax.jit(sample, static_argnames=("num_logprobs", "use_penalties", "cpu_kernel"))
        self.sample_kernel = _sample_kernel_usable(mesh)  # top-k / top-p cut by the C++ kernel
        self._compiling = BucketPrograms(self._lower)

    # -- LoRA slots ----------------------------------------------------------------------
    def _layers(self):
        return self.model.params[self.model.stages.layers_key if self.model.stages is not None else "layers"]

    def _has_lora_slots(self) -> bool:
        key = self.model.stages.layers_key if self.model.stages is not None else "layers"
        if not self.model.lora_targets or key not in self.model.params:
            return False  # the torchax path: no adapter slots
        layers = self._layers()
        return "lora" in (layers[0] if isinstance(layers, list) else layers)

    def write_lora_slot(self, slot: int, adapter) -> None:
        """Write an adapter (runtime.ops.lora.LoRAAdapter; None: zeros) into device slot `slot` of
        every layer's tables. Same shapes every time: nothing compiles after warmup."""
        layers = self._layers()
        for name in self.lora_targets:
            for j, ab in enumerate(("a", "b")):
                stacked = None if adapter is None else adapter.weights[name][j]  # [layers, ...]
                if isinstance(layers, list):  # one table per layer (runtime/ops/layered.py)
                    for i, lp in enumerate(layers):
                        table = lp["lora"][name][ab]
                        value = np.zeros(table.shape[1:], table.dtype) if stacked is None else stacked[i]
                        lp["lora"][name][ab] = self._slot_writer(table, 0)(table, np.int32(slot), value)
                else:  # stacked [layers, slots, ...]
                    table = layers["lora"][name][ab]
                    value = np.zeros(table.shape[:1] + table.shape[2:], table.dtype) if stacked is None else stacked
                    layers["lora"][name][ab] = self._slot_writer(table, 1)(table, np.int32(slot), value)

    def _slot_writer(self, table: jax.Array, axis: int):
        key = (table.shape, table.dtype, table.sharding, axis)
        if key not in self._slot_writers:
            def write(table, slot, value):
                return jax.lax.dynamic_update_index_in_dim(table, value.astype(table.dtype), slot, axis)
            self._slot_writers[key] = jax.jit(write, out_shardings=table.sharding)
        return self._slot_writers[key]

    # -- warmup --------------------------------------------------------------------------
    def bucket_pairs(self) -> list[tuple[int, int]]:
        """Every (tokens, seqs) bucket a step can use (a sequence has at least one token)."""
        return step_buckets(self.token_buckets, self.seq_buckets)

    def warmup(self, show_progress: bool = True, background: bool = False) -> float:
        """Compile (or load from the persistent cache) every program serving can call, then
        run one step and sampler of the largest bucket as a check. Returns the seconds taken.

        With `background`, only the largest bucket's programs are compiled before this returns;
        the rest compile on a background thread while the engine serves (see compile_programs)."""
        start = time.perf_counter()
        if self.peers is not None:  # the workers compile everything: every bucket is ready at once
            self.peers.call("compile")
            background = False
        later = self.compile_programs(show_progress, background=background)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            if self.lora_targets:
                self.write_lora_slot(1, None)  # compiles the slot writers (slot 1 is empty anyway)
            t, s = max(self.bucket_pairs())
            logits = self._run_step(self._padding_step_input(t, s))
            jax.block_until_ready(self._run_sample(logits, self._sampling_batch_padding(s, False),
                                                   use_penalties=False))
        if self.peers is not None:
            self.peers.call("mark_warm")  # the workers count compilations from here, as the engine does
        if later:
            self._compiling.start(later)
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
        pairs = self.bucket_pairs()
        largest = max(pairs)
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
                # The CPU backend cannot donate the KV cache; its lowering-time warning is noise.
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                futures = self._compiling.submit(first, pool, show_progress)
                for future in tqdm(as_completed(futures), total=len(futures), desc="servax: compiling programs",
                                   disable=not show_progress):
                    future.result()
        finally:
            pool.shutdown()
        if rest:  # one core left to serving
            self._compiling.pool = ThreadPoolExecutor(1, thread_name_prefix="servax-compile-background",
                                                      initializer=lower_thread_priority)
        return rest

    @property
    def compiling_in_background(self) -> bool:
        """Whether programs are still compiling in the background (steps may run padded to a
        larger bucket meanwhile)."""
        return not self._compiling.all_ready

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until no program compiles in the background; whether none does."""
        return self._compiling.wait(timeout)

    def _lower(self, key: tuple, seen: set) -> list:
        """The programs of ("step", tokens, seqs) or ("sampler", seqs, penalties), lowered
        (for a step, only those not shared with a bucket lowered before: see LayeredStep.lower)."""
        if key[0] == "sampler":
            return [self._lower_sampler(key[1], key[2])]
        return self._lower_step(self._padding_step_input(key[1], key[2]), seen)

    def step_seconds(self, num_tokens: int, context: int = 128, repeats: int = 3) -> float:
        """Median time of a compiled step plus greedy sampling of `num_tokens` single-token
        sequences with `context` tokens of context each (reads of the null block: cost, not
        results), from dispatch to results on the host; what a verification step costs. Waits
        for any programs still compiling in the background first."""
        self.wait_compiled()
        t_pad, s_pad = step_bucket(num_tokens, num_tokens, self.token_buckets, self.seq_buckets)
        n = num_tokens
        block_tables = np.zeros((s_pad, self.max_blocks_per_seq), np.int32)
        seq_lens = np.zeros(s_pad, np.int32)
        seq_lens[:n] = min(context, self.max_model_len - n) + np.arange(1, n + 1)
        query_start_loc = np.full(s_pad + 1, n, np.int32)
        query_start_loc[:n + 1] = np.arange(n + 1)
        positions = np.zeros(t_pad, np.int32)
        positions[:n] = seq_lens[:n] - 1
        batch = make_step_input(
            input_ids=np.zeros(t_pad, np.int32), positions=positions, slot_mapping=np.full(t_pad, -1, np.int32),
            block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
            logits_indices=np.minimum(np.arange(s_pad), n - 1).astype(np.int32), num_seqs=n, num_tokens=n,
            lora_slots=np.zeros(t_pad, np.int32) if self.lora_targets else None,
        )
        sb = self._sampling_batch_padding(s_pad, False)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = self._run_sample(self._run_step(batch), sb, use_penalties=False)
            jax.device_get(out.sampled)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def _lower_step(self, batch, seen: set | None = None) -> list:
        if self.layered is not None:
            return self.layered.lower(self.kv_cache, batch, seen)
        return [self._step.lower(self.model.params, self.kv_cache, batch)]

    def _lower_sampler(self, s: int, penalties: bool) -> Any:
        """The sampler of sequence bucket `s` with penalties or without (logits as the step
        leaves them)."""
        logits = jax.ShapeDtypeStruct((s, self.model.vocab_size), jnp.float32, sharding=self.replicated)
        return self._sample.lower(logits, self._sampling_batch_padding(s, penalties), num_logprobs=self.num_logprobs,
                                  use_penalties=penalties, cpu_kernel=self.sample_kernel)

    def _run_step(self, batch) -> jax.Array:
        """Enqueue the model's step on `batch`; the logits (the KV cache is updated)."""
        if self.peers is not None:
            self.peers.call("run_step", batch)
        if self.layered is not None:
            logits, self.kv_cache = self.layered(self.kv_cache, batch)
        else:
            logits, self.kv_cache = self._step(self.model.params, self.kv_cache, batch)
        return logits

    def _run_sample(self, logits: jax.Array, sb: SamplingBatch | dict[str, np.ndarray], **flags: bool) -> Any:
        """Enqueue the sampler on the step's logits; flags: use_penalties."""
        if isinstance(sb, SamplingBatch):
            sb = {f.name: getattr(sb, f.name) for f in dataclasses.fields(sb)}
        if self.peers is not None:
            self.peers.call("sample", sb, flags)
        return self._sample(logits, SamplingBatch(**sb), num_logprobs=self.num_logprobs,
                            cpu_kernel=self.sample_kernel, **flags)

    def _padding_step_input(self, t: int, s: int):
        return make_step_input(
            input_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
            slot_mapping=np.full(t, -1, np.int32),
            block_tables=np.zeros((s, self.max_blocks_per_seq), np.int32),
            seq_lens=np.zeros(s, np.int32), query_start_loc=np.zeros(s + 1, np.int32),
            logits_indices=np.zeros(s, np.int32), num_seqs=0, num_tokens=0,
            lora_slots=np.zeros(t, np.int32) if self.lora_targets else None,
        )

    def _sampling_batch_padding(self, s: int, penalties: bool) -> SamplingBatch:
        return SamplingBatch(**empty_sampling_batch(
            s, self.max_model_len if penalties else 1, self.mask_words, report=False))

    # -- one step ------------------------------------------------------------------------
    def dispatch(self, sched: SchedulerOutput, block_ids: dict[str, list[int]]) -> "InFlightStep":
        """Build the inputs and enqueue step + sampler on the device without waiting."""
        self.busy_since = time.monotonic()
        num_tokens = sched.num_scheduled_tokens
        num_rows = sched.num_slots
        use_penalties = any(e.request.sampling_params.uses_penalties for e in sched.scheduled)
        t_pad, s_pad = step_bucket(num_tokens, num_rows, self.token_buckets, self.seq_buckets)
        if not self._compiling.all_ready:  # programs still compiling in the background
            t_pad, s_pad = self._compiling.fitting_bucket(t_pad, s_pad, use_penalties, max(self.bucket_pairs()))
        bs = self.block_size

        input_ids = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        slot_mapping = np.full(t_pad, -1, np.int32)
        block_tables = np.zeros((s_pad, self.max_blocks_per_seq), np.int32)
        seq_lens = np.zeros(s_pad, np.int32)
        query_start_loc = np.zeros(s_pad + 1, np.int32)
        logits_indices = np.zeros(s_pad, np.int32)
        lora_slots = np.zeros(t_pad, np.int32) if self.lora_targets else None
        # Every batch ships the token mask (all ones where unconstrained): one sampler program
        # serves constrained and free batches alike.
        sb = empty_sampling_batch(s_pad, self.max_model_len if use_penalties else 1, self.mask_words, report=False)
        masked_rows = []  # (row, constraints, output token ids) of constrained requests

        sample_rows: list[list[int]] = []  # per scheduled request, the rows whose samples count
        prompt_rows: list[tuple[str, int, int]] = []  # (request id, row, prompt token index)
        t = row = 0
        for entry in sched.scheduled:
            req = entry.request
            c, n = entry.num_computed_tokens, entry.num_new_tokens
            table = np.asarray(block_ids[req.request_id], np.int32)
            pos = np.arange(c, c + n, dtype=np.int32)
            drafts = entry.draft_token_ids
            input_ids[t:t + n] = req.all_token_ids[c:c + n] + drafts
            positions[t:t + n] = pos
            slot_mapping[t:t + n] = table[pos // bs] * bs + pos % bs
            if lora_slots is not None:
                lora_slots[t:t + n] = req.lora_slot
            if entry.one_slot_per_token:
                rows = np.arange(row, row + n)
                block_tables[rows, :len(table)] = table
                seq_lens[rows] = pos + 1
                query_start_loc[row + 1:row + n + 1] = t + np.arange(1, n + 1)
                logits_indices[rows] = t + np.arange(n)
                for j in range(n):
                    target = c + j + 1  # the prompt token this row's logits predict
                    if req.num_prompt_logprobs < target < req.num_prompt_tokens:
                        sb["target_ids"][row + j] = req.prompt_token_ids[target]
                        sb["report"][row + j] = True
                        prompt_rows.append((req.request_id, row + j, target))
                    if drafts and j < n - 1:  # row j draws the token after drafts[:j]
                        self._fill_sampling_row(sb, row + j, req, drafts[:j])
                last = row + n - 1
                rows_sampled = list(range(row, row + n)) if drafts else [last]
                row += n
            else:
                block_tables[row, :len(table)] = table
                seq_lens[row] = c + n
                query_start_loc[row + 1] = t + n
                logits_indices[row] = t + n - 1
                last = row
                rows_sampled = [row]
                row += 1
            self._fill_sampling_row(sb, last, req, drafts)
            if req.token_constraints is not None:
                masked_rows.append((last, req.token_constraints, req.output_token_ids))
            sample_rows.append(rows_sampled)
            t += n
        query_start_loc[row + 1:] = t

        batch = make_step_input(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, block_tables=block_tables,
            seq_lens=seq_lens, query_start_loc=query_start_loc, logits_indices=logits_indices,
            num_seqs=row, num_tokens=t, lora_slots=lora_slots,
        )
        logits = self._run_step(batch)
        # Filled while the device runs the step (llguidance releases the GIL).
        fill_token_masks(sb["token_mask"], masked_rows)
        out = self._run_sample(logits, sb, use_penalties=use_penalties)
        return InFlightStep(sched, out, sample_rows, prompt_rows)

    def collect(self, step: "InFlightStep") -> RunnerOutput:
        """Wait for a dispatched step and bring its results to the host."""
        sched, sample_rows, prompt_rows = step.sched, step.sample_rows, step.prompt_rows
        out = jax.device_get(step.out)
        self.busy_since = None

        def result(r: int) -> RowResult:
            return RowResult(float(out.chosen_logprob[r]), int(out.chosen_rank[r]), out.top_ids[r], out.top_logprobs[r])

        sampled = [[int(out.sampled[r]) for r in rows] for rows in sample_rows]
        sample_logprobs = {
            e.request.request_id: [result(r) for r in rows]
            for e, rows in zip(sched.scheduled, sample_rows)
            if e.request.sampling_params.logprobs is not None
        }
        prompt_logprobs: dict[str, list[tuple[int, RowResult]]] = {}
        for rid, r, target in prompt_rows:
            prompt_logprobs.setdefault(rid, []).append((target, result(r)))
        return RunnerOutput(sampled, sample_logprobs, prompt_logprobs)

    def _fill_sampling_row(self, sb: dict[str, np.ndarray], r: int, req, drafts: list[int] = ()) -> None:
        """Row r samples the request's next token after its tokens and then `drafts` (the
        draft tokens before this row, when verifying a proposal)."""
        p = req.sampling_params
        sb["report"][r] |= p.logprobs is not None
        sb["temperature"][r] = p.temperature
        sb["top_k"][r] = p.top_k
        sb["top_p"][r] = p.top_p
        sb["min_p"][r] = p.min_p
        sb["seeds"][r] = req.sample_seed
        position = req.num_output_tokens + len(drafts)  # of the output token this row draws
        sb["steps"][r] = position
        bias = list(p.logit_bias.items()) + [(tok, _SUPPRESS) for tok in suppressed_token_ids(req, position)]
        if bias:
            bias = bias[:BIAS_WIDTH]
            sb["bias_ids"][r, :len(bias)] = [b[0] for b in bias]
            sb["bias_values"][r, :len(bias)] = [b[1] for b in bias]
        if p.uses_penalties:
            sb["presence_penalty"][r] = p.presence_penalty
            sb["frequency_penalty"][r] = p.frequency_penalty
            sb["repetition_penalty"][r] = p.repetition_penalty
            hist = (req.all_token_ids + list(drafts))[: self.max_model_len]
            sb["token_history"][r, :len(hist)] = hist
            sb["prompt_lens"][r] = req.num_prompt_tokens


def _sample_kernel_usable(mesh: Mesh) -> bool:
    """Whether the sampler cuts top-k / top-p with the C++ kernel: XLA:CPU, a one-device mesh
    (the kernel is not partitioned), and the kernels built (runtime.ops.attention_cpu)."""
    devices = mesh.devices.flat
    if mesh.devices.size != 1 or next(iter(devices)).platform != "cpu":
        return False
    from runtime.ops.attention_cpu import kernel_available

    return kernel_available()
