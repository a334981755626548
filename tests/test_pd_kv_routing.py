"""KV-aware routing on the prefill side of P/D (#44): on a real local cluster, 1 decode + 2
prefill replicas of the tiny Llama, the prefill deployment routed by app.kv_routing:KVAwareRouter,
beside a colocated app. Each later turn of a chat is prefilled on the replica holding its earlier
turns' blocks, and the answers are the colocated replica's."""

from __future__ import annotations

import random
import time

import httpx
import pytest
from test_pd import COLOCATED_APP, ENGINE, MODEL, WORDS

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

PD_KV_YAML = f"""
applications:
- name: pd
  route_prefix: /
  import_path: app.builder:build_pd_openai_app
  args:
    prefill_config:
      model_loading_config: {{model_id: {MODEL}}}
      engine_kwargs: {ENGINE}
      deployment_config:
        num_replicas: 2
        ray_actor_options: {{num_cpus: 0.25}}
        request_router_config:
          request_router_class: app.kv_routing:KVAwareRouter
          request_routing_stats_period_s: 0.3
    decode_config:
      model_loading_config: {{model_id: {MODEL}}}
      engine_kwargs: {ENGINE}
      deployment_config: {{num_replicas: 1, ray_actor_options: {{num_cpus: 0.25}}}}
""" + COLOCATED_APP


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from test_pd import serve_beside_colocated

    yield from serve_beside_colocated(tmp_path_factory, "pd_kv", PD_KV_YAML)


def prefill_replicas() -> dict[str, dict]:
    """Each prefill replica's pd_stats, by replica id (asked through the handle until both answered)."""
    from ray import serve

    handle = serve.get_deployment_handle(f"Prefill:{MODEL.replace('/', '--')}", app_name="pd")
    seen: dict[str, dict] = {}
    for _ in range(60):
        stats = handle.pd_stats.remote().result()
        seen[stats["replica"]] = stats
        if len(seen) == 2:
            return seen
    raise AssertionError(f"60 calls reached only {sorted(seen)}")


def chat(run, messages: list[dict]) -> tuple[str, int]:
    """The P/D app's reply (checked against the colocated app's) and its prompt's token count."""
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    pd = httpx.post(f"{run.base_url}/v1/chat/completions", json=body, timeout=120)
    colocated = httpx.post(f"{run.base_url}/colocated/v1/chat/completions", json=body, timeout=120)
    assert pd.status_code == colocated.status_code == 200, (pd.text, colocated.text)
    assert pd.json()["choices"][0]["message"] == colocated.json()["choices"][0]["message"]
    return pd.json()["choices"][0]["message"]["content"], pd.json()["usage"]["prompt_tokens"]


def test_kv_router_prefills_each_later_turn_on_the_replica_holding_the_earlier_turns(run):
    """3 chats x 3 turns: turn 1 goes where load sends it; turns 2 and 3 are prefilled on that
    replica, whose prefix-cache hits grow by the earlier prompt's blocks, while the other's do
    not (a load-only router would split them half and half)."""
    rng = random.Random(0)
    chat(run, [{"role": "user", "content": "warm up"}])
    time.sleep(1.5)  # the replicas have published their caches; the routers have read the tokenizer
    for c in range(3):
        messages = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(40))}]
        holder, previous_prompt = None, 0
        for turn in range(3):
            before = prefill_replicas()
            reply, prompt_tokens = chat(run, messages)
            after = prefill_replicas()
            served = [r for r in after if after[r]["num_requests_finished"] > before[r]["num_requests_finished"]]
            assert len(served) == 1, (c, turn, served)
            hits = {r: after[r]["prefix_cache_hits"] - before[r]["prefix_cache_hits"] for r in after}
            if turn == 0:
                holder = served[0]
            else:
                assert served == [holder], f"chat {c} turn {turn + 1} was prefilled away from its blocks"
                # The blocks of the previous prompt but its last (where the template differs).
                assert hits[holder] >= (previous_prompt // 16 - 1) * 16 > 0, (c, turn, hits)
                assert all(n == 0 for r, n in hits.items() if r != holder), (c, turn, hits)
            previous_prompt = prompt_tokens
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(8))}]
            time.sleep(1.0)  # published: the router's index decides, not only its memory of where it sent
