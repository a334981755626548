"""Metrics of one LLMServer replica, declared once in `METRICS` and exposed twice.

Each row of `METRICS` (name, kind, help, extra labels, buckets) makes:

- a Ray Serve metric `servax_<name>` tagged `model_id` (Ray adds `ray_` on export, and the
  deployment, replica and application tags), exported on Ray's metrics port; a no-op outside
  a Ray worker (local testing mode, plain unit tests);
- a prometheus_client metric `servax:<name>` labelled `model_name` in the replica's own
  registry, which the ingress serves at `GET /metrics` on the HTTP port (`families`,
  `render_families`); beside it, the same values under vLLM's own name and labels
  (`vllm:<name>{model_name, engine="0"}`), so that vLLM's dashboards and alerts read servax
  unchanged (rows without a vLLM counterpart, such as the LoRA ones, are servax's only).

Counters are named without `_total`; both clients append it on export
(`servax:prompt_tokens_total`, `ray_servax_prompt_tokens_total`). Rows marked `http_only`
are on the HTTP endpoint only (LoRA adapters, speculation per draft position).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, Literal

import prometheus_client as prom
from prometheus_client.core import Metric

logger = logging.getLogger("ray.serve")

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """One metric: its name without prefix, kind, help text, labels beside the model's,
    histogram buckets, and its vLLM name ("": the same; None: vLLM has none)."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    http_only: bool = False
    vllm: str | None = ""


METRICS = (
    MetricSpec("time_to_first_token_seconds", "histogram", "Time from arrival to the first token, in seconds.",
               buckets=LATENCY_BUCKETS),
    MetricSpec("time_per_output_token_seconds", "histogram",
               "Mean time between the tokens after the first, per request, in seconds.", buckets=LATENCY_BUCKETS,
               vllm="request_time_per_output_token_seconds"),
    MetricSpec("e2e_request_latency_seconds", "histogram", "Time from arrival to finish, in seconds.",
               buckets=LATENCY_BUCKETS),
    # Where a request's time goes, in order (#44): Serve's router and handle, the replica before
    # the engine, the engine's queue, its prefill, its decode.
    MetricSpec("request_routing_time_seconds", "histogram",
               "From the ingress handing the request to its Serve handle to the replica starting it (Serve's "
               "router, the handle, Ray's transport, the replica's own queue), in seconds.", buckets=LATENCY_BUCKETS,
               vllm=None),
    MetricSpec("request_frontend_time_seconds", "histogram",
               "In the replica before the engine: chat template, tokenization, validation, in seconds.",
               buckets=LATENCY_BUCKETS, vllm=None),
    MetricSpec("request_queue_time_seconds", "histogram", "In the engine's waiting queue, in seconds.",
               buckets=LATENCY_BUCKETS),
    MetricSpec("request_prefill_time_seconds", "histogram",
               "From first scheduled to the first token (the prompt's chunks, then sampling), in seconds.",
               buckets=LATENCY_BUCKETS),
    MetricSpec("request_decode_time_seconds", "histogram", "From the first token to the last, in seconds.",
               buckets=LATENCY_BUCKETS),
    MetricSpec("prompt_tokens", "counter", "Prompt tokens processed."),
    MetricSpec("generation_tokens", "counter", "Tokens generated."),
    MetricSpec("request_success", "counter", "Finished requests by finish reason (stop, length, abort).",
               labels=("finished_reason",)),
    MetricSpec("num_requests_running", "gauge", "Requests in the running batch."),
    MetricSpec("num_requests_waiting", "gauge", "Requests waiting to run."),
    MetricSpec("kv_cache_usage_perc", "gauge", "Share of KV-cache blocks in use (1 means 100 percent)."),
    MetricSpec("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."),
    MetricSpec("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache."),
    MetricSpec("num_preemptions", "counter", "Sequences preempted for lack of KV blocks."),
    MetricSpec("spec_decode_num_drafts", "counter", "Speculative verification steps of requests with a proposal."),
    MetricSpec("spec_decode_num_draft_tokens", "counter", "Draft tokens proposed."),
    MetricSpec("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted."),
    MetricSpec("spec_decode_num_accepted_tokens_per_pos", "counter", "Draft tokens accepted per draft position.",
               labels=("position",), http_only=True),
    MetricSpec("iteration_tokens_total", "histogram", "Tokens computed per engine step (prompt and generated).",
               buckets=ITERATION_TOKENS_BUCKETS),
    MetricSpec("lora_adapters_loaded", "gauge", "LoRA adapters read into the engine.", http_only=True, vllm=None),
    MetricSpec("lora_slot_loads", "gauge", "LoRA adapter writes into device slots so far.", http_only=True, vllm=None),
    MetricSpec("lora_requests", "gauge", "Requests per LoRA adapter so far.", labels=("lora_name",), http_only=True,
               vllm=None),
)
_RECORD = {"counter": "inc", "gauge": "set", "histogram": "observe"}  # the method that records a value
# Engine counters (EngineStats fields of the same names), exported as increments.
ENGINE_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "spec_decode_num_drafts",
                   "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


class PrometheusMetrics:
    """The replica's metrics in its own prometheus_client registry: `servax:<name>{model_name}`
    and, for the rows vLLM has, `vllm:<its name>{model_name, engine}`."""

    def __init__(self, model_name: str):
        prom.disable_created_metrics()  # as vLLM: no `_created` series beside each counter
        self.registry = prom.CollectorRegistry(auto_describe=True)
        self._model = model_name
        kinds = {"counter": prom.Counter, "gauge": prom.Gauge, "histogram": prom.Histogram}
        self._metrics: dict[str, list[Any]] = {}
        for spec in METRICS:
            extra = {"buckets": spec.buckets} if spec.kind == "histogram" else {}
            make = kinds[spec.kind]
            ours = make(f"servax:{spec.name}", spec.help, ["model_name", *spec.labels], registry=self.registry, **extra)
            self._metrics[spec.name] = [ours.labels]
            if spec.vllm is not None:  # one engine per replica: vLLM's engine index 0
                vllm = make(f"vllm:{spec.vllm or spec.name}", spec.help, ["model_name", "engine", *spec.labels],
                            registry=self.registry, **extra)
                self._metrics[spec.name].append(lambda vllm=vllm, **labels: vllm.labels(engine="0", **labels))

    def record(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        for series in self._metrics[spec.name]:
            getattr(series(model_name=self._model, **labels), _RECORD[spec.kind])(value)

    def families(self) -> list[Metric]:
        """The registry's metric families (picklable), for the ingress to merge and render."""
        return list(self.registry.collect())


class RayMetrics:
    """The replica's metrics as Ray Serve metrics (`servax_<name>{model_id}`); `enabled` is False
    where Ray's metrics cannot be made (no Ray worker, an older Ray) or once recording failed."""

    def __init__(self, model_id: str, enabled: bool = True):
        self._model = model_id
        self._metrics: dict[str, Any] = {}
        self.enabled = False
        if not enabled:
            return
        try:
            from ray.serve import metrics as m

            for spec in METRICS:
                if spec.http_only:
                    continue
                name, tags = f"servax_{spec.name}", ("model_id", *spec.labels)
                if spec.kind == "histogram":
                    self._metrics[spec.name] = m.Histogram(name, spec.help, boundaries=list(spec.buckets),
                                                           tag_keys=tags)
                else:
                    cls = m.Counter if spec.kind == "counter" else m.Gauge
                    self._metrics[spec.name] = cls(name + ("_total" if spec.kind == "counter" else ""), spec.help,
                                                   tag_keys=tags)
            self.enabled = True
        except Exception as e:  # no Ray worker, or an older Ray: serve without Ray's metrics
            logger.debug("servax metrics disabled: %s", e)

    def record(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        if not self.enabled or spec.http_only or (spec.kind == "counter" and value <= 0):
            return  # Ray's counters refuse increments of zero
        metric, tags = self._metrics[spec.name], {"model_id": self._model, **labels}
        try:
            getattr(metric, _RECORD[spec.kind])(value, tags)
        except Exception as e:
            self.enabled = False
            logger.debug("servax metrics disabled after error: %s", e)


_SPECS = {spec.name: spec for spec in METRICS}


class ServerMetrics:
    """What a replica records (finished requests, the engine's stats), sent to both expositions.

    Args:
        model_id: the model's name (Ray's `model_id` tag, Prometheus' `model_name` label).
        enabled: export through Ray too (LLMConfig.log_engine_metrics); the HTTP endpoint's
            registry is kept either way.
    """

    def __init__(self, model_id: str, enabled: bool = True):
        self.prom = PrometheusMetrics(model_id)
        self.ray = RayMetrics(model_id, enabled)
        self._engine_totals = dict.fromkeys(ENGINE_COUNTERS, 0)
        self._accepted_per_pos: list[int] = []
        self._iteration_tokens: dict[int, int] = {}
        self._recent_ttft: collections.deque[tuple[float, float]] = collections.deque(maxlen=256)  # (when, s)

    def recent_ttft_s(self, window_s: float = 30.0) -> float | None:
        """Mean time to first token of the requests that finished in the last `window_s` (None: none)."""
        since = time.monotonic() - window_s
        recent = [ttft for when, ttft in list(self._recent_ttft) if when >= since]
        return sum(recent) / len(recent) if recent else None

    @property
    def enabled(self) -> bool:
        """Whether Ray's metrics are exported."""
        return self.ray.enabled

    def _record(self, name: str, value: float, **labels: str) -> None:
        spec = _SPECS[name]
        self.prom.record(spec, value, labels)
        self.ray.record(spec, value, labels)

    def observe_routing(self, seconds: float) -> None:
        """Record a request's time from the ingress' handle call to this replica."""
        self._record("request_routing_time_seconds", max(0.0, seconds))

    def observe_request(self, *, ttft_s: float | None, e2e_s: float, prompt_tokens: int,
                        generation_tokens: int, finish_reason: str | None,
                        phases: dict[str, float] | None = None) -> None:
        """Record one finished (or aborted) request; `ttft_s` is None when it generated nothing.
        `phases`: seconds of the phases it went through (frontend, queue, prefill, decode)."""
        for phase, seconds in (phases or {}).items():
            self._record(f"request_{phase}_time_seconds", max(0.0, seconds))
        if ttft_s is not None:
            self._record("time_to_first_token_seconds", ttft_s)
            self._recent_ttft.append((time.monotonic(), ttft_s))
            if generation_tokens > 1:
                self._record("time_per_output_token_seconds", (e2e_s - ttft_s) / (generation_tokens - 1))
        self._record("e2e_request_latency_seconds", e2e_s)
        self._record("prompt_tokens", prompt_tokens)
        self._record("generation_tokens", generation_tokens)
        self._record("request_success", 1, finished_reason=str(finish_reason))

    def update_engine_gauges(self, stats: Any) -> None:
        """Copy the engine's point-in-time stats (runtime EngineStats) into gauges and counters."""
        self._record("num_requests_running", stats.num_running)
        self._record("num_requests_waiting", stats.num_waiting)
        self._record("kv_cache_usage_perc", stats.kv_cache_usage)
        for name in ENGINE_COUNTERS:
            total = getattr(stats, name, 0)
            delta, self._engine_totals[name] = total - self._engine_totals[name], total
            if delta > 0:
                self._record(name, delta)
        per_pos = getattr(stats, "spec_decode_accepted_per_position", [])
        for pos, total in enumerate(per_pos):
            before = self._accepted_per_pos[pos] if pos < len(self._accepted_per_pos) else 0
            if total > before:
                self._record("spec_decode_num_accepted_tokens_per_pos", total - before, position=str(pos))
        self._accepted_per_pos = list(per_pos)
        steps = getattr(stats, "iteration_tokens", {})  # tokens per step -> steps so far
        for tokens, total in steps.items():
            for _ in range(total - self._iteration_tokens.get(tokens, 0)):
                self._record("iteration_tokens_total", tokens)
        self._iteration_tokens = dict(steps)
        if getattr(stats, "lora_adapters_loaded", 0) or getattr(stats, "lora_requests", None):
            self._record("lora_adapters_loaded", stats.lora_adapters_loaded)
            self._record("lora_slot_loads", stats.lora_slot_loads)
            for name, count in stats.lora_requests.items():
                self._record("lora_requests", count, lora_name=name)


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
