"""The synchronous engine core: add_request / step / abort_request.

    model = registry.load("servax-tiny/llama", mesh=runtime.ops.mesh.make_mesh(1))
    engine = Engine(EngineConfig(model="servax-tiny/llama", max_model_len=512), model)
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

The engine is handed a loaded model (it never goes looking for one: `app.LLM` and the
Serve deployment call registry.load). Startup sizes and allocates the paged KV cache and
precompiles every bucket. Not thread-safe: AsyncLLMEngine drives it from one thread;
`process_inputs` is the only part meant to run elsewhere.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from typing import Any, Callable

import jax
import numpy as np

from runtime.engine import distributed
from runtime.engine.compilation import CompileCounter, enable_persistent_cache
from runtime.engine.config import EngineConfig
from runtime.engine.errors import EngineOverloadedError, InvalidRequestError
from runtime.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from runtime.engine.introspection import EngineIntrospection
from runtime.engine.kv_cache_manager import KVCacheManager
from runtime.engine.kv_transfer import KVMover, add_request as add_kv_transfer_request
from runtime.engine.lora import LoRAManager
from runtime.engine.lora_request import LoRARequest
from runtime.engine.output_processor import OutputProcessor
from runtime.engine.outputs import RequestOutput
from runtime.engine.plan import make_plan
from runtime.engine.pooling import Pooler, PoolerConfig, PoolingParams, resolve_pooler, runner_of
from runtime.engine.programs import ModelPrograms
from runtime.engine.request import Request, RequestStatus
from runtime.engine.runner import AheadPolicy, InFlightStep, ModelRunner
from runtime.engine.sampling_params import SamplingParams
from runtime.engine.scheduler import Scheduler
from runtime.engine.speculative import DraftPolicy, SpeculativeConfig, candidate_draft_lengths
from runtime.ops.lora import LoRAError, add_lora_slots
from runtime.ops.mesh import make_mesh
from runtime.ops.pooling import pooling_epilogue
from runtime.ops.step import LoadedModel

logger = logging.getLogger("servax.engine")

# The sampling settings a pooling request's sequence carries (its rows are pooled, never sampled).
_PREFILL_ONLY = SamplingParams(max_tokens=1)


class Engine(EngineIntrospection):
    """Owns the scheduler, the KV cache and the model runner of one model.

    Args:
        config: the engine settings (`config.model` only names the model in logs).
        model: the loaded model (registry.load), its params placed on the mesh that
            `runtime.ops.mesh.make_mesh(config.tensor_parallel_size)` makes.

    Raises:
        ValueError: the settings cannot work (params on another mesh, KV cache too small
            for one sequence, max_model_len beyond the model's).
    """

    def __init__(self, config: EngineConfig, model: LoadedModel):
        t0 = time.perf_counter()
        self.config = config
        self.compilation_cache_dir = enable_persistent_cache(config.compilation_cache_dir)
        self.mesh = make_mesh(config.tensor_parallel_size, config.data_parallel_size)
        placed_on = {d for x in jax.tree.leaves(model.params) for d in x.sharding.device_set}
        if placed_on != set(self.mesh.devices.flat):
            raise ValueError(
                f"the model's params live on {len(placed_on)} device(s) but the engine's mesh has "
                f"{self.mesh.devices.size} (tensor_parallel_size={config.tensor_parallel_size}); load it with "
                "registry.load(..., mesh=runtime.ops.mesh.make_mesh(tensor_parallel_size))"
            )
        self.model = model
        self.tokenizer = model.tokenizer
        names = config.served_model_name
        self.served_model_name = (names if isinstance(names, str) else names[0]) if names else model.model_id
        self.max_model_len = config.max_model_len or model.max_model_len
        if self.max_model_len > model.max_model_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds what {model.model_id} supports "
                f"({model.max_model_len}); choose max_model_len <= {model.max_model_len}"
            )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                f"({config.max_num_batched_tokens} < {self.max_model_len})"
            )
        max_logprobs = model.vocab_size if config.max_logprobs == -1 else config.max_logprobs
        self.processor = InputProcessor(
            self.tokenizer, vocab_size=model.vocab_size, max_model_len=self.max_model_len,
            max_logprobs=max_logprobs, max_num_seqs=config.max_num_seqs,
            sampling_defaults=model.generation_config if config.generation_config != "vllm" else {},
            eos_token_ids=model.eos_token_ids,
        )
        self.peers = distributed.current_group()  # the workers of a mesh over several processes
        if self.peers is not None and config.enable_lora:
            raise ValueError("enable_lora is not supported on a multi-process engine yet (adapter slots are "
                             "written by the leader only); serve LoRA with tensor_parallel_size within one process")
        self.plan = make_plan(config, model, self.mesh, max_model_len=self.max_model_len,
                              multi_process=self.peers is not None)
        self.block_size, self.num_blocks, self.kv_spec = self.plan.block_size, self.plan.num_kv_blocks, self.plan.kv_spec
        self.kv = KVCacheManager(self.num_blocks, self.block_size, config.enable_prefix_caching,
                                 group_windows=self.kv_spec.groups.windows)
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill, speculative=config.speculative_config,
        )
        if config.enable_lora:
            try:
                add_lora_slots(model, max_loras=config.max_loras, max_rank=config.max_lora_rank, mesh=self.mesh)
            except LoRAError as e:
                raise ValueError(f"enable_lora: {e}") from e
        self.pooler = self._pooler(config, model)
        sizes = dict(max_model_len=self.max_model_len, max_logprobs=max_logprobs)
        if self.peers is None:
            pooled = None if self.pooler is None else pooling_epilogue(
                model.stages.epilogue, model.stages.hidden, self.pooler.pooling_type,
                self.pooler.classifier_token_ids)
            self.programs = ModelPrograms(model, self.mesh, self.plan, **sizes, pooled_epilogue=pooled)
        else:  # the workers build the same programs over their shards and repeat every device call
            self.programs = distributed.MirroredPrograms(self.peers, model, self.mesh, self.plan, **sizes, build=dict(
                tensor_parallel_size=config.tensor_parallel_size, data_parallel_size=config.data_parallel_size,
                plan=self.plan, **sizes))
        self.runner = ModelRunner(self.programs)
        can_run_ahead = (self.peers is None and self.programs.feeds_input_ids
                         and config.speculative_config is None)
        if config.async_scheduling and not can_run_ahead:
            raise ValueError("async_scheduling needs a one-process engine stepping its model layer by layer, "
                             "without speculative decoding or pooling; leave it unset (None) to use it where "
                             "it pays")
        self.ahead = AheadPolicy(config.async_scheduling, can_run_ahead)  # async scheduling (see step())
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            load = functools.partial(model.read_lora_adapter, max_rank=config.max_lora_rank)
            self.lora = LoRAManager(load, self.programs.write_lora_slot, max_loras=config.max_loras,
                                    max_cpu_loras=config.max_cpu_loras)
            self.scheduler.lora = self.lora
        self.compile_counter = CompileCounter()
        if config.enforce_eager:
            warmup_s = 0.0
            logger.warning("enforce_eager: no bucket is precompiled; each compiles on first use (debugging only)")
        else:
            with self.compile_counter.track():
                warmup_s = self.programs.warmup(config.show_progress)
        self.compile_counter.mark_warm()
        self.warmup_seconds = warmup_s
        spec = config.speculative_config
        if spec is not None and spec.adaptive_drafts and not config.enforce_eager:
            self.scheduler.draft_policy = self._measured_draft_policy(spec)  # (waits for every bucket)
        logger.info(
            "servax engine ready in %.1fs (warmup %.1fs, %d buckets%s): %s",
            time.perf_counter() - t0, warmup_s, len(self.plan.bucket_pairs),
            ", the others compiling in the background" if self.programs.compiling_in_background else "",
            self.model_config,
        )

        self.outputs = OutputProcessor(self.tokenizer)
        self._inflight: InFlightStep | None = None  # a step enqueued on the device, not yet collected
        # Called in step() just before the next step is scheduled (AsyncLLMEngine adds the
        # requests that arrived meanwhile here, so that they join that step, not the one after).
        self.before_schedule: Callable[[], None] | None = None
        self._rng = np.random.default_rng(config.seed)
        self._prompt_tokens = 0
        self.kv_transfer: KVMover | None = None  # P/D's block copier (enable_kv_transfer)
        self._iteration_tokens: collections.Counter[int] = collections.Counter()

    def _pooler(self, config: EngineConfig, model: LoadedModel) -> Pooler | None:
        """The pooler of a pooling engine (runner "pooling", or auto on an embedding or
        classification model), None for a generating one.

        Raises:
            ValueError: pooling this model or with these settings is not supported."""
        if runner_of(config.runner, config.convert, model.hf_config) != "pooling":
            if config.convert in ("embed", "classify") or config.pooler_config:
                raise ValueError(f"convert / pooler_config need runner='pooling' (runner={config.runner!r})")
            return None
        if model.stages is None or model.stages.hidden is None:
            raise ValueError(
                f"runner='pooling': {model.model_id} ({model.impl}) does not expose its final hidden states; "
                "pooling is served by the native Llama-family models (Llama, Mistral, Qwen2, Qwen3: "
                "Qwen3-Embedding, Qwen3-Reranker), not by the torchax fallback (a BERT-style encoder is not "
                "supported)")
        if not self.plan.layered:
            raise ValueError("runner='pooling' steps the model layer by layer; drop layered=False")
        if self.peers is not None:
            raise ValueError("runner='pooling' is not supported on a multi-process engine yet")
        pooler = resolve_pooler(convert=config.convert, pooler_config=PoolerConfig.of(config.pooler_config),
                                hf_config=model.hf_config, tokenizer=model.tokenizer,
                                hidden_size=int(model.hf_config.hidden_size))
        logger.info("pooling runner: task %s, %s pooling%s", pooler.task, pooler.pooling_type,
                    f", classifier tokens {pooler.classifier_token_ids}" if pooler.classifier_token_ids else "")
        return pooler

    def _measured_draft_policy(self, spec: SpeculativeConfig) -> DraftPolicy:
        """Time verification steps of each candidate draft length against a one-token step
        (compiled already), so that drafts are proposed only where they pay (DraftPolicy)."""
        room = min(self.config.max_num_seqs, self.config.max_num_batched_tokens) - 1
        lengths = [k for k in candidate_draft_lengths(spec.num_speculative_tokens) if k <= room]
        rounds: dict[int, list[float]] = {n: [] for n in [1] + [1 + k for k in lengths]}
        with self.compile_counter.track():
            for _ in range(5):  # alternating, so that a slow moment does not bias one length
                for n, times in rounds.items():
                    times.append(self.programs.step_seconds(n, repeats=1))
        one = float(np.median(rounds[1]))
        cost = {k: max(1.0, float(np.median(rounds[1 + k])) / one) for k in lengths}
        logger.info("n-gram speculation: a step verifying k drafts costs %s one-token steps (%.1f ms)",
                    ", ".join(f"k={k}: {c:.2f}" for k, c in cost.items()), one * 1e3)
        return DraftPolicy(spec.num_speculative_tokens, cost)

    # -- admission -----------------------------------------------------------------------
    def process_inputs(
        self, request_id: str, prompt: PromptType, params: SamplingParams | dict[str, Any] | None = None,
        *, arrival_time: float | None = None, num_pending: int = 0, enforce_queue_limit: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Validate and tokenize a request without touching the scheduler (any thread).

        Raises:
            InvalidRequestError: bad prompt or sampling params (.param names the field).
            PromptTooLongError: prompt + 1 token does not fit max_model_len.
            EngineOverloadedError: the waiting queue is full.
        """
        if isinstance(params, PoolingParams):
            if self.pooler is None:
                raise InvalidRequestError(
                    f"model {self.served_model_name!r} runs runner='generate': it serves no embeddings or scores "
                    "(start it with runner='pooling')", param="model")
            params = self.pooler.check(params, self.served_model_name)
            processed = self.processor.process_pooling(request_id, prompt, params, arrival_time=arrival_time)
        else:
            processed = self.processor.process(request_id, prompt, params, arrival_time=arrival_time)
        if lora_request is not None:
            processed.lora_request = self.check_lora_request(lora_request)
        # Requests that the next step starts (free running slots) are not queued: a burst of
        # max_num_seqs + max_queue_size requests on an idle engine is all admitted.
        free_slots = max(0, self.config.max_num_seqs - self.scheduler.num_running)
        queued = self.scheduler.num_waiting + num_pending - free_slots
        if enforce_queue_limit and queued >= self.config.max_queue_size:
            raise EngineOverloadedError(
                f"{self.config.max_num_seqs - free_slots} requests are running and {queued} waiting "
                f"(max_num_seqs={self.config.max_num_seqs}, max_queue_size={self.config.max_queue_size}); retry later"
            )
        return processed

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | dict[str, Any] | None = None,
        arrival_time: float | None = None, lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request (raises as process_inputs, or on a duplicate id).

        lora_request: generate with this LoRA adapter (needs enable_lora; read on first use).
        """
        self.add_processed(self.process_inputs(request_id, prompt, params, arrival_time=arrival_time,
                                               lora_request=lora_request))

    # -- LoRA adapters -------------------------------------------------------------------
    def check_lora_request(self, lora_request: LoRARequest) -> LoRARequest:
        """The adapter, read and validated (any thread). Raises InvalidRequestError saying why not."""
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}",
                                      param="lora_request")
        if self.lora is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (start it with enable_lora=True)",
                                      param="lora_request")
        for other in list(self.lora.registered.values()):
            if other.lora_name == lora_request.lora_name and other.lora_int_id != lora_request.lora_int_id:
                self.remove_lora(other.lora_int_id)  # the name was loaded again from elsewhere: replace it
        try:
            self.lora.add(lora_request)
        except LoRAError as e:
            raise InvalidRequestError(str(e), param="lora_request") from e
        return lora_request

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and register an adapter ahead of its requests (vLLM's LLMEngine.add_lora)."""
        self.check_lora_request(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (vLLM's remove_lora). False if unknown; raises InvalidRequestError while in use."""
        if self.lora is None or lora_int_id not in self.lora.registered:
            return False
        try:
            self.lora.remove(lora_int_id, self.scheduler.adapters_in_use()
                             | {r.lora_request.lora_int_id for r in self.scheduler.waiting if r.lora_request})
        except LoRAError as e:
            raise InvalidRequestError(str(e), param="lora_name") from e
        return True

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters (vLLM's list_loras returns their ids)."""
        return [] if self.lora is None else list(self.lora.registered.values())

    def add_processed(self, req: ProcessedRequest) -> None:
        """Queue a request that process_inputs built (raises InvalidRequestError on a duplicate id)."""
        if req.request_id in self.outputs.states:
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use", param="request_id")
        params = req.params
        if req.kv_transfer is not None:  # P/D: a prefill that exports its KV, or a decode that imports it
            add_kv_transfer_request(self, req)
            return
        if isinstance(params, PoolingParams):
            self._add_pooling(req)
            return
        state = self.outputs.add_request(req.request_id, req.prompt, req.prompt_token_ids, params)
        eos = tuple(self.model.eos_token_ids)
        for i in range(params.n):
            child_id = req.request_id if params.n == 1 else f"{req.request_id}#{i}"
            if params.seed is not None:
                seed = (params.seed + i * 0x9E3779B1) % 2**32
            else:
                seed = int(self._rng.integers(2**32))
            child = Request(
                child_id, req.prompt_token_ids, params, eos_token_ids=eos, block_size=self.block_size,
                max_model_len=self.max_model_len, sample_seed=seed, parent_id=req.request_id, index=i,
                arrival_time=req.arrival_time,
                token_constraints=req.constraints.start() if req.constraints is not None else None,
                lora_request=req.lora_request,
            )
            child.wants_prompt_logprobs = child.wants_prompt_logprobs and i == 0
            state.child_ids.append(child_id)
            self.scheduler.add_request(child)
        self._prompt_tokens += len(req.prompt_token_ids)
        if self.lora is not None:
            self.lora.count_request(req.lora_request)

    def _add_pooling(self, req: ProcessedRequest) -> None:
        """Queue a pooling request: one prefill-only sequence (its sampling settings unused)."""
        state = self.outputs.add_pooling_request(req.request_id, req.prompt, req.prompt_token_ids, req.params,
                                                 self.pooler)
        state.child_ids.append(req.request_id)
        self.scheduler.add_request(Request(
            req.request_id, req.prompt_token_ids, _PREFILL_ONLY, eos_token_ids=(), block_size=self.block_size,
            max_model_len=self.max_model_len, sample_seed=0, arrival_time=req.arrival_time,
            lora_request=req.lora_request, pooling_params=req.params,
        ))
        self._prompt_tokens += len(req.prompt_token_ids)
        if self.lora is not None:
            self.lora.count_request(req.lora_request)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests and free their blocks; returns their final snapshots (unknown ids ignored)."""
        request_ids = [request_ids] if isinstance(request_ids, str) else request_ids
        outs = []
        for rid in request_ids:
            if self.kv_transfer is not None:  # a P/D export left before its reader's abort came: nobody takes it
                self.kv_transfer.discard(rid)
            state = self.outputs.abort_request(rid)
            if state is None:
                continue
            for i, child_id in enumerate(state.child_ids):
                if self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED) is not None:
                    state.finish_child(i, "abort", None)
            outs.append(state.snapshot())
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.outputs.states)

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every scheduled request by one model step; returns snapshots of those that moved.

        Schedule, run, collect, update. Pipelined: as soon as a step's tokens are on the host
        and the scheduler has them, the next step is scheduled and enqueued on the device, and
        only then is this step's output processed (OutputProcessor: detokenization, stop
        strings, snapshots), so that host
        work overlaps device work. A request that a stop string ends was already part of
        the next step; that step's token for it is dropped.

        With async scheduling (vLLM's), the next step is scheduled and enqueued before this
        one's tokens are on the host: the scheduler counts them as pending (Scheduler.advance),
        the next step reads them on the device as its input ids, and they get their values
        when they arrive (Scheduler.settle). The device then never waits for the host between
        steps. A token an EOS or stop token ends a request with was computed for nothing
        (dropped, like a stop string's). Steps whose next tokens the host must know first
        (drafts, grammars, penalties) run as above, and by default so do long ones (AheadPolicy).
        """
        chained = self._inflight is not None  # dispatched by the last call: the engine was not idle
        if not chained:
            self._inflight = self._dispatch_next()
            if self._inflight is None:
                return []
        inflight, self._inflight = self._inflight, None
        ahead = self.ahead.wanted and self.kv_transfer is None and self.scheduler.can_run_ahead(inflight.sched)
        if ahead:
            self.scheduler.advance(inflight.sched)
            if self.before_schedule is not None:
                self.before_schedule()
            self._inflight = self._dispatch_next(prev=inflight)
        with self.compile_counter.track():
            result = self.runner.collect(inflight)
        self.ahead.observe(chained)
        self.outputs.add_prompt_logprobs(result, self.scheduler.requests)
        pooled = self.outputs.process_pooled(result.pooled, self.scheduler.requests) if result.pooled else []
        if ahead:
            advanced = self.scheduler.settle(inflight.sched, result.sampled)
        else:
            advanced = self.scheduler.update_from_output(inflight.sched, result.sampled)
            if self.before_schedule is not None:
                self.before_schedule()
            self._inflight = self._dispatch_next()
        outs, stopped = self.outputs.process(advanced, result)
        for request, decision in stopped:  # by a stop string
            self.scheduler.finish_request(request.request_id, decision.status, decision.reason)
        return outs + pooled if pooled else outs

    def _dispatch_next(self, prev: InFlightStep | None = None) -> InFlightStep | None:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return None
        self._iteration_tokens[sched.num_scheduled_tokens] += 1
        block_ids = {e.request.request_id: self.kv.block_tables(e.request.request_id) for e in sched.scheduled}
        with self.compile_counter.track():
            return self.runner.dispatch(sched, block_ids, prev)

    # -- prefill/decode disaggregation -----------------------------------------------------
    def enable_kv_transfer(self) -> KVMover:
        """Let requests export their prompt's KV blocks (prefill) or start from imported ones
        (decode): compiles the block copies now, as warmup does. See runtime/engine/kv_transfer.py.

        Raises:
            ValueError: a multi-process engine (its cache lives on several processes)."""
        if self.kv_transfer is None:
            if self.peers is not None:
                raise ValueError("prefill/decode disaggregation needs a one-process engine")
            max_blocks = self.kv_spec.groups.blocks_per_seq(self.max_model_len, self.block_size,
                                                            self.config.max_num_batched_tokens)
            self.kv_transfer = KVMover(self.programs, self.kv, max_blocks, self.compile_counter)
            self.scheduler.kv_mover = self.kv_transfer
        return self.kv_transfer

    def shutdown(self) -> None:
        """Stop the worker processes of a multi-process engine (nothing to do for one process)."""
        if self.peers is not None:
            self.peers.shutdown()
            self.peers = None
