"""What a model replica publishes about itself: engine stats, routing and autoscaling signals, metrics.

`ReplicaStats` is a base of app.llm_server.LLMServerImpl: Serve asks its deployments for
`record_routing_stats` (read by app.kv_routing.KVAwareRouter) and `record_autoscaling_stats`
(read by app.autoscaling.LLMSignalPolicy); the ingress asks for `stats` and `metric_families`.
Every answer is as of the engine's last step, read on the replica's event loop without waiting
for the step under way.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from app.kv_routing import STATS_KEY


class ReplicaStats:
    """The stats methods of a replica; the class it is mixed into sets `engine` (the
    AsyncLLMEngine), `metrics` (app.metrics.ServerMetrics), and `_kv_cursor, _kv_hashes = -1, set()`
    (the engine's cached block hashes as `record_routing_stats` last read them)."""

    engine: Any
    metrics: Any
    _kv_cursor: int
    _kv_hashes: set[int]

    def metric_families(self) -> list[Any]:
        """This replica's Prometheus metric families (for the ingress' GET /metrics)."""
        self._update_gauges()
        return self.metrics.prom.families()

    def stats(self) -> dict[str, Any]:
        """The engine's EngineStats as a dict (running/waiting, KV blocks, ...) as of the end of
        its last step: never waits for the step under way (the engine loop would hand its lock
        over only between steps, and this runs on the replica's event loop)."""
        s = self.engine.latest_stats()
        return asdict(s) if hasattr(s, "__dataclass_fields__") else dict(vars(s))

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve hands this deployment's routers every `request_routing_stats_period_s`
        (app.kv_routing.KVAwareRouter reads it): the engine's cached block hashes, mirrored from
        its block-hash event feed (only what changed since the last call is read), its queue
        and KV usage, its block size, its tokenizer's folder and its adapters' ids."""
        events = self.engine.block_hash_events(self._kv_cursor)
        if events.reset:
            self._kv_hashes = set()
        self._kv_hashes.difference_update(events.removed)
        self._kv_hashes.update(events.stored)
        self._kv_cursor = events.cursor
        stats = self.engine.latest_stats()
        tokenizer = self.engine.tokenizer
        return {STATS_KEY: dict(
            version=events.cursor, block_hashes=list(self._kv_hashes),
            block_size=int(self.engine.model_config["block_size"]),
            tokenizer=getattr(tokenizer, "name_or_path", None) if tokenizer is not None else None,
            num_waiting=stats.num_waiting, num_running=stats.num_running, kv_cache_usage=stats.kv_cache_usage,
            num_requests_finished=stats.num_requests_finished, adapters=self._adapter_ids(),
        )}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's signals for app.autoscaling.LLMSignalPolicy (Serve asks every
        `metrics_interval_s` of an autoscaling deployment): requests waiting, KV-cache usage, and
        the mean time to first token of the last 30 s (0 when none finished)."""
        stats = self.engine.latest_stats()
        return dict(num_waiting=float(stats.num_waiting), kv_cache_usage=float(stats.kv_cache_usage),
                    ttft_s=self.metrics.recent_ttft_s() or 0.0)

    def _adapter_ids(self) -> dict[str, int]:
        """The adapters the engine has read, name -> lora_int_id, read without its lock (advisory:
        a list changing under the read is read again at the next call)."""
        try:
            return {r.lora_name: r.lora_int_id for r in list(self.engine.engine.list_loras())}
        except RuntimeError:
            return {}

    def _update_gauges(self) -> None:
        # As of the last step: runs on the replica's event loop after every request, where waiting
        # for the step under way would stall every other stream (and a stuck step, health checks).
        try:
            self.metrics.update_engine_gauges(self.engine.latest_stats())
        except Exception:  # stats are advisory; never fail a request or a health check over them
            pass
