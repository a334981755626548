"""Autoscaling on LLM signals (#44) on a real cluster: two copies of one model under the same load,
one with app.autoscaling:LLMSignalPolicy, one with Serve's default policy on ongoing requests.
The load (3 long conversations at a time) fills the KV cache while the ongoing-request count stays
far below `target_ongoing_requests`: the LLM-signal copy gains a replica, Serve's default does
not, and the LLM-signal copy gives it back once the load stops."""

from __future__ import annotations

import threading
import time

import pytest

AUTOSCALE_YAML = """
applications:
- name: llmscale
  route_prefix: /
  import_path: app.builder:build_openai_app
  args:
    llm_configs:
    - model_loading_config: {model_id: signals, model_source: servax-tiny/llama}
      engine_kwargs: &engine {max_model_len: 512, max_num_seqs: 8, max_num_batched_tokens: 128, num_kv_blocks: 40,
                              show_progress: false, enforce_eager: true}  # a quick second replica: no precompiling
      deployment_config:
        ray_actor_options: {num_cpus: 0.25}
        autoscaling_config: &scaling
          min_replicas: 1
          max_replicas: 2
          target_ongoing_requests: 8
          upscale_delay_s: 2
          downscale_delay_s: 4
          metrics_interval_s: 0.5
          look_back_period_s: 2
          policy:
            policy_function: app.autoscaling:LLMSignalPolicy
            policy_kwargs: {target_num_waiting: 2, target_kv_cache_usage: 0.6}
    - model_loading_config: {model_id: ongoing, model_source: servax-tiny/llama}
      engine_kwargs: *engine
      deployment_config:
        ray_actor_options: {num_cpus: 0.25}
        autoscaling_config: {min_replicas: 1, max_replicas: 2, target_ongoing_requests: 8, upscale_delay_s: 2,
                             downscale_delay_s: 4, metrics_interval_s: 0.5, look_back_period_s: 2}
"""


@pytest.mark.slow  # quick, but this issue keeps one test in the quick loop (tests/test_kv_routing.py)
def test_llm_signal_policy_scales_on_the_largest_signal_over_its_target():
    """The decision alone, on a hand-made context: KV pressure adds replicas, calm removes one."""
    from types import SimpleNamespace

    from app.autoscaling import LLMSignalPolicy

    policy = LLMSignalPolicy(target_num_waiting=2, target_kv_cache_usage=0.5)

    def ctx(kv: float, waiting: float, replicas: int = 2):
        ids = [f"r{i}" for i in range(replicas)]
        return SimpleNamespace(current_num_replicas=replicas, target_num_replicas=replicas, running_replicas=ids,
                               aggregated_metrics={"kv_cache_usage": dict.fromkeys(ids, kv),
                                                   "num_waiting": dict.fromkeys(ids, waiting)},
                               capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={})

    assert policy(ctx(kv=0.95, waiting=0))[0] == 4  # 0.95 / 0.5 = 1.9 x 2 replicas
    assert policy(ctx(kv=0.3, waiting=3))[0] == 3  # 1.5 x 2
    assert policy(ctx(kv=0.4, waiting=1))[0] == 2  # under the targets, over half of them: stay
    assert policy(ctx(kv=0.1, waiting=0))[0] == 1  # calm: one fewer
    with pytest.raises(ValueError, match="at least one"):
        LLMSignalPolicy(target_num_waiting=None, target_kv_cache_usage=None)


def _replicas(deployment: str) -> int:
    from ray import serve

    for app in serve.status().applications.values():
        if deployment in app.deployments:
            return app.deployments[deployment].replica_states.get("RUNNING", 0)
    return 0


@pytest.mark.slow
@pytest.mark.cluster
def test_kv_pressure_adds_a_replica_where_ongoing_requests_do_not_and_both_scale_back(tmp_path):
    import httpx

    from conftest import serve_run

    config = tmp_path / "llmscale.yaml"
    config.write_text(AUTOSCALE_YAML)
    with serve_run(config, tmp_path, models=("signals", "ongoing")) as run:
        assert _replicas("LLMServer:signals") == _replicas("LLMServer:ongoing") == 1
        stop, statuses, lock = threading.Event(), [], threading.Lock()

        def client(model: str, i: int) -> None:  # a long conversation: ~27 of the 39 blocks each
            prompt = f"conversation {i}: " + "the river runs past the stone and the cloud " * 8
            with httpx.Client(base_url=run.base_url, timeout=120) as http:
                while not stop.is_set():
                    r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 250,
                                                           "ignore_eos": True})
                    with lock:
                        statuses.append(r.status_code)

        threads = [threading.Thread(target=client, args=(m, i), daemon=True)
                   for m in ("signals", "ongoing") for i in range(3)]
        for t in threads:
            t.start()
        t0 = time.time()
        try:
            while _replicas("LLMServer:signals") < 2:
                assert time.time() - t0 < 120, "no second `signals` replica after 120 s of KV pressure"
                time.sleep(0.5)
            up_s = time.time() - t0
            time.sleep(6)  # Serve's default has had longer than its upscale delay to react
            ongoing_replicas = _replicas("LLMServer:ongoing")
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        assert ongoing_replicas == 1, "Serve's default policy scaled on 3 ongoing requests against a target of 8"
        t1 = time.time()
        while _replicas("LLMServer:signals") > 1:
            assert time.time() - t1 < 120, "still two `signals` replicas 120 s after the load ended"
            time.sleep(0.5)
        print(f"\nLLM-signal policy: 2 replicas {up_s:.1f} s into the load, back to 1 {time.time() - t1:.1f} s "
              f"after it; Serve's default: {ongoing_replicas} replica {up_s + 6:.0f} s into the load; "
              f"{len(statuses)} requests")
        assert statuses and set(statuses) == {200}, sorted(set(statuses))
