"""`serve run configs/tiny.yaml` on a real local Ray cluster, over real HTTP and real handles (and a
YAML serving an embedding model: the pooling routes).

tiny.yaml, as configs/app.yaml, colocates the ingress (`ingress_config.colocate`): the one
LLMServer deployment answers HTTP itself. The separate ingress runs on a real cluster in
tests/test_routing.py and tests/test_lora.py.

The test process starts a small Ray cluster; `serve run` (the CLI, in a subprocess)
deploys the shipped configs/tiny.yaml on it (only the HTTP port is changed, so that
parallel sessions do not collide on 8000). Clients: the official `openai` package over
HTTP through Serve's proxy, and Serve handles from this driver (plain and streaming).
"""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import REPO, openai_client, serve_run

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

MODEL = "servax-tiny/llama"
DEPLOYMENT = "LLMServer:servax-tiny--llama"


EMBEDDING_YAML = """
applications:
- name: servax
  route_prefix: /
  import_path: app.builder:build_app
  args:
    llm_configs:
    - model_loading_config: {model_id: tiny-embed, model_source: servax-tiny/qwen3}
      engine_kwargs: {model_impl: jax, runner: pooling, max_model_len: 256, max_num_seqs: 8,
                      max_num_batched_tokens: 64, num_kv_blocks: 96, show_progress: false}
      deployment_config: {num_replicas: 1, ray_actor_options: {num_cpus: 1}}
    ingress_config: {colocate: true}
"""


def test_pooling_routes_through_the_proxy_and_the_handle(servax_cache, tmp_path):
    """`serve run` of a YAML serving an embedding model (`runner: pooling`): /v1/embeddings with the
    official openai client, /rerank over HTTP, and the handle's `embeddings` and `rerank` methods
    (#43). It runs first in this module: serve_run's own cluster is gone before the module's
    shared one (`served`) starts."""
    import numpy as np
    from ray import serve

    from app.pooling_api import EmbeddingRequest, RerankRequest

    config = tmp_path / "embed.yaml"
    config.write_text(EMBEDDING_YAML)
    texts = ["the quick brown fox", "jumps over the lazy dog"]
    with serve_run(config, tmp_path, models=("tiny-embed",)) as run:
        client = openai_client(run.base_url)
        reply = client.embeddings.create(model="tiny-embed", input=texts)  # the client asks for base64
        vectors = np.array([d.embedding for d in reply.data])
        assert [d.index for d in reply.data] == [0, 1] and vectors.shape == (2, 64)
        assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5) and reply.usage.prompt_tokens > 0

        r = httpx.post(run.base_url + "/rerank", json={"model": "tiny-embed", "query": texts[0],
                                                         "documents": [texts[1], texts[0]]}, timeout=60)
        assert r.status_code == 200
        results = r.json()["results"]
        assert results[0]["index"] == 1 and results[0]["document"]["text"] == texts[0]  # itself: cosine 1
        assert results[0]["relevance_score"] == pytest.approx(1, abs=1e-5)
        r = httpx.post(run.base_url + "/v1/embeddings", json={"model": "tiny-embed", "input": "x", "dimensions": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"

        handle = serve.get_app_handle("servax")  # colocated: the app's ingress is the model's server
        body = handle.embeddings.remote(EmbeddingRequest(model="tiny-embed", input=texts)).result()
        assert np.allclose([d["embedding"] for d in body["data"]], vectors, atol=1e-5)
        ranked = handle.rerank.remote(RerankRequest(model="tiny-embed", query=texts[0],
                                                    documents=[texts[1], texts[0]])).result()
        assert [x["index"] for x in ranked["results"]] == [x["index"] for x in results]


def test_haproxy_ingress_serves_the_colocated_replica(servax_cache, tmp_path):
    """configs/tiny.yaml under Ray Serve's HAProxy ingress (`RAY_SERVE_ENABLE_HA_PROXY=1 serve run`,
    README's high-throughput start): HAProxy, not Serve's Python proxy, answers on the HTTP port and
    forwards to the colocated replica's own HTTP server. The official client streams a chat reply
    equal to its unstreamed one; errors keep the API's shape and status. Runs before the module's
    shared cluster (`served`) starts."""
    import openai
    import psutil
    from conftest import _is_haproxy, cluster_haproxies, free_port

    # HAProxy's stats and metrics ports and Serve's fallback proxy are fixed ports by default: free
    # ones here, so that another HAProxy-mode Serve on the machine cannot collide with this one.
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1"} | {name: str(free_port()) for name in (
        "RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")}
    with serve_run(REPO / "configs" / "tiny.yaml", tmp_path, env=env) as run:
        haproxies = cluster_haproxies()
        assert haproxies, "no HAProxy among this cluster's processes"
        listening = {c.laddr.port for h in haproxies for c in h.net_connections() if c.status == "LISTEN"}
        assert int(run.base_url.rsplit(":", 1)[1]) in listening
        client = openai_client(run.base_url)
        messages = [{"role": "user", "content": "Count to five."}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                     temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            whole.choices[0].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1, temperature=-1)
        assert bad.value.body["param"] == "temperature"
    assert not any(_is_haproxy(h) and h.status() != psutil.STATUS_ZOMBIE for h in haproxies)  # gone with the cluster


@pytest.fixture(scope="module")
def served(servax_cache, tmp_path_factory):
    """(base_url, seconds from `serve run` to a first answered completion, metrics URL)."""
    with serve_run(REPO / "configs" / "tiny.yaml", tmp_path_factory.mktemp("serve")) as run:
        yield run.base_url, run.ready_s, run.metrics_url


@pytest.fixture(scope="module")
def base_url(served):
    return served[0]


@pytest.fixture
def client(base_url):
    return openai_client(base_url)


@pytest.fixture(scope="module")
def handle(served):
    from ray import serve

    return serve.get_deployment_handle(DEPLOYMENT, app_name="servax")


def test_openai_client_models_completion_chat_and_streaming(client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.model_extra["impl"] == "jax" and card.model_extra["max_model_len"] == 512

    done = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 8 and done.choices[0].finish_reason == "length"

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6

    chunks = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text

    chat_chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    assert chat_chunks[-1].usage.completion_tokens == 6


def test_errors_through_the_proxy_and_still_serving(base_url, client):
    r = httpx.post(base_url + "/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(base_url + "/v1/completions", json={"prompt": "hi", "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(base_url + "/v1/completions", json={"prompt": [10 + i % 400 for i in range(600)], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(base_url + "/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).usage.completion_tokens >= 1


def test_colocated_app_is_one_deployment_and_its_app_handle_is_the_llm_server(served):
    from ray import serve

    status = serve.status().applications["servax"]
    assert sorted(status.deployments) == [DEPLOYMENT]
    app = serve.get_app_handle("servax")  # the app's ingress is the model's server: typed methods work
    result = app.generate.remote("Hello world", {"max_tokens": 4, "temperature": 0, "ignore_eos": True}).result()
    assert len(result.outputs[0].token_ids) == 4


def test_handle_generate_and_stream(handle):
    result = handle.generate.remote("Hello world", {"max_tokens": 8, "temperature": 0, "ignore_eos": True}).result()
    assert len(result.outputs[0].token_ids) == 8 and result.outputs[0].finish_reason == "length"
    deltas = list(handle.options(stream=True).stream.remote(
        "Hello world", {"max_tokens": 8, "temperature": 0, "ignore_eos": True}))
    assert "".join(d.text for d in deltas) == result.text
    assert sum(len(d.token_ids) for d in deltas) == 8 and deltas[-1].finish_reason == "length"
    chat = handle.generate.remote([{"role": "user", "content": "Hi"}], {"max_tokens": 4}).result()
    assert len(chat.outputs[0].token_ids) <= 4

    from runtime import SamplingParams

    typed = handle.generate.remote("Hello world", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert typed.result().text == result.text
    two = handle.generate.remote([5, 6, 7], {"n": 2, "max_tokens": 3, "temperature": 0.8, "seed": 1}).result()
    assert [g.index for g in two.outputs] == [0, 1] and two.prompt_token_ids == [5, 6, 7]


def test_anthropic_messages_through_the_proxy_and_the_handle(base_url, handle):
    """The colocated app serves Anthropic's Messages API over Serve's proxy, and as the handle's
    `messages` method (#43)."""
    import anthropic

    from app.anthropic_request import MessagesRequest

    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    body = dict(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Hi"}])
    message = client.messages.create(**body, extra_body={"temperature": 0})
    assert message.content[0].type == "text" and message.stop_reason in ("max_tokens", "end_turn")
    with client.messages.stream(**body, extra_body={"temperature": 0}) as stream:
        assert stream.get_final_message().content[0].text == message.content[0].text
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**{**body, "model": "nope"})
    (reply,) = list(handle.options(stream=True).messages.remote(MessagesRequest(**body, temperature=0)))
    assert reply["content"][0]["text"] == message.content[0].text


def test_responses_api_through_the_proxy_and_the_handle(base_url, handle):
    """The colocated app serves OpenAI's Responses API over Serve's proxy (create streamed and
    not, retrieve from the replica's store), and as the handle's `responses` method (#43)."""
    import openai

    from app.responses_request import ResponsesRequest

    client = openai_client(base_url)
    body = dict(model=MODEL, input="Hi", max_output_tokens=6, temperature=0)
    response = client.responses.create(**body)
    assert response.output[0].type == "message" and response.status in ("incomplete", "completed")
    with client.responses.stream(**body) as stream:
        assert stream.get_final_response().output_text == response.output_text
    assert client.responses.retrieve(response.id).output_text == response.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(**{**body, "model": "nope"})
    (reply,) = list(handle.options(stream=True).responses.remote(ResponsesRequest(**body)))
    assert reply["output"][0]["content"][0]["text"] == response.output_text
    assert handle.retrieve_response.remote(reply["id"]).result()["id"] == reply["id"]


def test_handle_errors_keep_their_type(handle):
    from runtime.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        handle.generate.remote("hi", {"temperature": -1}).result()


def _idle(handle) -> dict:
    deadline = time.time() + 30
    while True:
        stats = handle.stats.remote().result()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        assert time.time() < deadline, stats
        time.sleep(0.1)


def test_client_disconnect_through_the_proxy_frees_blocks(base_url, handle):
    idle = lambda: _idle(handle)  # noqa: E731
    before = idle()
    with httpx.stream("POST", base_url + "/v1/completions", json={
            "prompt": "A long story:", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True},
            timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 3:
                break
    after = idle()
    assert after["kv_blocks_used"] == before["kv_blocks_used"]
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 300


def test_non_streaming_client_timeout_aborts_the_request(base_url, handle):
    before = _idle(handle)
    # 8 x 480 tokens take the tiny model ~10x longer than the client waits (its whole run
    # of 480 tokens for one sequence fits in 0.3 s now), so the server must abort mid-way.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base_url + "/v1/completions", json={
            "prompt": "A long story:", "max_tokens": 480, "n": 8, "temperature": 0, "ignore_eos": True},
            timeout=0.1)
    after = _idle(handle)
    assert after["kv_blocks_used"] == before["kv_blocks_used"]
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 8 * 480


def test_http_overhead_per_request(base_url, handle, served):
    """Not a pass/fail bound beyond sanity: prints the proxy+ingress cost per request."""
    body = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}
    sampling = {"max_tokens": 1, "temperature": 0}
    with httpx.Client(base_url=base_url, timeout=60) as http:
        for _ in range(3):  # warm both paths
            http.post("/v1/completions", json=body)
            handle.generate.remote("Hi", sampling).result()
        t0 = time.perf_counter()
        for _ in range(20):
            assert http.post("/v1/completions", json=body).status_code == 200
        t_http = (time.perf_counter() - t0) / 20
        t0 = time.perf_counter()
        for _ in range(20):
            handle.generate.remote("Hi", sampling).result()
        t_handle = (time.perf_counter() - t0) / 20
    print(f"\nHTTP completion {t_http * 1e3:.1f} ms, handle.generate {t_handle * 1e3:.1f} ms, "
          f"overhead {(t_http - t_handle) * 1e3:.1f} ms/request; ready in {served[1]:.1f} s")
    assert t_http < 10


def test_servax_metrics_are_exported_by_ray(served, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=4)
    wanted = ["ray_servax_time_to_first_token_seconds_count", "ray_servax_time_per_output_token_seconds_count",
              "ray_servax_prompt_tokens_total", "ray_servax_generation_tokens_total",
              "ray_servax_num_requests_running", "ray_servax_kv_cache_usage_perc",
              "ray_servax_request_success_total", "ray_servax_prefix_cache_queries_total"]
    deadline = time.time() + 60
    while True:  # Ray's metrics agent exports every few seconds
        names = {line.split("{")[0] for line in httpx.get(served[2], timeout=10).text.splitlines()
                 if 'model_id="servax-tiny/llama"' in line}
        if all(w in names for w in wanted):
            break
        assert time.time() < deadline, f"missing: {[w for w in wanted if w not in names]}"
        time.sleep(2)
