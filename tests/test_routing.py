"""Scale-out on a real cluster (one `serve run`): two replicas of one model behind servax's
PrefixCacheAffinityRouter and two behind Serve's default router on the same multi-turn chat
workload (each turn resends the conversation): the prefix cache hit rate with the router beats
the default's, read from the responses' cached-token counts; a replica killed under load costs
503s, not hangs; Serve's own queue limit (max_queued_requests) is a 429; a model with an
autoscaling_config gains a replica under load and gives it back after."""

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
    - model_loading_config: {model_id: narrow, model_source: servax-tiny/llama}
      engine_kwargs: *engine
      deployment_config: {max_ongoing_requests: 1, max_queued_requests: 1, ray_actor_options: {num_cpus: 0.25}}
    - model_loading_config: {model_id: elastic, model_source: servax-tiny/llama}
      engine_kwargs: {max_model_len: 512, max_num_seqs: 8, max_num_batched_tokens: 128, num_kv_blocks: 256,
                      show_progress: false, enforce_eager: true}  # a quick second replica: no precompiling
      deployment_config:
        max_ongoing_requests: 8
        ray_actor_options: {num_cpus: 0.25}
        autoscaling_config: {min_replicas: 1, max_replicas: 2, target_ongoing_requests: 2, upscale_delay_s: 1,
                             downscale_delay_s: 3, metrics_interval_s: 0.5, look_back_period_s: 1}
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


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import serve_run

    folder = tmp_path_factory.mktemp("routing")
    config = folder / "routing.yaml"
    config.write_text(ROUTING_YAML)
    with serve_run(config, folder, models=("affinity", "default", "narrow", "elastic")) as served:
        yield served


@pytest.mark.slow
@pytest.mark.cluster
def test_prefix_router_raises_the_hit_rate_of_multi_turn_chats(run):
    from conftest import openai_client

    chats = conversations(12, turns=4)
    client = openai_client(run.base_url)
    rates = {}
    for model in ("affinity", "default"):
        cached = prompt = 0
        for turn in range(4):
            for chat in chats:
                messages = []
                for said in chat[:turn + 1]:
                    messages += [{"role": "user", "content": said}, {"role": "assistant", "content": "noted: " + said[:24]}]
                reply = client.chat.completions.create(model=model, messages=messages[:-1], max_tokens=2, temperature=0)
                if turn:  # the first turn has nothing to hit
                    prompt += reply.usage.prompt_tokens
                    cached += reply.usage.prompt_tokens_details.cached_tokens
        rates[model] = cached / prompt
    print(f"\nprefix cache hit rate, turns 2-4 of 12 chats on 2 replicas: {rates}")
    assert rates["affinity"] > rates["default"] + 0.1, rates
    assert rates["affinity"] > 0.45, rates  # near what block-aligned history can hit


@pytest.mark.cluster
@pytest.mark.slow
def test_killed_replica_costs_503s_not_hangs_and_serve_replaces_it(run):
    """Kill one of the two `default` replicas while 24 requests run on both: each request ends
    in time with a 200 or a 503 (retry hint), never a 500 or a hang; requests succeed again once
    Serve has replaced the replica."""
    import asyncio
    import time

    import httpx
    import ray

    replicas = [name for name in ray.util.list_named_actors(all_namespaces=True)
                if "default" in str(name) and "SERVE_REPLICA" in str(name)]
    assert len(replicas) == 2, ray.util.list_named_actors(all_namespaces=True)
    victim = replicas[0]

    async def one(client, i):
        body = {"model": "default", "prompt": f"request {i} " * 4, "max_tokens": 200, "ignore_eos": True,
                "stream": i % 3 == 0}
        try:
            r = await client.post("/v1/completions", json=body)
        except httpx.HTTPError as e:
            return f"transport: {type(e).__name__}"
        if r.status_code == 200 and body["stream"]:
            return 503 if '"code": 503' in r.text or "replica_unavailable" in r.text else 200
        return r.status_code

    async def load():
        async with httpx.AsyncClient(base_url=run.base_url, timeout=60) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(24)]
            await asyncio.sleep(0.5)
            ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
            killed = time.perf_counter()
            return await asyncio.gather(*tasks), killed

    outcomes, killed = asyncio.run(load())
    assert set(outcomes) <= {200, 503}, outcomes
    assert 503 in outcomes and 200 in outcomes, outcomes  # requests ran on both replicas
    ok_in_a_row = 0
    while ok_in_a_row < 8:
        assert time.perf_counter() - killed < 120, "not recovered in 120 s"
        r = httpx.post(f"{run.base_url}/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2},
                       timeout=60)
        ok_in_a_row = ok_in_a_row + 1 if r.status_code == 200 else 0
        if r.status_code != 200:
            assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text)
            time.sleep(0.5)
    print(f"\nkilled 1 of 2 replicas under 24 requests: {outcomes.count(200)} x 200, {outcomes.count(503)} x 503; "
          f"8 successes in a row {time.perf_counter() - killed:.1f} s after the kill")


@pytest.mark.cluster
@pytest.mark.slow
def test_serve_queue_limit_is_429_with_retry_after(run):
    """`narrow` takes 1 request at a time and queues 1 more in Serve: of 8 at once, the ones Serve
    drops for backpressure are 429s (OpenAI's rate-limit error, Retry-After), the rest succeed."""
    import asyncio

    import httpx

    async def flood():
        async with httpx.AsyncClient(base_url=run.base_url, timeout=120) as client:
            body = {"model": "narrow", "prompt": "wait for it", "max_tokens": 64, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(8)))

    responses = asyncio.run(flood())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and refused.headers["retry-after"]
    print(f"\nServe queue limit: {statuses.count(200)} x 200, {statuses.count(429)} x 429")


def _running_replicas(deployment: str) -> int:
    from ray import serve

    for app in serve.status().applications.values():
        if deployment in app.deployments:
            return app.deployments[deployment].replica_states.get("RUNNING", 0)
    return 0


@pytest.mark.slow
@pytest.mark.cluster
def test_autoscaling_adds_a_replica_under_load_and_gives_it_back(run):
    """autoscaling_config on ongoing requests: 8 clients in a closed loop against a target of 2
    per replica make Serve start the second replica (every request answered meanwhile); once
    the load stops Serve goes back to one."""
    import threading
    import time

    import httpx

    assert _running_replicas("LLMServer:elastic") == 1
    stop, statuses, lock = threading.Event(), [], threading.Lock()

    def client(i: int) -> None:
        with httpx.Client(base_url=run.base_url, timeout=60) as http:
            while not stop.is_set():
                r = http.post("/v1/completions", json={"model": "elastic", "prompt": f"Load {i}", "max_tokens": 96,
                                                       "ignore_eos": True, "temperature": 0})
                with lock:
                    statuses.append(r.status_code)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    t0 = time.time()
    try:
        while _running_replicas("LLMServer:elastic") < 2:
            assert time.time() - t0 < 90, "no second replica after 90 s of load"
            time.sleep(0.5)
        up_s = time.time() - t0
        time.sleep(2)  # both replicas take requests
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    t1 = time.time()
    while _running_replicas("LLMServer:elastic") > 1:
        assert time.time() - t1 < 90, "still two replicas 90 s after the load ended"
        time.sleep(0.5)
    print(f"\nautoscaling: 2 replicas {up_s:.1f} s into the load, back to 1 {time.time() - t1:.1f} s after it; "
          f"{len(statuses)} requests")
    assert statuses and set(statuses) == {200}, sorted(set(statuses))


@pytest.mark.cluster
@pytest.mark.slow
def test_deleting_the_app_drains_requests_in_flight(run):
    """`serve.delete` while 6 requests decode: Serve stops routing new ones and waits up to
    graceful_shutdown_timeout_s (20 s) for replicas to finish: every in-flight request completes
    with all its tokens. (Last in the module: it takes the app down.)"""
    import asyncio
    import time

    import httpx
    from ray import serve

    async def drain():
        async with httpx.AsyncClient(base_url=run.base_url, timeout=120) as client:
            body = {"model": "default", "prompt": "drain", "max_tokens": 300, "ignore_eos": True}
            tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(6)]
            await asyncio.sleep(1.0)
            t0 = time.perf_counter()
            await asyncio.to_thread(serve.delete, "routing")
            return await asyncio.gather(*tasks), time.perf_counter() - t0

    responses, seconds = asyncio.run(drain())
    assert [r.status_code for r in responses] == [200] * 6, [r.text[:200] for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 300 for r in responses)
    print(f"\napp deleted under 6 requests: all completed, delete returned after {seconds:.1f} s")

