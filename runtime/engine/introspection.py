"""What an engine tells about itself: its settings, its counters, its health, its prefix-cache keys.

`EngineIntrospection` is the part of `core.Engine` that only reads the engine's state (the
scheduler, the KV cache manager, the output processor, the worker group); `Engine` inherits it,
so callers keep asking the engine (`engine.stats()`, `engine.check_health()`). `EngineStats` is
the point-in-time view that app/metrics.py exports.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from runtime.engine import distributed
from runtime.engine.block_pool import BlockHashEvents
from runtime.engine.errors import EngineDeadError


@dataclasses.dataclass
class EngineStats:
    """A point-in-time view of the engine (counters are totals since startup)."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_cache_usage: float  # share of usable KV blocks held by requests
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found cached
    prefix_cache_hit_rate: float
    prompt_tokens_total: int
    generation_tokens_total: int
    num_requests_finished: int
    num_preemptions: int
    compilations_since_warmup: int
    lora_adapters_loaded: int = 0  # adapters read and registered (enable_lora)
    lora_slot_loads: int = 0  # adapter writes into a device slot
    lora_requests: dict[str, int] = dataclasses.field(default_factory=dict)  # adapter name -> requests so far
    # n-gram speculation (speculative_config): vLLM's spec-decode counters.
    spec_decode_num_drafts: int = 0  # verification steps of requests with a proposal
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    # Tokens computed by a step (prompt and generated) -> steps so far: vLLM's iteration_tokens_total.
    iteration_tokens: dict[int, int] = dataclasses.field(default_factory=dict)
    # A mesh over several processes (runtime/engine/distributed.py): host inputs sent to each worker.
    num_processes: int = 1
    distributed_calls: int = 0
    distributed_bytes_sent: int = 0


class EngineIntrospection:
    """The read-only views of an engine (mixed into `core.Engine`, whose __init__ sets the state read here)."""

    @property
    def model_config(self) -> dict[str, Any]:
        """The settings the engine runs with, as decided at startup (model, mesh, KV blocks, buckets)."""
        return dict(
            model_id=self.model.model_id, impl=self.model.impl, dtype=str(np.dtype(self.model.kv_spec.dtype)),
            max_model_len=self.max_model_len, vocab_size=self.model.vocab_size,
            devices=[str(d) for d in self.mesh.devices.flat], mesh=dict(self.mesh.shape),
            kv_blocks=self.num_blocks, block_size=self.block_size,
            attention_backend=self.plan.attention_backend,
            token_buckets=list(self.plan.token_buckets), seq_buckets=list(self.plan.seq_buckets),
            max_num_seqs=self.config.max_num_seqs, max_num_batched_tokens=self.config.max_num_batched_tokens,
            served_model_name=self.served_model_name,
            runner="generate" if self.pooler is None else "pooling",
            **({} if self.pooler is None else dict(pooling_task=self.pooler.task,
                                                   pooling_type=self.pooler.pooling_type)),
            enable_prefix_caching=self.config.enable_prefix_caching,
            compilation_cache_dir=self.compilation_cache_dir, warmup_seconds=round(self.warmup_seconds, 2),
        )

    def block_hash_events(self, since: int = -1) -> BlockHashEvents:
        """The prefix-cache block hashes cached and evicted since cursor `since` (-1: all cached
        now, as a reset): what a KV-aware router mirrors per replica, and what a prefill/decode
        pair would read to learn which blocks a prefill left behind. Keys are
        runtime.engine.request.prefix_block_hashes(prompt ids, block_size, lora_int_id) values.
        Any thread (the pool guards its log), never waits for a step."""
        return self.kv.block_hash_events(since)

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker process of a multi-process engine has failed, or a
        step has run longer than distributed_timeout_s (a worker hangs). Any thread."""
        if self.peers is None:
            return
        try:
            self.peers.check()
        except distributed.DistributedError as e:
            raise EngineDeadError(str(e)) from e
        since = self.runner.busy_since
        if since is not None and time.monotonic() - since > self.peers.timeout_s:
            raise EngineDeadError(
                f"a step of the {self.peers.num_processes}-process engine has not finished in "
                f"{time.monotonic() - since:.0f}s (distributed_timeout_s={self.peers.timeout_s:g}): a worker hangs"
            )

    def stats(self) -> EngineStats:
        """The engine's counters and occupancy now (between steps: the engine is not thread-safe)."""
        total, free = self.kv.num_usable_blocks, self.kv.num_free_blocks
        prefix, spec = self.kv.prefix_cache_stats, self.scheduler.spec_stats
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_blocks_total=total, kv_blocks_used=total - free, kv_blocks_free=free,
            kv_cache_usage=self.kv.usage, prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits,
            prefix_cache_hit_rate=prefix.hit_rate, prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self.outputs.generation_tokens, num_requests_finished=self.outputs.num_finished,
            num_preemptions=self.scheduler.num_preemptions,
            compilations_since_warmup=self.compile_counter.since_warmup,
            spec_decode_num_drafts=spec.num_drafts, spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_accepted_per_position=list(spec.accepted_per_position),
            iteration_tokens=dict(self._iteration_tokens),
            **({} if self.peers is None else dict(
                num_processes=self.peers.num_processes, distributed_calls=self.peers.calls,
                distributed_bytes_sent=self.peers.bytes_sent)),
            **({} if self.lora is None else dict(
                lora_adapters_loaded=len(self.lora.registered), lora_slot_loads=self.lora.num_loads,
                lora_requests=dict(self.lora.requests_per_adapter))),
        )
