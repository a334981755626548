"""Drop-in over HTTP: what code written against `vllm serve` reads from servax's answers.

The expected shapes are vLLM 0.32's (vllm/entrypoints/openai/*/protocol.py and the serving
modules): bodies carry their null fields, prompt logprobs and token ids come back where vLLM
puts them, and streams report usage as vLLM's stream_options ask. One server for the module:
the tiny Llama behind the real ingress on a local port (Serve's local testing mode).
"""

from __future__ import annotations

import httpx
import pytest

from conftest import assert_openai_error, local_llm_servers, openai_api_server, openai_client, sse_events

MODEL = "dropin-tiny"
VOCAB = 512  # servax-tiny/llama's
ENGINE = dict(model_impl="jax", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128, num_kv_blocks=128,
              show_progress=False)
GREEDY = dict(temperature=0, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "Hello there"}]

# The keys vLLM 0.32 always sends (its response models dumped with their None fields).
VLLM_COMPLETION_KEYS = {"id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                        "kv_transfer_params", "ec_transfer_params", "metrics"}
VLLM_COMPLETION_CHOICE_KEYS = {"index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                               "prompt_logprobs", "prompt_token_ids", "routed_experts"}
VLLM_COMPLETION_CHUNK_CHOICE_KEYS = {"index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids",
                                     "token_ids"}
VLLM_CHAT_KEYS = {"id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                  "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params",
                  "metrics"}
VLLM_CHAT_CHOICE_KEYS = {"index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"}
VLLM_CHAT_MESSAGE_KEYS = {"role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"}
VLLM_CHAT_CHUNK_CHOICE_KEYS = {"index", "delta", "logprobs", "finish_reason", "token_ids"}
VLLM_TOKENIZE_KEYS = {"count", "max_model_len", "tokens", "token_strs"}


# The same model served with vLLM's settings that change answers: max_logprobs -1 (the whole
# vocabulary may be asked for), enable_force_include_usage (usage on every stream chunk),
# enable_tokenizer_info_endpoint and return_tokens_as_token_ids.
WIDE = "dropin-wide"


@pytest.fixture(scope="module")
def base_url(servax_cache):
    with local_llm_servers([
        {"model_loading_config": {"model_id": MODEL, "model_source": "servax-tiny/llama"}, "engine_kwargs": ENGINE},
        {"model_loading_config": {"model_id": WIDE, "model_source": "servax-tiny/llama"},
         "engine_kwargs": dict(ENGINE, max_logprobs=-1, enable_force_include_usage=True,
                              enable_tokenizer_info_endpoint=True, return_tokens_as_token_ids=True)},
    ]) as handles, openai_api_server(handles) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 4, **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(http, **body) -> dict:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(http, route: str, **body) -> list[dict]:
    base = {"model": MODEL, "max_tokens": 4, "stream": True, **GREEDY}
    base.update({"prompt": "Hello"} if route == "completions" else {"messages": MESSAGES})
    with http.stream("POST", f"/v1/{route}", json={**base, **body}) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    return events[:-1]


# ---- 1. the null fields vLLM always sends ---------------------------------------------

def test_completion_body_has_every_field_vllm_sends_null_ones_included(http):
    body = complete(http, prompt="Hello")
    assert set(body) == VLLM_COMPLETION_KEYS
    (choice,) = body["choices"]
    assert set(choice) == VLLM_COMPLETION_CHOICE_KEYS
    assert choice["prompt_logprobs"] is None and choice["prompt_token_ids"] is None and choice["token_ids"] is None
    assert choice["logprobs"] is None and body["system_fingerprint"] is None


def test_chat_body_has_every_field_vllm_sends_null_ones_included(http):
    body = chat(http)
    assert set(body) == VLLM_CHAT_KEYS
    (choice,) = body["choices"]
    assert set(choice) == VLLM_CHAT_CHOICE_KEYS
    assert set(choice["message"]) == VLLM_CHAT_MESSAGE_KEYS  # tool_calls only when there are some
    assert body["prompt_logprobs"] is None and body["prompt_token_ids"] is None and choice["token_ids"] is None


def test_stream_chunks_carry_vllms_choice_fields(http):
    for chunk in stream(http, "completions"):
        (choice,) = chunk["choices"]
        assert set(choice) == VLLM_COMPLETION_CHUNK_CHOICE_KEYS
    chunks = stream(http, "chat/completions")
    for chunk in chunks:
        (choice,) = chunk["choices"]
        finished = choice["finish_reason"] is not None
        assert set(choice) == VLLM_CHAT_CHUNK_CHOICE_KEYS | ({"stop_reason"} if finished else set())
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_tokenize_sends_token_strs_null_unless_asked(http):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello there"})
    assert r.status_code == 200 and set(r.json()) == VLLM_TOKENIZE_KEYS and r.json()["token_strs"] is None
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello there", "return_token_strs": True})
    assert len(r.json()["token_strs"]) == r.json()["count"]


def test_openai_client_reads_the_bodies(base_url):
    client = openai_client(base_url)
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert completion.choices[0].model_extra["prompt_logprobs"] is None
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.refusal is None


# ---- 14. errors that name what is wrong ------------------------------------------------

@pytest.mark.parametrize("field, value, param, says", [
    ("logit_bias", {"a": 1, "5": 2, "b": 3}, "logit_bias", ["'a'", "'b'", "not token ids"]),
    ("logit_bias", {"600": 1, "5": 2, "700": 3}, "logit_bias", ["[600, 700]", "[0, 512)"]),
    ("logit_bias", {"1": 500, "2": 1, "3": -101}, "logit_bias", ["'1': 500", "'3': -101", "[-100, 100]"]),
    ("prompt", [5, 900, 600, 7], "prompt", ["[600, 900]", "out of vocabulary", "[0, 512)"]),
    ("stop_token_ids", [3, 513], "stop_token_ids", ["[513]", "[0, 512)"]),
    ("allowed_token_ids", [3, 999], "allowed_token_ids", ["[999]", "[0, 512)"]),
    ("seed", 2**80, "seed", ["9223372036854775807", str(2**80)]),
])
def test_errors_name_every_offending_value_and_the_bound(http, field, value, param, says):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, field: value}
    error = assert_openai_error(http.post("/v1/completions", json=body), 400, param=param)
    for text in says:
        assert text in error["message"], error["message"]


def test_detokenize_names_the_out_of_vocabulary_ids(http):
    error = assert_openai_error(http.post("/detokenize", json={"model": MODEL, "tokens": [1, 512, 4000]}), 400,
                                param="tokens")
    assert "[512, 4000]" in error["message"] and "[0, 512)" in error["message"]


# ---- 2 and 5. prompt_logprobs over HTTP; -1, the whole vocabulary ---------------------

def assert_prompt_logprobs(entries: list, prompt_ids: list[int], top_n: int) -> None:
    """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank,
    decoded_token}} with the prompt's own token first and at most top_n others."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for entry, token_id in zip(entries[1:], prompt_ids[1:]):
        assert next(iter(entry)) == str(token_id) and top_n <= len(entry) <= top_n + 1, entry
        for value in entry.values():
            assert set(value) == {"logprob", "rank", "decoded_token"} and value["logprob"] <= 0
        ranks = sorted(v["rank"] for t, v in entry.items() if t != str(token_id))
        assert ranks == sorted(ranks) and all(1 <= r <= len(entry) for r in ranks)


def test_completion_prompt_logprobs_match_the_echoed_logprobs(http):
    body = complete(http, prompt_logprobs=2, max_tokens=2, return_token_ids=True)
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello there"}).json()["tokens"]
    entries = body["choices"][0]["prompt_logprobs"]
    assert_prompt_logprobs(entries, ids, 2)
    echoed = complete(http, echo=True, logprobs=2, max_tokens=2)["choices"][0]
    assert [e and e[str(t)]["logprob"] for e, t in zip(entries, ids)] == \
        pytest.approx(echoed["logprobs"]["token_logprobs"][:len(ids)], abs=1e-5)
    assert echoed["prompt_logprobs"] is not None  # echo with logprobs computes them, and vLLM sends them


def test_chat_prompt_logprobs_are_on_the_body(base_url):
    client = openai_client(base_url)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0,
                                           extra_body={"prompt_logprobs": 0})
    entries = reply.model_extra["prompt_logprobs"]
    assert len(entries) == reply.usage.prompt_tokens and all(len(e) == 1 for e in entries[1:])


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_prompt_logprobs_refused_as_vllm_refuses_them(http, route):
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"prompt": "Hello"} if route == "completions" else {"messages": MESSAGES})
    error = assert_openai_error(http.post(f"/v1/{route}", json={**base, "prompt_logprobs": -1}), 400,
                                param="prompt_logprobs")
    assert "max_logprobs=20" in error["message"] and "whole vocabulary" in error["message"]
    assert_openai_error(http.post(f"/v1/{route}", json={**base, "prompt_logprobs": -2}), 400, param="prompt_logprobs")
    error = assert_openai_error(http.post(f"/v1/{route}", json={**base, "prompt_logprobs": 1, "stream": True}), 400,
                                param="prompt_logprobs")
    assert "stream" in error["message"]
    r = http.post(f"/v1/{route}", json={**base, "prompt_logprobs": 0, "stream": True})
    assert r.status_code == 200, r.text


def test_minus_one_is_the_whole_vocabulary_where_max_logprobs_allows_it(http):
    body = complete(http, model=WIDE, prompt_logprobs=-1, logprobs=-1, max_tokens=2)
    (choice,) = body["choices"]
    assert all(len(entry) == VOCAB for entry in choice["prompt_logprobs"][1:])
    assert all(len(top) > 100 for top in choice["logprobs"]["top_logprobs"])  # token strings, some alike
    reply = chat(http, model=WIDE, logprobs=True, top_logprobs=-1, max_tokens=2)
    assert all(len(c["top_logprobs"]) == VOCAB for c in reply["choices"][0]["logprobs"]["content"])


def test_top_logprobs_minus_one_is_400_under_the_default_max_logprobs(http):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": -1}
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param="logprobs")
    assert "whole vocabulary" in error["message"]
    assert_openai_error(http.post("/v1/chat/completions", json={**body, "top_logprobs": -3}), 400,
                        param="top_logprobs")
    assert_openai_error(http.post("/v1/chat/completions", json={**body, "logprobs": False}), 400,
                        param="top_logprobs")


# ---- 3. return_token_ids, truncate_prompt_tokens, truncation_side ----------------------

def tokenize(http, **body) -> list[int]:
    return http.post("/tokenize", json={"model": MODEL, **body}).json()["tokens"]


def detokenize(http, ids: list[int]) -> str:
    return http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]


def test_completion_return_token_ids(http):
    (choice,) = complete(http, return_token_ids=True)["choices"]
    assert choice["prompt_token_ids"] == tokenize(http, prompt="Hello there")
    assert len(choice["token_ids"]) == 4 and detokenize(http, choice["token_ids"]) == choice["text"]
    (echoed,) = complete(http, return_token_ids=True, echo=True)["choices"]
    assert echoed["text"] == choice["text"]  # vLLM leaves the echoed prompt's text out: its ids are there


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_streamed_token_ids_add_up_to_the_whole_answer(http, route):
    whole = (complete if route == "completions" else chat)(http, return_token_ids=True)
    chunks = stream(http, route, return_token_ids=True, **({"prompt": "Hello there"} if route == "completions" else {}))
    if route == "completions":
        prompt_ids = [c["choices"][0]["prompt_token_ids"] for c in chunks]
        assert prompt_ids[0] == whole["choices"][0]["prompt_token_ids"] and not any(prompt_ids[1:])
    else:
        assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
        assert not any("prompt_token_ids" in c for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]


def test_chat_return_token_ids(http):
    body = chat(http, return_token_ids=True)
    assert body["prompt_token_ids"] == tokenize(http, messages=MESSAGES)
    assert len(body["choices"][0]["token_ids"]) == 4


@pytest.mark.parametrize("side, kept", [("left", slice(-4, None)), ("right", slice(0, 4)), (None, slice(0, 4))])
def test_truncate_prompt_tokens_keeps_the_side_asked(http, side, kept):
    ids = list(range(5, 25))
    body = complete(http, prompt=ids, truncate_prompt_tokens=4, truncation_side=side, return_token_ids=True)
    assert body["choices"][0]["prompt_token_ids"] == ids[kept]  # None: the tokenizer's side ("right" here)
    assert body["usage"]["prompt_tokens"] == 4


def test_truncate_prompt_tokens_bounds(http):
    body = complete(http, prompt=[7] * 300, truncate_prompt_tokens=-1, max_tokens=1)  # -1: what fits
    assert body["usage"]["prompt_tokens"] == ENGINE["max_model_len"] - 1
    error = assert_openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                                   "truncate_prompt_tokens": 500}), 400,
                                param="truncate_prompt_tokens")
    assert "max_model_len=128" in error["message"]
    assert_openai_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                                "truncation_side": "middle"}), 400,
                        param="truncation_side")
    reply = chat(http, truncate_prompt_tokens=3, return_token_ids=True)
    assert reply["prompt_token_ids"] == tokenize(http, messages=MESSAGES)[:3]


# ---- 6. usage on every stream chunk ----------------------------------------------------

def assert_continuous_usage(chunks: list[dict], prompt_tokens: int) -> None:
    *per_choice, last = chunks
    counts = [c["usage"]["completion_tokens"] for c in per_choice]
    assert counts == sorted(counts) and counts[-1] == 4
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in per_choice)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_continuous_usage_stats_put_usage_on_every_chunk(http, route):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream(http, route, stream_options=options)
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    assert_continuous_usage(chunks, prompt_tokens)
    plain = stream(http, route, stream_options={"include_usage": True})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["total_tokens"] == prompt_tokens + 4


def test_force_include_usage_reports_usage_unasked(http, base_url):
    chunks = stream(http, "completions", model=WIDE)
    assert_continuous_usage(chunks, chunks[-1]["usage"]["prompt_tokens"])
    client = openai_client(base_url)
    events = list(client.chat.completions.create(model=WIDE, messages=MESSAGES, max_tokens=4, stream=True,
                                                 temperature=0, extra_body={"ignore_eos": True}))
    assert events[-1].usage.completion_tokens == 4 and all(e.usage is not None for e in events)


# ---- 12. custom roles; 13. /invocations, /tokenizer_info, /tokenize with tools ----------

def test_custom_roles_reach_the_chat_template(http):
    messages = [{"role": "narrator", "content": "Once"}, {"role": "user", "content": "Hi"}]
    ids = tokenize(http, messages=messages)
    assert "<|im_start|>narrator\nOnce<|im_end|>" in detokenize(http, ids)
    assert chat(http, messages=messages)["usage"]["prompt_tokens"] == len(ids)
    refusing = "{% for m in messages %}{% if m.role == 'narrator' %}{{ raise_exception('no narrator') }}" \
               "{% endif %}{{ m.content }}{% endfor %}"
    error = assert_openai_error(http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "chat_template": refusing}), 400, param="messages")
    assert "no narrator" in error["message"]


def test_tokenize_renders_tools_into_the_prompt(http):
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    ids = tokenize(http, messages=MESSAGES, tools=tools, chat_template=template)
    assert ids == tokenize(http, prompt="[get_weather]Hello there", add_special_tokens=False)
    assert_openai_error(http.post("/tokenize", json={"model": MODEL, "prompt": "x", "tools": tools}), 400,
                        param="tools")


def test_invocations_route_chat_and_completion_bodies(http):
    r = http.post("/invocations", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    r = http.post("/invocations", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    with http.stream("POST", "/invocations", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                   "stream": True}) as r:
        assert sse_events(r)[-1] == "[DONE]"
    error = assert_openai_error(http.post("/invocations", json={"model": MODEL, "input": "x"}), 400)
    assert "ChatCompletionRequest" in error["message"]
    assert_openai_error(http.post("/invocations", content=b"[[[", headers={"content-type": "application/json"}), 400)
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200


def test_tokenizer_info_where_the_model_enables_it(http):
    r = http.get("/tokenizer_info", params={"model": WIDE})
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] and "vocab_file" not in info and "<|im_start|>" in info["chat_template"]
    assert_openai_error(http.get("/tokenizer_info", params={"model": MODEL}), 404)
    assert_openai_error(http.get("/tokenizer_info"), 400, param="model")  # two models: say which


# ---- 16. metrics under vLLM's names ----------------------------------------------------

def test_metrics_also_under_vllms_names_and_labels(http, base_url):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[tuple[str, str], float]:
        text = httpx.get(base_url + "/metrics").text
        return {(s.name, s.labels.get("engine", "")): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.labels.get("model_name") == MODEL and not s.labels.get("finished_reason")
                and s.labels.get("le") is None}

    before = scrape()
    body = complete(http, prompt=list(range(30, 39)), max_tokens=5)  # less than a KV block: no prefix-cache hit
    after = scrape()

    def delta(name: str, engine: str = "0") -> float:
        return after[(name, engine)] - before.get((name, engine), 0.0)

    for ours, theirs in [("servax:prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("servax:generation_tokens_total", "vllm:generation_tokens_total"),
                         ("servax:e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"),
                         ("servax:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count")]:
        assert delta(ours, "") == delta(theirs) > 0, (ours, theirs)
    assert delta("vllm:request_time_per_output_token_seconds_count") == 1
    assert ("vllm:num_requests_running", "0") in after and ("vllm:kv_cache_usage_perc", "0") in after
    # One prefill step of the 9 prompt tokens, then one step per generated token after the first.
    assert delta("vllm:iteration_tokens_total_count") == 1 + 4
    assert delta("vllm:iteration_tokens_total_sum") == body["usage"]["prompt_tokens"] + 5 - 1
    assert delta("servax:iteration_tokens_total_sum", "") == delta("vllm:iteration_tokens_total_sum")


# ---- beam search (item 8): refused, never ignored ---------------------------------------------

@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": "Hello"}),
                                         ("/v1/chat/completions", {"messages": MESSAGES})])
def test_use_beam_search_is_a_400_that_says_so(http, route, body):
    for stream in (False, True):
        r = http.post(route, json={"model": MODEL, "n": 2, "use_beam_search": True, "length_penalty": 0.5,
                                   "stream": stream, **body})
        error = assert_openai_error(r, 400, "use_beam_search")
        assert "beam search" in error["message"]
    # As in vLLM, length_penalty alone changes nothing (only beam search reads it): not even ignored-listed.
    r = http.post(route, json={"model": MODEL, "max_tokens": 2, "use_beam_search": False, "length_penalty": 2.0,
                               **GREEDY, **body})
    assert r.status_code == 200 and "x-servax-ignored-fields" not in r.headers


# ---- 4. return_tokens_as_token_ids -----------------------------------------------------------

def ids_named(names) -> list[int]:
    assert all(n.startswith("token_id:") for n in names), names
    return [int(n[len("token_id:"):]) for n in names]


def test_completion_logprobs_name_tokens_by_id_when_asked(http):
    body = complete(http, logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True, max_tokens=4)
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert ids_named(lp["tokens"]) == choice["token_ids"]
    assert all(len(ids_named(top)) >= 2 for top in lp["top_logprobs"])
    # Offsets count the names, as vLLM's do.
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert choice["text"] == detokenize(http, choice["token_ids"])  # the text itself is unchanged
    plain = complete(http, logprobs=2, max_tokens=4)["choices"][0]["logprobs"]
    assert not any(t.startswith("token_id:") for t in plain["tokens"])


def test_chat_logprobs_name_tokens_by_id_when_asked_or_served_so(http):
    reply = chat(http, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True)
    (choice,) = reply["choices"]
    content = choice["logprobs"]["content"]
    assert ids_named([c["token"] for c in content]) == choice["token_ids"]
    assert all(len(ids_named([t["token"] for t in c["top_logprobs"]])) == 2 for c in content)
    # A position's own bytes stay its text's; its alternatives' are their names' (vLLM's).
    texts = [detokenize(http, [t]) for t in choice["token_ids"]]
    assert [c["bytes"] for c in content] == [list(t.encode()) for t in texts]
    assert all(t["bytes"] == list(t["token"].encode()) for c in content for t in c["top_logprobs"])
    # The model served with return_tokens_as_token_ids names ids unless the request says false.
    served = chat(http, model=WIDE, logprobs=True, return_token_ids=True)["choices"][0]
    assert ids_named([c["token"] for c in served["logprobs"]["content"]]) == served["token_ids"]
    off = chat(http, model=WIDE, logprobs=True, return_tokens_as_token_ids=False)["choices"][0]
    assert not any(c["token"].startswith("token_id:") for c in off["logprobs"]["content"])
    streamed = stream(http, "chat/completions", model=WIDE, logprobs=True)
    names = [c["token"] for e in streamed for ch in e["choices"] if ch.get("logprobs")
             for c in ch["logprobs"]["content"]]
    assert len(names) == 4 and ids_named(names)


def test_logprob_token_ids_report_exactly_those_ids(http):
    """vLLM's logprob_token_ids: each position reports the named ids' logprobs (and the chosen
    token's), the same values the whole vocabulary gives (WIDE serves max_logprobs -1 and names
    tokens token_id:<id>), however many logprobs were asked for."""
    ids = [7, 300, 42]
    names = {f"token_id:{t}" for t in ids}
    whole = complete(http, model=WIDE, logprobs=-1)["choices"][0]["logprobs"]
    asked = complete(http, model=WIDE, logprobs=1, logprob_token_ids=ids)["choices"][0]["logprobs"]
    assert asked["tokens"] == whole["tokens"]
    for top, full, token in zip(asked["top_logprobs"], whole["top_logprobs"], asked["tokens"]):
        assert set(top) == names | {token}
        for name in top:
            assert abs(top[name] - full[name]) < 1e-5, name
    content = chat(http, model=WIDE, logprobs=True, top_logprobs=5, logprob_token_ids=ids)["choices"][0]
    for position in content["logprobs"]["content"]:
        assert {c["token"] for c in position["top_logprobs"]} == names | {position["token"]}


def test_logprob_token_ids_refused_as_vllm_refuses_them(http):
    cases = [
        ("/v1/completions", {"prompt": "Hi"}, "logprobs must be set"),  # logprobs unset
        ("/v1/chat/completions", {"messages": MESSAGES}, "logprobs must be set to true"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 1, "logprob_token_ids": [3, VOCAB, 9999]},
         f"[{VOCAB}, 9999]"),  # every out-of-vocabulary id named, with the bound
        ("/v1/completions", {"prompt": "Hi", "logprobs": 1, "logprob_token_ids": list(range(129))}, "at most 128"),
    ]
    for route, body, message in cases:
        body = {"logprob_token_ids": [1, 2], **body}
        r = http.post(route, json={"model": MODEL, **body})
        assert message in assert_openai_error(r, 400, "logprob_token_ids")["message"], body
