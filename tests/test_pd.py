"""Prefill/decode disaggregation on a real local cluster (#44, app/pd.py): one `serve run` of a
P/D app (1 prefill + 1 decode replica of the tiny Llama) beside a colocated app of the same
model and engine settings. P/D answers as the colocated replica does, greedy and seeded, for
completions, chat, streams, chunked prompts and prefix hits; the moved blocks are freed on the
prefill side and none leak after many requests with disconnects; a decode replica killed
mid-stream costs a 503, and a retry succeeds."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

MODEL = "servax-tiny/llama"
ENGINE = """{dtype: float32, max_model_len: 512, max_num_seqs: 16, max_num_batched_tokens: 64,
                             num_kv_blocks: 256, block_size: 16, show_progress: false}"""
# The colocated app both P/D modules serve beside theirs (at /colocated): what P/D must answer as.
COLOCATED_APP = f"""- name: colocated
  route_prefix: /colocated
  import_path: app.builder:build_app
  args:
    llm_configs:
    - model_loading_config: {{model_id: {MODEL}}}
      engine_kwargs: {ENGINE}
      deployment_config: {{num_replicas: 1, ray_actor_options: {{num_cpus: 0.25}}}}
    ingress_config: {{colocate: true}}
"""
PD_YAML = f"""
applications:
- name: pd
  route_prefix: /
  import_path: app.builder:build_pd_openai_app
  args:
    prefill_config:
      model_loading_config: {{model_id: {MODEL}}}
      engine_kwargs: {ENGINE}
      deployment_config: {{num_replicas: 1, ray_actor_options: {{num_cpus: 0.25}}}}
    decode_config:
      model_loading_config: {{model_id: {MODEL}}}
      engine_kwargs: {ENGINE}
      deployment_config: {{num_replicas: 1, ray_actor_options: {{num_cpus: 0.25}}}}
""" + COLOCATED_APP
WORDS = "alpha beta gamma delta river stone cloud forest paper window garden silver".split()
LONG = " ".join(random.Random(1).choice(WORDS) for _ in range(30))  # ~150 tokens > max_num_batched_tokens: chunked


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    yield from serve_beside_colocated(tmp_path_factory, "pd", PD_YAML)


def serve_beside_colocated(tmp_path_factory, name: str, yaml_text: str):
    """`serve run` of a YAML with a P/D app beside a colocated one (at /colocated), yielded once
    the colocated app answers (a module fixture's body)."""
    from conftest import serve_run

    folder = tmp_path_factory.mktemp(name)
    config = folder / f"{name}.yaml"
    config.write_text(yaml_text)
    with serve_run(config, folder) as served:
        deadline = time.time() + 120
        while httpx.post(served.base_url + "/colocated/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                         timeout=30).status_code != 200:
            assert time.time() < deadline, "the colocated app did not come up"
            time.sleep(0.5)
        yield served


def pd_stats(side: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(f"{side}:servax-tiny--llama", app_name="pd").pd_stats.remote().result()


def both(run, route: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
    pd = httpx.post(f"{run.base_url}/v1/{route}", json={"model": MODEL, **body}, timeout=120)
    colocated = httpx.post(f"{run.base_url}/colocated/v1/{route}", json={"model": MODEL, **body}, timeout=120)
    assert pd.status_code == colocated.status_code == 200, (pd.text, colocated.text)
    return pd, colocated


def streamed(response: httpx.Response) -> tuple[str, list]:
    text, reasons = "", []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                reasons.append(choice.get("finish_reason"))
    return text, [r for r in reasons if r]


GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 11, "max_tokens": 24, "ignore_eos": True}


def test_pd_completions_match_colocated_greedy_seeded_chunked_and_prefix_hits(run):
    before = pd_stats("Prefill")
    for sampling in (GREEDY, SEEDED):
        for prompt in ("Once upon a time", LONG, LONG):  # LONG again: a prefix hit
            pd, colocated = both(run, "completions", {"prompt": prompt, "logprobs": 1, **sampling})
            a, b = pd.json(), colocated.json()
            assert a["choices"][0]["text"] == b["choices"][0]["text"], prompt[:20]
            assert a["choices"][0]["logprobs"]["tokens"] == b["choices"][0]["logprobs"]["tokens"]
            assert a["usage"] == b["usage"]
    after = pd_stats("Prefill")
    assert after["kv_requests_exported"] - before["kv_requests_exported"] == 6
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]  # the repeated prompt skipped its blocks
    assert after["kv_blocks_used"] == 0 and after["kv_exports_pending"] == 0  # the moved blocks were freed
    assert pd_stats("Decode")["kv_requests_imported"] >= 6


def test_pd_chat_and_streams_match_colocated(run):
    messages = [{"role": "user", "content": "Tell me about " + LONG[:100]}]
    for sampling in (GREEDY, SEEDED):
        pd, colocated = both(run, "chat/completions", {"messages": messages, **sampling})
        assert pd.json()["choices"][0]["message"] == colocated.json()["choices"][0]["message"]
        for route, body in (("completions", {"prompt": LONG}), ("chat/completions", {"messages": messages})):
            pd, colocated = both(run, route, {**body, **sampling, "stream": True})
            assert streamed(pd) == streamed(colocated) and streamed(pd)[0], route
    for side in ("Prefill", "Decode"):
        s = pd_stats(side)
        assert s["compilations_since_warmup"] == 0, side


def test_no_block_leaks_after_many_requests_with_disconnects(run):
    """200 requests (the issue's count), 8 at a time: a third are streams the client drops after the first chunk."""

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "prompt": f"request {i} " + LONG[:10 * (i % 30)], "max_tokens": 16,
                "ignore_eos": True, "temperature": 0.5 * (i % 2), "seed": i}
        if i % 3 == 0:
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    break  # disconnect mid-stream
        else:
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text

    async def load() -> None:
        gate = asyncio.Semaphore(8)

        async def gated(client, i):
            async with gate:
                await one(client, i)

        async with httpx.AsyncClient(base_url=run.base_url, timeout=120) as client:
            await asyncio.gather(*(gated(client, i) for i in range(200)))

    asyncio.run(load())
    deadline = time.time() + 30
    while True:
        stats = {side: pd_stats(side) for side in ("Prefill", "Decode")}
        idle = all(s["kv_blocks_used"] == 0 and s["num_running"] == s["num_waiting"] == 0 for s in stats.values())
        if idle or time.time() > deadline:
            break
        time.sleep(0.5)
    for side, s in stats.items():
        assert s["kv_blocks_used"] == 0 and s["num_running"] == s["num_waiting"] == 0, (side, s)
        assert s["compilations_since_warmup"] == 0, side
    assert stats["Prefill"]["kv_exports_pending"] == 0


def test_killed_decode_replica_ends_its_stream_with_503_and_a_retry_succeeds(run):
    import ray

    decode = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if "Decode" in str(a["name"]) and "SERVE_REPLICA" in str(a["name"])]
    assert len(decode) == 1, decode

    async def stream_and_kill() -> str:
        async with httpx.AsyncClient(base_url=run.base_url, timeout=120) as client:
            body = {"model": MODEL, "prompt": "keep going", "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                seen = ""
                async for line in r.aiter_lines():
                    seen += line + "\n"
                    if seen.count("data: ") == 3 and "killed" not in locals():
                        killed = True
                        ray.kill(ray.get_actor(decode[0]["name"], namespace=decode[0]["namespace"]), no_restart=True)
                return seen

    seen = asyncio.run(stream_and_kill())
    assert '"code": 503' in seen or "replica_unavailable" in seen, seen[-600:]
    killed = time.perf_counter()
    while True:
        assert time.perf_counter() - killed < 180, "no decode replica answered in 180 s"
        r = httpx.post(f"{run.base_url}/v1/completions", json={"model": MODEL, "prompt": LONG, **GREEDY}, timeout=60)
        if r.status_code == 200:
            break
        assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text)
        time.sleep(1)
    want = httpx.post(f"{run.base_url}/colocated/v1/completions", json={"model": MODEL, "prompt": LONG, **GREEDY},
                      timeout=60).json()
    assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
    print(f"\nP/D decode replica killed mid-stream: 503 in the stream; a retry succeeded "
          f"{time.perf_counter() - killed:.1f} s later")
