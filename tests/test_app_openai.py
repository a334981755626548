"""The OpenAI API over real HTTP, in one process.

Each model's LLMServer runs through `serve.run(..., _local_testing_mode=True)` (real
deployment class, real engine, real Serve handles, no cluster), and the ingress FastAPI
app built on those handles is served by uvicorn on a local port. So every request below
crosses a real socket, goes through FastAPI validation, a streaming Serve handle call and
the engine; only Ray's proxy and actors are left out (tests/test_app_serve_run.py covers
them).

Models: `servax-tiny/llama` (the default app's settings) and `small-queue`, the same
checkpoint with one running sequence and a one-request queue, for 429 and, last in this
file, 503 (its engine is shut down).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from conftest import (
    assert_openai_error, local_llm_server, local_llm_servers, openai_api_server, openai_client, sse_events,
)

pytestmark = pytest.mark.slow

MODEL = "servax-tiny/llama"
SMALL = "small-queue"
API_KEY = "test-key"
ENGINE = dict(model_impl="jax", dtype="float32", max_model_len=512, max_num_seqs=32, max_num_batched_tokens=512,
              num_kv_blocks=1024, show_progress=False)  # as configs/app.yaml
GREEDY = dict(temperature=0, ignore_eos=True)
# The openai client takes non-OpenAI fields (ignore_eos) through extra_body.
CLIENT_GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def handles(servax_cache):
    with local_llm_servers([
        {"model_loading_config": {"model_id": MODEL}, "engine_kwargs": ENGINE},
        {"model_loading_config": {"model_id": SMALL, "model_source": MODEL},
         # A longer context than MODEL's so that one request runs long enough (>1 s) to be
         # seen queued behind; the tiny model decodes 500 tokens in a fraction of a second.
         "engine_kwargs": dict(ENGINE, max_num_seqs=1, max_queue_size=1, max_model_len=1024,
                               num_kv_blocks=80)},
    ]) as result:
        yield result


@pytest.fixture(scope="module")
def base_url(handles):
    with openai_api_server(handles, api_key=API_KEY) as url:
        yield url


@pytest.fixture
def http(base_url):
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        yield client


@pytest.fixture
def client(base_url):
    return openai_client(base_url, API_KEY)


def _stats(handles, model=MODEL) -> dict:
    return handles[model].stats.remote().result()


def _wait_idle(handles, model=MODEL, timeout=30.0) -> dict:
    deadline = time.time() + timeout
    while True:
        stats = _stats(handles, model)
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        assert time.time() < deadline, f"engine still busy: {stats}"
        time.sleep(0.05)


# ---- the happy paths, through the official client -------------------------------------------

def test_models_lists_both_with_metadata(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, SMALL}
    extra = cards[MODEL].model_extra
    assert extra["impl"] == "jax" and extra["max_model_len"] == 512 and extra["root"] == MODEL


def test_completion_greedy_is_deterministic_and_counts_usage(client):
    a = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, **CLIENT_GREEDY)
    b = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, **CLIENT_GREEDY)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text
    assert a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 8 and a.usage.prompt_tokens > 0
    assert a.usage.total_tokens == a.usage.prompt_tokens + 8


def test_completion_without_model_goes_to_the_only_model_when_one(http, handles):
    from app.ingress import OpenAIRouter

    router = OpenAIRouter({MODEL: handles[MODEL]})
    assert router.handle_for(None) is handles[MODEL]
    # With two models the server must be told which.
    assert_openai_error(http.post("/v1/completions", json={"prompt": "hi"}), 400, param="model")


def test_completion_token_ids_and_batch(http):
    one = http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, **GREEDY}).json()
    batch = http.post("/v1/completions", json={
        "model": MODEL, "prompt": [[5, 6, 7], "Hello"], "max_tokens": 4, "n": 2, **GREEDY}).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["choices"][0]["text"] == one["choices"][0]["text"] == batch["choices"][1]["text"]
    assert batch["usage"]["completion_tokens"] == 16


def test_completion_echo_with_logprobs(http):
    body = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello world", "max_tokens": 3,
                                              "echo": True, "logprobs": 2, **GREEDY}).json()
    choice = body["choices"][0]
    assert choice["text"].startswith("Hello world")
    lp = choice["logprobs"]
    n = len(lp["tokens"])
    assert n == body["usage"]["prompt_tokens"] + 3
    assert lp["token_logprobs"][0] is None and all(x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(t) >= 1 for t in lp["top_logprobs"][1:]) and len(lp["text_offset"]) == n
    assert "".join(lp["tokens"]) == choice["text"]


def test_streaming_echo_with_logprobs_matches_non_streaming(http):
    req = {"model": MODEL, "prompt": "Hello world", "max_tokens": 4, "echo": True, "logprobs": 1, **GREEDY}
    full = http.post("/v1/completions", json=req).json()["choices"][0]
    with http.stream("POST", "/v1/completions", json=dict(req, stream=True)) as r:
        chunks = [e["choices"][0] for e in sse_events(r)[:-1]]
    assert "".join(c["text"] for c in chunks) == full["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert sum((c["logprobs"][key] for c in chunks if c["logprobs"]), []) == full["logprobs"][key]


def test_completion_seeded_sampling_reproduces(http):
    req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9,
           "top_k": 50, "min_p": 0.01, "presence_penalty": 0.5, "frequency_penalty": 0.5, "seed": 1234,
           "logit_bias": {"5": 2}, "user": "ignored"}
    a, b = (http.post("/v1/completions", json=req).json() for _ in range(2))
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_completion_stop_string(http):
    full = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 12, **GREEDY}).json()
    text = full["choices"][0]["text"]
    stop = text[3:5]
    body = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 12,
                                              "stop": [stop], **GREEDY}).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == text[:text.index(stop)]


def test_chat_completion_with_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                          max_completion_tokens=5, logprobs=True, top_logprobs=2, **CLIENT_GREEDY)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 5 == resp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content


def test_chat_uses_the_chat_template(http, handles):
    from transformers import AutoTokenizer

    from registry.tiny import tiny_checkpoint_path

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint_path(MODEL))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 6,
                                                   **GREEDY}).json()
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 6,
                                                    **GREEDY}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]


def test_streaming_completion_matches_non_streaming(client):
    full = client.completions.create(model=MODEL, prompt="The weather", max_tokens=10, **CLIENT_GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="The weather", max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, **CLIENT_GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_streaming_chat_sse_shape(http):
    with http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}, **GREEDY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_streaming_n_choices_sends_each_choice_in_its_own_chunks_and_finishes_it_once(client, route):
    """n=3 streamed as vLLM streams it: one choice per chunk, each choice's finish_reason exactly once
    (not again in every later chunk), the texts those of the same seeded request unstreamed."""
    args = dict(model=MODEL, max_tokens=8, n=3, temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    if route == "completions":
        full = client.completions.create(prompt="Once upon", **args)
        chunks = list(client.completions.create(prompt="Once upon", stream=True, **args))
        pieces = [(c.choices[0].index, c.choices[0].text, c.choices[0].finish_reason) for c in chunks]
        want = {c.index: c.text for c in full.choices}
    else:
        messages = [{"role": "user", "content": "Hi"}]
        full = client.chat.completions.create(messages=messages, **args)
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **args))
        pieces = [(c.choices[0].index, c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in chunks]
        want = {c.index: c.message.content for c in full.choices}
    assert all(len(c.choices) == 1 for c in chunks)
    finishes = [(i, reason) for i, _, reason in pieces if reason is not None]
    assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]
    texts = {i: "".join(t for j, t, _ in pieces if j == i) for i in range(3)}
    assert texts == want


def test_health(base_url):
    r = httpx.get(base_url + "/health")
    assert r.status_code == 200 and r.json()["models"] == {MODEL: "ok", SMALL: "ok"}


# ---- errors: each over HTTP, and the server keeps serving -----------------------------------

def _still_serving(http) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic test-key"},
                                     {"Authorization": "Bearer t\xe9st-key".encode("latin-1")}],  # not ASCII
                         ids=["none", "wrong", "basic", "latin-1"])
def test_wrong_or_missing_api_key_is_401(base_url, http, headers):
    r = httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=headers)
    assert_openai_error(r, 401, code="invalid_api_key")
    assert_openai_error(httpx.get(base_url + "/v1/models", headers=headers), 401)
    _still_serving(http)


def test_unknown_model_is_404(http):
    assert_openai_error(http.post("/v1/completions", json={"model": "nope", "prompt": "hi"}), 404, param="model",
                  code="model_not_found")
    assert_openai_error(http.post("/v1/chat/completions", json={"model": "nope", "messages": [
        {"role": "user", "content": "hi"}]}), 404, param="model")
    _still_serving(http)


def test_bad_json_is_400(http):
    r = http.post("/v1/completions", content=b'{"model": "x", "prompt": ', headers={"Content-Type": "application/json"})
    assert "JSON" in assert_openai_error(r, 400)["message"]
    assert_openai_error(http.post("/v1/completions", content=b"[1, 2]", headers={"Content-Type": "application/json"}), 400)
    _still_serving(http)


@pytest.mark.parametrize("body, param", [
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"logprobs": 50}, "logprobs"),
    ({"prompt": None}, "prompt"),
])
def test_bad_completion_params_are_400_naming_the_param(http, body, param):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **body})
    assert_openai_error(r, 400, param=param)
    _still_serving(http)


def test_bad_param_refused_by_the_engine_is_400(http):
    # Passes the request schema, refused by runtime.SamplingParams (top_p/min_p ranges are
    # checked there too, but a stop_token_ids entry beyond the vocabulary is the engine's call).
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "top_k": -5})
    assert_openai_error(r, 400, param="top_k")
    _still_serving(http)


def test_bad_chat_params_are_400(http):
    assert_openai_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400, param="messages")
    assert_openai_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": 5, "content": "hi"}]}), 400, param="messages.0.role")  # any string reaches the template
    assert_openai_error(http.post("/v1/chat/completions", json={"model": MODEL, "top_logprobs": 2, "messages": [
        {"role": "user", "content": "hi"}]}), 400)
    _still_serving(http)


def test_prompt_longer_than_context_is_400_context_length_exceeded(http):
    long_prompt = [10 + i % 400 for i in range(600)]  # vocab is 512
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 4})
    assert_openai_error(r, 400, code="context_length_exceeded")
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "word " * 600}]})
    assert_openai_error(r, 400, code="context_length_exceeded")
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 4, "stream": True})
    assert_openai_error(r, 400, code="context_length_exceeded")
    _still_serving(http)


def test_full_queue_is_429_and_server_recovers(base_url, http, handles):
    async def scenario():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120) as c:
            long = {"model": SMALL, "prompt": "Hello", "max_tokens": 1000, "n": 1, "stream": True,
                    "ignore_eos": True, **GREEDY}
            running = c.stream("POST", "/v1/completions", json=long)
            first = await running.__aenter__()  # headers arrive with the first token: it is running
            assert first.status_code == 200
            waiting = asyncio.create_task(c.post("/v1/completions", json=dict(long, stream=False)))
            for _ in range(200):  # wait until the second request sits in the queue
                stats = await asyncio.to_thread(_stats, handles, SMALL)
                if stats["num_waiting"] == 1:
                    break
                await asyncio.sleep(0.02)
            assert stats["num_running"] == 1 and stats["num_waiting"] == 1, stats
            overflow = await c.post("/v1/completions", json=dict(long, stream=False))
            await running.__aexit__(None, None, None)
            waiting.cancel()
            return overflow

    overflow = asyncio.run(scenario())
    assert_openai_error(overflow, 429, code="rate_limit_exceeded")
    _wait_idle(handles, SMALL)
    r = http.post("/v1/completions", json={"model": SMALL, "prompt": "again", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- load and cancellation --------------------------------------------------------------------

def test_32_concurrent_greedy_streams_match_solo_runs(base_url, http, handles):
    prompts = ["Tell me a story", "The quick brown fox", "def generate(prompt):", "Monday, Tuesday"]
    req = {"model": MODEL, "max_tokens": 24, **GREEDY}
    solo = {p: http.post("/v1/completions", json=dict(req, prompt=p)).json()["choices"][0]["text"] for p in prompts}

    async def one(c: httpx.AsyncClient, prompt: str) -> str:
        async with c.stream("POST", "/v1/completions", json=dict(req, prompt=prompt, stream=True)) as r:
            assert r.status_code == 200
            text = []
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += [ch["text"] for ch in json.loads(line[6:])["choices"]]
            return "".join(text)

    async def all_at_once() -> list[str]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300, limits=limits) as c:
            return await asyncio.gather(*(one(c, prompts[i % 4]) for i in range(32)))

    texts = asyncio.run(all_at_once())
    assert texts == [solo[prompts[i % 4]] for i in range(32)]
    _wait_idle(handles)


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(base_url, handles):
    before = _wait_idle(handles)

    async def read_a_little_then_leave() -> int:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as c:
            async with c.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "A long story:", "max_tokens": 400, "stream": True, **GREEDY}) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: {")
                    if seen == 3:
                        break  # leaving the block closes the connection mid-stream
        return seen

    assert asyncio.run(read_a_little_then_leave()) == 3
    after = _wait_idle(handles, timeout=20)
    assert after["kv_blocks_used"] == before["kv_blocks_used"]
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 300  # it stopped early


# ---- drop-in for vLLM users: unknown fields, /tokenize, /detokenize, /version, /metrics --------

def test_unknown_fields_are_ignored_with_a_warning_header(http):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, **GREEDY}
    plain = http.post("/v1/completions", json=body)
    odd = http.post("/v1/completions", json={**body, "frobnicate": 3, "vendor_flag": True})
    assert odd.status_code == 200 and odd.headers["x-servax-ignored-fields"] == "frobnicate,vendor_flag"
    assert "x-servax-ignored-fields" not in plain.headers
    assert odd.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


@pytest.mark.parametrize("field, value", [("audio", {"voice": "alloy", "format": "wav"}),
                                          ("prediction", {"type": "content", "content": "x"}),
                                          ("functions", [{"name": "f"}]), ("modalities", ["text", "audio"])])
def test_known_but_unsupported_chat_fields_are_400_saying_so(http, field, value):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 field: value})
    assert "supported" in assert_openai_error(r, 400, param=field)["message"]


def test_tokenize_and_detokenize_round_trip(http):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 512
    assert http.post("/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    chat = http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert http.post("/detokenize", json={"model": MODEL, "tokens": chat["tokens"]}).json()["prompt"] == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert_openai_error(http.post("/detokenize", json={"model": MODEL, "tokens": [10**6]}), 400, param="tokens")
    assert_openai_error(http.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404, param="model")


def test_version(http):
    import importlib.metadata

    assert http.get("/version").json() == {"version": importlib.metadata.version("servax")}


def test_chat_continue_final_message_and_echo(http):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "add_generation_prompt": False,
            "continue_final_message": True, **GREEDY}
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "Once upon" + plain
    prompt = http.post("/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": False,
                                          "continue_final_message": True}).json()["tokens"]
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4, **GREEDY})
    assert completion.json()["choices"][0]["text"] == plain  # the open assistant turn is continued
    assert_openai_error(http.post("/v1/chat/completions", json={**body, "add_generation_prompt": True}), 400,
                        param="continue_final_message")


def test_metrics_endpoint_counts_add_up(http, base_url):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[tuple[str, str], float]:
        text = httpx.get(base_url + "/metrics").text
        return {(s.name, s.labels.get("finished_reason", "")): s.value
                for f in text_string_to_metric_families(text) for s in f.samples
                if s.labels.get("model_name") == MODEL}

    before = scrape()
    bodies = [http.post("/v1/completions", json={"model": MODEL, "prompt": "count " * (i + 1), "max_tokens": 3 + i,
                                                  **GREEDY}).json() for i in range(4)]
    after = scrape()

    def delta(name: str, reason: str = "") -> float:
        return after[(name, reason)] - before.get((name, reason), 0.0)

    assert delta("servax:request_success_total", "length") == 4
    assert delta("servax:prompt_tokens_total") == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert delta("servax:generation_tokens_total") == sum(b["usage"]["completion_tokens"] for b in bodies)
    assert delta("servax:time_to_first_token_seconds_count") == 4
    assert delta("servax:prefix_cache_queries_total") >= sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert 0 <= after[("servax:kv_cache_usage_perc", "")] <= 1
    assert ("servax:num_requests_running", "") in after and ("servax:num_requests_waiting", "") in after


def test_handle_completions_is_rays_name_for_completion(handles):
    from app.openai_requests import CompletionRequest

    body = CompletionRequest(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, ignore_eos=True)
    ours = list(handles[MODEL].options(stream=True).completion.remote(body))
    rays = list(handles[MODEL].options(stream=True).completions.remote(body))
    assert ours[0]["choices"][0]["text"] == rays[0]["choices"][0]["text"]


# ---- last: a dead engine --------------------------------------------------------------------

def test_dead_engine_is_503_and_other_models_keep_serving(base_url, http):
    server = local_llm_server(SMALL)
    # Engine.shutdown stops the loop thread as a crash would; requests and /health must see it.
    server.engine.shutdown()
    r = http.post("/v1/completions", json={"model": SMALL, "prompt": "hi", "max_tokens": 2})
    assert_openai_error(r, 503)
    health = httpx.get(base_url + "/health")
    assert health.status_code == 503 and health.json()["models"][MODEL] == "ok"
    _still_serving(http)
