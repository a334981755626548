"""Hostile input against the running OpenAI app: oversized and deeply nested bodies, invalid
UTF-8, absurd counts, token ids outside the vocabulary, NaN, wrong types, and a property-based
fuzz (hypothesis) of completion and chat bodies. Always a 4xx with an OpenAI error body, never
a 500, and the server keeps serving with no KV block held afterwards."""

from __future__ import annotations

import collections
import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (assert_openai_error, local_llm_server, local_llm_servers, openai_api_server, quick_loop_keeps,
                      wait_idle)

MODEL = "fuzz-tiny"
ENGINE = dict(model_impl="jax", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128, num_kv_blocks=64,
              show_progress=False)
VOCAB = 512  # servax-tiny/llama's


@pytest.fixture(scope="module")
def base_url():
    with local_llm_servers([{"model_loading_config": {"model_id": MODEL, "model_source": "servax-tiny/llama"},
                             "engine_kwargs": ENGINE}]) as handles, openai_api_server(handles) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


def assert_still_serving(http) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    wait_idle(local_llm_server(MODEL).engine)


def test_oversized_body_is_413(http):
    from app.body_limit import MAX_REQUEST_BODY_BYTES

    junk = "x" * (MAX_REQUEST_BODY_BYTES + 1)
    assert_openai_error(http.post("/v1/completions", content=json.dumps({"model": MODEL, "prompt": junk}),
                                  headers={"content-type": "application/json"}), 413)

    def chunks():  # no Content-Length: the limit holds while the body streams in
        for _ in range(MAX_REQUEST_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    assert_openai_error(http.post("/v1/chat/completions", content=chunks(),
                                  headers={"content-type": "application/json"}), 413)
    assert_still_serving(http)


def test_deeply_nested_json_is_400(http):
    depth = 100_000
    body = '{"model": "%s", "prompt": %s1%s}' % (MODEL, "[" * depth, "]" * depth)
    assert_openai_error(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}),
                        400)
    body = '{"model": "%s", "messages": [%s"hi"%s]}' % (MODEL, '{"role": "user", "content": [' * 5000, "]}" * 5000)
    r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    assert_still_serving(http)


def test_invalid_utf8_is_400(http):
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "caf\xe9 \xff\xfe", "max_tokens": 2}'
    assert_openai_error(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}),
                        400)
    assert_still_serving(http)


@pytest.mark.parametrize("field, value", [
    ("n", 10**9), ("n", 0), ("max_tokens", -1), ("logprobs", 10**6), ("logprobs", -3),
    ("best_of", 10**6), ("temperature", float("nan")), ("temperature", -1.0), ("top_p", float("inf")),
    ("top_p", 0.0), ("top_k", -5), ("seed", 2**80), ("presence_penalty", 1e308), ("frequency_penalty", float("-inf")),
    ("logit_bias", {"999999999": 5}), ("logit_bias", {"1": float("nan")}), ("stop", [""] * 3),
    ("stop_token_ids", [-1]), ("allowed_token_ids", [10**12]), ("prompt", [-1, 5]), ("prompt", [VOCAB, 1]),
    ("prompt", [2**40]), ("prompt", [[1, 2], [VOCAB + 3]]), ("prompt", ""), ("prompt", []), ("prompt", {"a": 1}),
    ("prompt", 3.5), ("prompt", [1, "a"]), ("prompt", ["a", {"x": 1}]), ("prompt", [[1, 2], ["a"]]),
    ("prompt", [[1, 2], None]), ("stop_token_ids", ["a", 1]), ("stop", ["a", 1]), ("bad_words", ["a", [1]]),
    ("model", ["a"]), ("stream", [1]), ("echo", [1]), ("max_tokens", "ten"),
    ("stream_options", {"include_usage": True}), ("response_format", {"type": "xml"}),
    ("structured_outputs", {"regex": "("}), ("guided_json", "{not json"), ("min_tokens", 10**9),
])
def test_impossible_completion_values_are_400(http, field, value):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, field: value}
    content = json.dumps(body, allow_nan=True)  # NaN / Infinity as Python's json writes them
    r = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


def test_impossible_chat_values_are_400(http):
    for messages in ([], [{"role": 5, "content": "hi"}], [{"content": "hi"}], "hi", [{"role": "user", "content": 5}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                     [{"role": "user", "content": [1, "a"]}], [{"role": "user", "content": [{"type": "text", "text": [1]}]}],
                     [{"role": "assistant", "content": "x", "tool_calls": [1, "a"]}],
                     [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": 1}}]}],
                     [{"role": "tool", "content": "x", "tool_call_id": ["a"]}]):
        assert_openai_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}), 400)
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for extra in ({"top_logprobs": 10**6, "logprobs": True}, {"max_completion_tokens": -4}, {"tool_choice": "required"},
                  {"tools": [{"type": "function", "function": {"name": ""}}]}, {"n": -1}):
        assert_openai_error(http.post("/v1/chat/completions", json={**base, **extra}), 400)
    assert_still_serving(http)


def test_unknown_fields_of_any_name_are_ignored_and_listed_percent_encoded(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "é\n字": 1, "ok_name": 2})
    assert r.status_code == 200, r.text
    assert r.headers["x-servax-ignored-fields"] == "ok_name,%C3%A9%0A%E5%AD%97"


# -- property-based fuzz ------------------------------------------------------------------

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                       max_leaves=12)
# Lists whose items mix types where a field expects one type throughout ([1, "a"], [[1], {}], ...).
_MIXED = st.lists(st.one_of(st.integers(-3, VOCAB + 3), st.text(max_size=8), st.lists(st.integers(0, VOCAB), max_size=3),
                            st.dictionaries(st.text(max_size=4), _SCALARS, max_size=2), st.floats(), st.booleans(),
                            st.none()), min_size=1, max_size=5)
_SAMPLING_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos",
                    "min_tokens", "stream", "stream_options", "user", "response_format", "structured_outputs",
                    "allowed_token_ids", "bad_words", "skip_special_tokens", "prompt_logprobs", "return_token_ids",
                    "truncate_prompt_tokens", "no_such_field"]
# Values near the edge of valid for the fields that take numbers, so the fuzz also reaches the engine.
_NEAR_VALID = {
    "max_tokens": st.integers(-2, 200), "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 600), "min_p": st.floats(-0.5, 1.5), "n": st.integers(-1, 12),
    "seed": st.integers(-2**64, 2**64), "stop_token_ids": st.lists(st.integers(-2, VOCAB + 2), max_size=3),
    "logit_bias": st.dictionaries(st.integers(-2, VOCAB + 2).map(str), st.floats(-200, 200), max_size=3),
    "stream": st.booleans(), "ignore_eos": st.booleans(), "min_tokens": st.integers(-1, 300),
    "allowed_token_ids": st.lists(st.integers(-1, VOCAB + 1), max_size=3), "prompt_logprobs": st.integers(-2, 30),
    "return_token_ids": st.booleans(), "truncate_prompt_tokens": st.integers(-2, 200),
}


def _field_value(name: str):
    return st.one_of(_NEAR_VALID[name], _VALUES, _MIXED) if name in _NEAR_VALID else st.one_of(_VALUES, _MIXED)


@st.composite
def _bodies(draw, route: str):
    body: dict = {"model": draw(st.sampled_from([MODEL, MODEL, "nope", 5]))}
    if route == "completions":
        body["prompt"] = draw(st.one_of(st.text(max_size=40), st.lists(st.integers(-3, VOCAB + 3), max_size=20),
                                        _VALUES, _MIXED))
    else:
        parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 3])},
                                               optional={"text": _SCALARS}), max_size=2)
        content = st.integers(0, 5).flatmap(lambda k: st.one_of(_VALUES, _MIXED, parts) if k == 0
                                            else st.text(max_size=40))
        message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                         "content": content})
        junk_calls = st.fixed_dictionaries({"role": st.just("assistant"), "tool_calls": st.one_of(_VALUES, _MIXED)})
        body["messages"] = draw(st.one_of(st.lists(message, max_size=3), st.lists(message, max_size=3),
                                          st.lists(junk_calls, max_size=1), _VALUES))
    for name in draw(st.lists(st.sampled_from(_SAMPLING_FIELDS), max_size=5, unique=True)):
        body[name] = draw(_field_value(name))
    for name in draw(st.lists(st.text(max_size=6), max_size=2)):  # unknown fields, any name (unicode, newlines)
        body.setdefault(name, draw(_SCALARS))
    return body


_BLOCKS = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=20), _SCALARS)}),
    st.fixed_dictionaries({"type": st.just("tool_use")}, optional={"id": _SCALARS, "name": _SCALARS, "input": _VALUES}),
    st.fixed_dictionaries({"type": st.just("tool_result")},
                          optional={"tool_use_id": _SCALARS, "content": st.one_of(_VALUES, _MIXED)}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image", "redacted_thinking", "x", 3])},
                          optional={"thinking": _SCALARS, "source": _VALUES}))
_MESSAGES_FIELDS = {
    "max_tokens": st.integers(-2, 40), "system": st.one_of(st.text(max_size=20), st.lists(_BLOCKS, max_size=2)),
    "stop_sequences": st.lists(st.text(max_size=4), max_size=3), "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-3, 600), "stream": st.booleans(), "metadata": _VALUES,
    "tools": st.lists(st.fixed_dictionaries({"name": st.text(max_size=6)}, optional={"input_schema": _VALUES}),
                      max_size=2),
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                                         optional={"name": _SCALARS, "disable_parallel_tool_use": _SCALARS}),
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive", 1])},
                                      optional={"budget_tokens": st.integers(-1, 5000)}),
    "chat_template_kwargs": _VALUES, "no_such_field": _SCALARS,
}


@st.composite
def _messages_bodies(draw):
    """Anthropic Messages bodies: content blocks of every kind, mixed with junk."""
    body: dict = {"model": draw(st.sampled_from([MODEL, MODEL, "nope", 5]))}
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "user", "system", 1]),
                                     "content": st.one_of(st.text(max_size=30), st.lists(_BLOCKS, max_size=3),
                                                          _VALUES)})
    body["messages"] = draw(st.one_of(st.lists(message, min_size=1, max_size=3), _VALUES))
    if draw(st.integers(0, 9)):
        body["max_tokens"] = draw(st.integers(1, 8))
    for name in draw(st.lists(st.sampled_from(sorted(_MESSAGES_FIELDS)), max_size=4, unique=True)):
        body[name] = draw(st.one_of(_MESSAGES_FIELDS[name], _VALUES))
    return body


_PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image", "x", 3])},
                                        optional={"text": _SCALARS}), max_size=2)
_ITEMS = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", 1])},
                          optional={"type": st.sampled_from(["message", "x"]),
                                    "content": st.one_of(st.text(max_size=20), _PARTS, _VALUES)}),
    st.fixed_dictionaries({"type": st.just("function_call")},
                          optional={"call_id": _SCALARS, "name": _SCALARS, "arguments": st.one_of(_SCALARS, _VALUES)}),
    st.fixed_dictionaries({"type": st.just("function_call_output")},
                          optional={"call_id": _SCALARS, "output": st.one_of(st.text(max_size=10), _PARTS, _VALUES)}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "web_search_call", 4])},
                          optional={"summary": st.one_of(_PARTS, _VALUES), "content": _PARTS,
                                    "encrypted_content": _SCALARS}))
_RESPONSES_FIELDS = {
    "max_output_tokens": st.integers(-2, 40), "instructions": st.one_of(st.text(max_size=20), _SCALARS),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-3, 600),
    "stream": st.booleans(), "store": st.booleans(), "background": st.booleans(), "metadata": _VALUES,
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search", "x"])},
                                            optional={"name": st.text(max_size=6), "parameters": _VALUES}), max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "x"]), st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "allowed_tools", 2])}, optional={"name": _SCALARS})),
    "text": st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
        optional={"name": _SCALARS, "schema": _VALUES, "strict": _SCALARS})}),
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["none", "low", "high", "x", 1])}),
    "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content", "x"]),
                        max_size=2),
    "top_logprobs": st.integers(-1, 25), "previous_response_id": st.one_of(st.text(max_size=8), _SCALARS),
    "logit_bias": st.dictionaries(st.integers(-2, VOCAB + 2).map(str), st.floats(-200, 200), max_size=2),
    "stop": st.one_of(st.text(max_size=4), _MIXED), "seed": st.integers(-2**64, 2**64), "no_such_field": _SCALARS,
}


@st.composite
def _responses_bodies(draw):
    """OpenAI Responses bodies: input as text or items of every kind, mixed with junk."""
    body: dict = {"model": draw(st.sampled_from([MODEL, MODEL, "nope", 5]))}
    body["input"] = draw(st.one_of(st.text(max_size=30), st.lists(_ITEMS, min_size=1, max_size=3), _VALUES))
    if draw(st.integers(0, 9)):
        body["max_output_tokens"] = draw(st.integers(1, 8))
    for name in draw(st.lists(st.sampled_from(sorted(_RESPONSES_FIELDS)), max_size=4, unique=True)):
        body[name] = draw(st.one_of(_RESPONSES_FIELDS[name], _VALUES))
    return body


def _check(http, path: str, body) -> int:
    """Send one fuzzed body; its status, once the answer has the right shape."""
    content = json.dumps(body, allow_nan=True)
    with http.stream("POST", path, content=content, headers={"content-type": "application/json"}) as r:
        raw = r.read()
    assert r.status_code < 500, (r.status_code, raw[:500], body)
    if r.status_code >= 400 and os.environ.get("FUZZ_DEBUG"):
        print(r.status_code, raw[:150])
    if r.status_code >= 400:
        err = json.loads(raw)["error"]
        assert err["message"] and err["type"], err
        assert not path.startswith("/v1/messages") or json.loads(raw)["type"] == "error", raw[:300]
    elif not r.headers["content-type"].startswith("text/event-stream"):
        answer = json.loads(raw)
        assert answer.get("choices") or answer.get("content") or answer.get("object") == "response" or answer.get("data") or answer.get("results") or \
            {"tokens", "prompt", "input_tokens"} & set(answer), \
            raw[:300]
    elif path.startswith("/v1/responses"):  # the Responses API's events: no [DONE]
        assert raw.rstrip().split(b"\n")[0] == b"event: response.created", raw[:300]
        assert b'"type": "response.completed"' in raw.rstrip().split(b"\n")[-1], raw[-300:]
        assert b"event: error" not in raw, raw[:500]
    elif path.startswith("/v1/messages"):  # Anthropic's events: no [DONE]
        assert raw.rstrip().endswith(b'data: {"type": "message_stop"}'), raw[-300:]
        assert b"event: error" not in raw, raw[:500]
    else:
        assert raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]
        assert b'"error"' not in raw, raw[:500]
    return r.status_code


def _fuzz(http, path: str, bodies, examples: int) -> collections.Counter:
    """Send `examples` bodies drawn from `bodies` (the same ones every run); the statuses seen."""
    outcomes: collections.Counter = collections.Counter()

    # derandomize: the same bodies every run (a random draw served only 2 of 300 in one run of many).
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    @given(body=bodies)
    def send(body):
        outcomes[_check(http, path, body)] += 1

    send()
    print(f"\n{path}: {dict(outcomes)}")
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("route", quick_loop_keeps(["completions", "chat/completions"], "chat/completions"))
def test_fuzzed_bodies_never_500(http, route):
    """300 random bodies per route (hypothesis), types mixed inside lists and objects: many
    refused, some served; never a 5xx."""
    outcomes = _fuzz(http, f"/v1/{route}", _bodies(route), 300)
    assert outcomes[200] >= 3 and sum(n for status, n in outcomes.items() if status >= 400) >= 100, outcomes
    assert_still_serving(http)


@pytest.mark.slow
def test_fuzzed_anthropic_messages_never_500(http):
    """300 random Anthropic Messages bodies (content blocks of every kind, junk mixed in): 4xx
    in Anthropic's error shape or a message, never a 5xx."""
    outcomes = _fuzz(http, "/v1/messages", _messages_bodies(), 300)
    assert outcomes[200] >= 3 and sum(n for status, n in outcomes.items() if status >= 400) >= 100, outcomes
    assert_still_serving(http)


@pytest.mark.slow
def test_fuzzed_responses_never_500(http):
    """300 random Responses bodies (items of every kind, junk mixed in): a 4xx in OpenAI's error
    shape or a Response, never a 5xx; stored-response ids of any text are a 404."""
    outcomes = _fuzz(http, "/v1/responses", _responses_bodies(), 300)
    assert outcomes[200] >= 3 and sum(n for status, n in outcomes.items() if status >= 400) >= 100, outcomes
    for response_id in ["resp_x", "é" * 3, "a" * 5000, "%00", "..%2F..", "{}", " "]:
        for method, path in (("GET", f"/v1/responses/{response_id}"), ("POST", f"/v1/responses/{response_id}/cancel")):
            r = http.request(method, path)
            assert r.status_code == 404 and r.json()["error"]["message"], (path, r.text[:200])
    assert_still_serving(http)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["completions", "chat/completions"])
def test_fuzzed_invocations_never_500(http, kind):
    """/invocations (SageMaker's, vLLM's) picks the route from the body: the same bodies, never a 5xx."""
    outcomes = _fuzz(http, "/invocations", _bodies(kind), 100)
    assert sum(n for status, n in outcomes.items() if status >= 400) >= 30, outcomes
    assert_still_serving(http)


# -- schema-driven fuzz of servax's own OpenAPI document ----------------------------------

def _from_schema(schema: dict, defs: dict, depth: int = 0):
    """Values for a JSON schema of the OpenAPI document: mostly of its type, sometimes any
    value at all (the type confusion a client's bug sends)."""
    if "$ref" in schema:
        return _from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, depth)
    if depth > 4:
        return _SCALARS
    if "anyOf" in schema or "oneOf" in schema:
        typed = st.one_of(*(_from_schema(s, defs, depth) for s in schema.get("anyOf") or schema["oneOf"]))
    elif "enum" in schema or "const" in schema:
        typed = st.sampled_from(schema.get("enum") or [schema["const"]])
    else:
        kind = schema.get("type")
        if kind == "object":
            props = {name: _from_schema(s, defs, depth + 1) for name, s in schema.get("properties", {}).items()}
            required = set(schema.get("required", ()))
            typed = st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                          optional={k: v for k, v in props.items() if k not in required})
        elif kind == "array":
            typed = st.lists(_from_schema(schema.get("items", {}), defs, depth + 1), max_size=4)
        else:
            typed = {"string": st.text(max_size=12), "integer": st.integers(-3, 300), "number": st.floats(-2, 300),
                     "boolean": st.booleans(), "null": st.none()}.get(kind, _VALUES)
    # Junk at one value in twenty (never the body itself): most bodies are wrong in a place or
    # two, and some are right enough to reach the engine.
    return st.integers(0, 19).flatmap(lambda k: st.one_of(_VALUES, _MIXED) if k == 0 and depth else typed)


def _openapi_bodies(http, path: str, name: str = MODEL):
    doc = http.get("/openapi.json").json()
    schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    model = st.sampled_from([name, name, name, "nope"])
    return st.tuples(_from_schema(schema, doc["components"]["schemas"]), model).map(
        lambda pair: {**pair[0], "model": pair[1]} if isinstance(pair[0], dict) else pair[0])


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                                  "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"])
def test_bodies_from_the_openapi_document_never_500(http, path):
    """Bodies drawn from the route's own request schema (servax's /openapi.json), with values of
    the wrong type mixed in at every level: never a 5xx."""
    outcomes = _fuzz(http, path, _openapi_bodies(http, path), 200)
    assert sum(n for status, n in outcomes.items() if status >= 400) >= 20, outcomes
    assert_still_serving(http)


POOL_MODEL = "fuzz-pool"


@pytest.fixture(scope="module")
def pooling_http():
    """A pooling engine (an embedding model) of its own, under POOL_MODEL."""
    with local_llm_servers([{"model_loading_config": {"model_id": POOL_MODEL, "model_source": "servax-tiny/qwen3"},
                             "engine_kwargs": {**ENGINE, "runner": "pooling"}}]) as handles, \
            openai_api_server(handles) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/score", "/rerank"])
def test_pooling_routes_fuzzed_never_500(pooling_http, path):
    """Bodies from the pooling routes' own schemas (inputs as text, ids, nested lists, junk;
    dimensions, encoding_format, top_n, ...) with wrong types mixed in: never a 5xx, and the
    engine still answers and holds no blocks afterwards."""
    outcomes = _fuzz(pooling_http, path, _openapi_bodies(pooling_http, path, POOL_MODEL), 150)
    assert sum(n for status, n in outcomes.items() if status >= 400) >= 20, outcomes
    r = pooling_http.post("/v1/embeddings", json={"model": POOL_MODEL, "input": "hello"})
    assert r.status_code == 200, r.text
    wait_idle(local_llm_server(POOL_MODEL).engine)
