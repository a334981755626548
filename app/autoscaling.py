"""Autoscaling on LLM signals: replicas by the engines' waiting queue, KV-cache usage and time to
first token, not by ongoing requests.

    deployment_config:
      autoscaling_config:
        min_replicas: 1
        max_replicas: 4
        upscale_delay_s: 10          # Serve's delays and factors apply as to its own policy
        downscale_delay_s: 60
        metrics_interval_s: 1        # how often replicas report (record_autoscaling_stats)
        look_back_period_s: 5        # the window each signal is averaged over
        policy:
          policy_function: app.autoscaling:LLMSignalPolicy
          policy_kwargs: {target_num_waiting: 2, target_kv_cache_usage: 0.8, target_ttft_s: 1.0}

Why: an engine batches continuously, so ongoing requests say little about how loaded it is. A
few long conversations can fill its KV cache (new requests then wait, or running ones are
preempted) while the ongoing count stays far below any sensible `target_ongoing_requests`;
many short requests can be ongoing on an engine that keeps up. What the user feels is the
waiting queue and time to first token, and KV usage is where it starts.

Each LLMServer replica reports `num_waiting`, `kv_cache_usage` and `ttft_s` (the mean time to
first token of its requests that finished in the last 30 s) through Serve's
`record_autoscaling_stats`; Serve averages each over `look_back_period_s`. The policy's
pressure is the largest of mean/target over the signals that have a target; above 1 it asks for
ceil(replicas x pressure) replicas, below `downscale_below` for one fewer, else as many as now.
Serve then applies `upscale_delay_s` / `downscale_delay_s`, the scaling factors and the
replica bounds, as it does for its own policy.
"""

from __future__ import annotations

import math
from typing import Any

SIGNALS = ("num_waiting", "kv_cache_usage", "ttft_s")  # what LLMServer.record_autoscaling_stats reports


class LLMSignalPolicy:
    """A Serve autoscaling policy (`policy_function` of `autoscaling_config.policy`) on the
    engines' signals (see the module).

    Args (policy_kwargs; a target of None leaves that signal out):
        target_num_waiting: requests waiting in each engine's queue (default 2).
        target_kv_cache_usage: share of each engine's KV cache held by requests (default 0.8).
        target_ttft_s: mean time to first token, seconds (default None: not used).
        downscale_below: a pressure under which one replica goes (default 0.5).

    Raises:
        ValueError: a target that is not positive, or no target at all.
    """

    def __init__(self, target_num_waiting: float | None = 2.0, target_kv_cache_usage: float | None = 0.8,
                 target_ttft_s: float | None = None, downscale_below: float = 0.5):
        self.targets = {"num_waiting": target_num_waiting, "kv_cache_usage": target_kv_cache_usage,
                        "ttft_s": target_ttft_s}
        for name, target in self.targets.items():
            if target is not None and not target > 0:
                raise ValueError(f"LLMSignalPolicy: target for {name} must be > 0, got {target!r}")
        if all(t is None for t in self.targets.values()):
            raise ValueError("LLMSignalPolicy: set at least one of target_num_waiting, target_kv_cache_usage, "
                             "target_ttft_s")
        self.downscale_below = downscale_below

    def pressure(self, metrics: dict[str, dict[Any, float]], replicas: list[Any]) -> dict[str, float]:
        """Each signal's mean over the running replicas that reported it, over its target."""
        out = {}
        for name, target in self.targets.items():
            values = [float(v) for r, v in (metrics.get(name) or {}).items() if r in replicas and v is not None]
            if target is not None and values:
                out[name] = (sum(values) / len(values)) / target
        return out

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """(desired replicas, policy state) for Serve's AutoscalingContext `ctx`."""
        current = ctx.current_num_replicas
        if current == 0:  # Serve's cold start path brings the first one
            return ctx.target_num_replicas, ctx.policy_state
        ratios = self.pressure(ctx.aggregated_metrics or {}, list(ctx.running_replicas))
        pressure = max(ratios.values(), default=0.0)
        if pressure > 1.0:
            desired = max(current + 1, math.ceil(current * pressure))
        elif pressure < self.downscale_below:
            desired = current - 1
        else:
            desired = current
        desired = min(max(desired, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
        state = dict(ctx.policy_state)
        state["servax_pressure"] = {k: round(v, 3) for k, v in ratios.items()}
        return desired, state
