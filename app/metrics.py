"""Serve metrics of one LLMServer replica (exported by Ray on its metrics port).

Names are vLLM's with servax's prefix (Ray adds `ray_` on export, and the deployment,
replica and application tags; we add `model_id`):

| metric | kind | what |
|---|---|---|
| servax_time_to_first_token_seconds | histogram | arrival to first token |
| servax_time_per_output_token_seconds | histogram | mean gap between later tokens, per request |
| servax_e2e_request_latency_seconds | histogram | arrival to finish |
| servax_prompt_tokens_total / servax_generation_tokens_total | counter | tokens in / out |
| servax_request_success_total{finished_reason} | counter | finished requests: stop, length, abort |
| servax_num_requests_running / servax_num_requests_waiting | gauge | the engine's batch and queue |
| servax_kv_cache_usage_perc | gauge | share of KV blocks in use (0..1) |
| servax_prefix_cache_queries_total / servax_prefix_cache_hits_total | counter | prompt tokens looked up / found |
| servax_num_preemptions_total | counter | sequences preempted for lack of KV blocks |
| servax_spec_decode_num_drafts_total / _num_draft_tokens_total / _num_accepted_tokens_total | counter | n-gram speculation: verification steps with a proposal, tokens proposed, tokens accepted |

Metrics are best-effort: outside a Ray worker (local testing mode, plain unit tests)
recording to Ray is a no-op.

The same figures are also kept in a prometheus_client registry per replica under vLLM's
exact names with servax's prefix (`servax:time_to_first_token_seconds`,
`servax:prompt_tokens_total`, ... labelled `model_name`), which the ingress serves at
`GET /metrics` on the HTTP port (`ServerMetrics.families`, `render_families`), so a
Prometheus job or a dashboard made for vLLM scrapes servax by changing the prefix.
With LoRA adapters that endpoint also has `servax:lora_adapters_loaded`, `servax:lora_slot_loads`
and `servax:lora_requests{lora_name}` (requests per adapter so far); with speculation,
`servax:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
`servax:spec_decode_num_accepted_tokens_per_pos{position}` (vLLM's acceptance counters).
"""

from __future__ import annotations

import logging
from typing import Any

import prometheus_client as prom
from prometheus_client.core import Metric

logger = logging.getLogger("ray.serve")

_LATENCY_BOUNDARIES = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0]
# Engine counters mirrored into Serve counters: EngineStats field -> metric attribute.
_ENGINE_COUNTERS = {"prefix_cache_queries": "prefix_queries", "prefix_cache_hits": "prefix_hits",
                    "num_preemptions": "preemptions", "spec_decode_num_drafts": "spec_drafts",
                    "spec_decode_num_draft_tokens": "spec_draft_tokens",
                    "spec_decode_num_accepted_tokens": "spec_accepted_tokens"}


class ServerMetrics:
    """Counters, histograms and gauges of one model's replica."""

    def __init__(self, model_id: str, enabled: bool = True):
        self._tags = {"model_id": model_id}
        self._engine_totals = dict.fromkeys(_ENGINE_COUNTERS, 0)
        self.prom = PrometheusMetrics(model_id)
        self.enabled = False
        if not enabled:
            return
        try:
            from ray.serve import metrics as m

            keys = ("model_id",)
            self.ttft = m.Histogram("servax_time_to_first_token_seconds", "Time to first token.",
                                    boundaries=_LATENCY_BOUNDARIES, tag_keys=keys)
            self.tpot = m.Histogram("servax_time_per_output_token_seconds", "Time per output token after the first.",
                                    boundaries=_LATENCY_BOUNDARIES, tag_keys=keys)
            self.e2e = m.Histogram("servax_e2e_request_latency_seconds", "Request latency.",
                                   boundaries=_LATENCY_BOUNDARIES, tag_keys=keys)
            self.prompt_tokens = m.Counter("servax_prompt_tokens_total", "Prompt tokens processed.", tag_keys=keys)
            self.generation_tokens = m.Counter("servax_generation_tokens_total", "Tokens generated.", tag_keys=keys)
            self.request_success = m.Counter("servax_request_success_total", "Finished requests by finish reason.",
                                             tag_keys=("model_id", "finished_reason"))
            self.num_running = m.Gauge("servax_num_requests_running", "Requests in the running batch.", tag_keys=keys)
            self.num_waiting = m.Gauge("servax_num_requests_waiting", "Requests waiting.", tag_keys=keys)
            self.kv_usage = m.Gauge("servax_kv_cache_usage_perc", "Share of KV blocks in use (0..1).", tag_keys=keys)
            self.prefix_queries = m.Counter("servax_prefix_cache_queries_total",
                                            "Prompt tokens looked up in the prefix cache.", tag_keys=keys)
            self.prefix_hits = m.Counter("servax_prefix_cache_hits_total",
                                         "Prompt tokens found in the prefix cache.", tag_keys=keys)
            self.preemptions = m.Counter("servax_num_preemptions_total", "Sequences preempted.", tag_keys=keys)
            self.spec_drafts = m.Counter("servax_spec_decode_num_drafts_total", "Speculative verification steps "
                                         "of requests with a proposal.", tag_keys=keys)
            self.spec_draft_tokens = m.Counter("servax_spec_decode_num_draft_tokens_total", "Draft tokens proposed.",
                                               tag_keys=keys)
            self.spec_accepted_tokens = m.Counter("servax_spec_decode_num_accepted_tokens_total",
                                                  "Draft tokens accepted.", tag_keys=keys)
            self.enabled = True
        except Exception as e:  # no Ray worker, or an older Ray: serve without metrics
            logger.debug("servax metrics disabled: %s", e)

    def _record(self, fn, *args: Any, **kwargs: Any) -> None:
        if not self.enabled:
            return
        try:
            fn(*args, **kwargs)
        except Exception as e:
            self.enabled = False
            logger.debug("servax metrics disabled after error: %s", e)

    def observe_request(self, *, ttft_s: float | None, e2e_s: float, prompt_tokens: int,
                        generation_tokens: int, finish_reason: str | None) -> None:
        """Record one finished (or aborted) request."""
        self.prom.observe_request(ttft_s=ttft_s, e2e_s=e2e_s, prompt_tokens=prompt_tokens,
                                  generation_tokens=generation_tokens, finish_reason=finish_reason)
        if not self.enabled:
            return
        tags = self._tags
        if ttft_s is not None:
            self._record(self.ttft.observe, ttft_s, tags)
            if generation_tokens > 1:
                self._record(self.tpot.observe, (e2e_s - ttft_s) / (generation_tokens - 1), tags)
        self._record(self.e2e.observe, e2e_s, tags)
        if prompt_tokens:
            self._record(self.prompt_tokens.inc, prompt_tokens, tags)
        if generation_tokens:
            self._record(self.generation_tokens.inc, generation_tokens, tags)
        self._record(self.request_success.inc, 1, {**tags, "finished_reason": str(finish_reason)})

    def update_engine_gauges(self, stats: Any) -> None:
        """Copy the engine's point-in-time stats (runtime EngineStats) into gauges and counters."""
        deltas = {}
        for field in _ENGINE_COUNTERS:
            total = getattr(stats, field, 0)
            deltas[field], self._engine_totals[field] = total - self._engine_totals[field], total
        self.prom.update_engine(stats, deltas)
        if not self.enabled:
            return
        tags = self._tags
        self._record(self.num_running.set, stats.num_running, tags)
        self._record(self.num_waiting.set, stats.num_waiting, tags)
        self._record(self.kv_usage.set, stats.kv_cache_usage, tags)
        for field, attr in _ENGINE_COUNTERS.items():
            if deltas[field] > 0:
                self._record(getattr(self, attr).inc, deltas[field], tags)


class PrometheusMetrics:
    """One replica's metrics in its own prometheus_client registry, under vLLM's names."""

    def __init__(self, model_name: str):
        prom.disable_created_metrics()  # as vLLM: no `_created` series beside each counter
        self.registry = prom.CollectorRegistry(auto_describe=True)
        self._labels = {"model_name": model_name}
        r, keys = self.registry, ["model_name"]
        self.ttft = prom.Histogram("servax:time_to_first_token_seconds", "Time to first token in seconds.",
                                   keys, buckets=_LATENCY_BOUNDARIES, registry=r)
        self.tpot = prom.Histogram("servax:time_per_output_token_seconds", "Time per output token in seconds.",
                                   keys, buckets=_LATENCY_BOUNDARIES, registry=r)
        self.e2e = prom.Histogram("servax:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                                  keys, buckets=_LATENCY_BOUNDARIES, registry=r)
        self.prompt_tokens = prom.Counter("servax:prompt_tokens", "Prefill tokens processed.", keys, registry=r)
        self.generation_tokens = prom.Counter("servax:generation_tokens", "Generation tokens processed.", keys,
                                              registry=r)
        self.request_success = prom.Counter("servax:request_success", "Finished requests by finished_reason.",
                                            keys + ["finished_reason"], registry=r)
        self.num_running = prom.Gauge("servax:num_requests_running", "Requests in the running batch.", keys,
                                      registry=r)
        self.num_waiting = prom.Gauge("servax:num_requests_waiting", "Requests waiting.", keys, registry=r)
        self.kv_usage = prom.Gauge("servax:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.", keys,
                                   registry=r)
        self.engine_counters = {
            "prefix_cache_queries": prom.Counter("servax:prefix_cache_queries", "Prompt tokens looked up in the "
                                                 "prefix cache.", keys, registry=r),
            "prefix_cache_hits": prom.Counter("servax:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                              keys, registry=r),
            "num_preemptions": prom.Counter("servax:num_preemptions", "Sequences preempted.", keys, registry=r),
            "spec_decode_num_drafts": prom.Counter("servax:spec_decode_num_drafts", "Number of spec decoding drafts.",
                                                   keys, registry=r),
            "spec_decode_num_draft_tokens": prom.Counter("servax:spec_decode_num_draft_tokens",
                                                         "Number of draft tokens.", keys, registry=r),
            "spec_decode_num_accepted_tokens": prom.Counter("servax:spec_decode_num_accepted_tokens",
                                                            "Number of accepted tokens.", keys, registry=r),
        }
        self.spec_accepted_per_pos = prom.Counter("servax:spec_decode_num_accepted_tokens_per_pos",
                                                  "Accepted tokens per draft position.", keys + ["position"],
                                                  registry=r)
        self._accepted_per_pos: list[int] = []
        self.lora_loaded = prom.Gauge("servax:lora_adapters_loaded", "LoRA adapters read into the engine.", keys,
                                      registry=r)
        self.lora_slot_loads = prom.Gauge("servax:lora_slot_loads", "LoRA adapter writes into device slots so far.",
                                          keys, registry=r)
        self.lora_requests = prom.Gauge("servax:lora_requests", "Requests per LoRA adapter so far.",
                                        keys + ["lora_name"], registry=r)

    def observe_request(self, *, ttft_s: float | None, e2e_s: float, prompt_tokens: int,
                        generation_tokens: int, finish_reason: str | None) -> None:
        labels = self._labels
        if ttft_s is not None:
            self.ttft.labels(**labels).observe(ttft_s)
            if generation_tokens > 1:
                self.tpot.labels(**labels).observe((e2e_s - ttft_s) / (generation_tokens - 1))
        self.e2e.labels(**labels).observe(e2e_s)
        self.prompt_tokens.labels(**labels).inc(prompt_tokens)
        self.generation_tokens.labels(**labels).inc(generation_tokens)
        self.request_success.labels(**labels, finished_reason=str(finish_reason)).inc()

    def update_engine(self, stats: Any, deltas: dict[str, int]) -> None:
        labels = self._labels
        self.num_running.labels(**labels).set(stats.num_running)
        self.num_waiting.labels(**labels).set(stats.num_waiting)
        self.kv_usage.labels(**labels).set(stats.kv_cache_usage)
        for field, counter in self.engine_counters.items():
            if deltas[field] > 0:
                counter.labels(**labels).inc(deltas[field])
        per_pos = getattr(stats, "spec_decode_accepted_per_position", [])
        for pos, total in enumerate(per_pos):
            before = self._accepted_per_pos[pos] if pos < len(self._accepted_per_pos) else 0
            if total > before:
                self.spec_accepted_per_pos.labels(**labels, position=str(pos)).inc(total - before)
        self._accepted_per_pos = list(per_pos)
        if getattr(stats, "lora_adapters_loaded", 0) or getattr(stats, "lora_requests", None):
            self.lora_loaded.labels(**labels).set(stats.lora_adapters_loaded)
            self.lora_slot_loads.labels(**labels).set(stats.lora_slot_loads)
            for name, count in stats.lora_requests.items():
                self.lora_requests.labels(**labels, lora_name=name).set(count)

    def families(self) -> list[Metric]:
        """The registry's metric families (picklable), for the ingress to merge and render."""
        return list(self.registry.collect())


def render_families(per_replica: list[list[Metric]]) -> bytes:
    """One Prometheus text exposition of several replicas' families (same names merged)."""
    merged: dict[str, Metric] = {}
    for families in per_replica:
        for family in families:
            if family.name in merged:
                merged[family.name].samples.extend(family.samples)
            else:
                merged[family.name] = family

    class _Merged:
        def collect(self):
            return list(merged.values())

    registry = prom.CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return prom.generate_latest(registry)
