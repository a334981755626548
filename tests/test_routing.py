"""Prefix-aware routing on a real cluster: two replicas of one model behind servax's
PrefixCacheAffinityRouter and two behind Serve's default router, the same multi-turn chat
workload (each turn resends the conversation): the prefix cache hit rate with the router
beats the default's, read from the responses' cached-token counts."""

from __future__ import annotations

import random

import pytest

from app.routing import PrefixIndex

ROUTING_YAML = """
applications:
- name: routing
  route_prefix: /
  import_path: app.builder:build_openai_app
  args:
    llm_configs:
    - model_loading_config: {model_id: affinity, model_source: servax-tiny/llama}
      engine_kwargs: &engine {max_model_len: 512, max_num_seqs: 8, max_num_batched_tokens: 128, num_kv_blocks: 256,
                              show_progress: false}
      deployment_config:
        num_replicas: 2
        ray_actor_options: {num_cpus: 0.25}
        request_router_config: {request_router_class: "app.routing:PrefixCacheAffinityRouter"}
    - model_loading_config: {model_id: default, model_source: servax-tiny/llama}
      engine_kwargs: *engine
      deployment_config: {num_replicas: 2, ray_actor_options: {num_cpus: 0.25}}
"""


def test_prefix_index_matches_the_longest_chain_and_forgets():
    index = PrefixIndex(chunk_chars=4, max_keys=6)
    a, b = "replica-a", "replica-b"
    index.insert("abcdefghijkl", a)
    index.insert("abcdXXXX", b)
    assert index.match("abcdefgh and more", {a, b}) == (8, {a})
    assert index.match("abcdXXXXYYYY", {a, b}) == (8, {b})
    assert index.match("abcd", {a, b}) == (4, {a, b})
    assert index.match("zzzzabcd", {a, b}) == (0, set())
    assert index.least_loaded({a, b}) == {b}  # holds 8 characters against 12
    index.insert("0123456789ab", b)  # 3 more keys: the least recently used go
    assert len(index._owners) == 6 and index.match("abcdefghijkl", {a, b})[0] < 12
    index.remove(b)
    assert index.match("0123", {a, b}) == (0, set())


def conversations(n: int, turns: int, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    words = "alpha beta gamma delta river stone cloud forest paper window garden silver".split()
    return [[" ".join(rng.choice(words) for _ in range(rng.randint(6, 10))) for _ in range(turns)]
            for _ in range(n)]


@pytest.mark.cluster
def test_prefix_router_raises_the_hit_rate_of_multi_turn_chats(tmp_path):
    from conftest import openai_client, serve_run

    config = tmp_path / "routing.yaml"
    config.write_text(ROUTING_YAML)
    chats = conversations(12, turns=4)
    with serve_run(config, tmp_path, models=("affinity", "default")) as run:
        client = openai_client(run.base_url)
        rates = {}
        for model in ("affinity", "default"):
            cached = prompt = 0
            for turn in range(4):
                for chat in chats:
                    messages = []
                    for said in chat[:turn + 1]:
                        messages += [{"role": "user", "content": said}, {"role": "assistant", "content": "noted: " + said[:24]}]
                    reply = client.chat.completions.create(model=model, messages=messages[:-1], max_tokens=2,
                                                           temperature=0)
                    if turn:  # the first turn has nothing to hit
                        prompt += reply.usage.prompt_tokens
                        cached += reply.usage.prompt_tokens_details.cached_tokens
            rates[model] = cached / prompt
    print(f"\nprefix cache hit rate, turns 2-4 of 12 chats on 2 replicas: {rates}")
    assert rates["affinity"] > rates["default"] + 0.15, rates
    assert rates["affinity"] > 0.45, rates  # near what block-aligned history can hit
