"""Anthropic's Messages API (#43) over real HTTP, with the official `anthropic` client.

Two models behind one ingress (routed by `model`): the tiny Llama with hermes tool calls, and the
tiny thinking Qwen3 (tests/thinking_model.py) with `reasoning_parser: qwen3`. The weights are
random, so what is checked is made deterministic: a named tool choice (the grammar writes the
call), greedy replies repeated with a stop sequence cut from the first one, and a thinking reply
that never closes its thinking within max_tokens.
"""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import local_llm_servers, openai_api_server
from thinking_model import make_thinking_checkpoint

PLAIN, THINKER = "plain-tiny", "thinker-tiny"
API_KEY = "anthropic-key"
ENGINE = dict(model_impl="jax", max_model_len=640, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=256,
              show_progress=False, enable_auto_tool_choice=True, tool_call_parser="hermes")
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                            "required": ["city"]}}
GREEDY = {"temperature": 0}  # anthropic's client no longer names temperature: sent as it is in the body
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base_url(servax_cache):
    thinker = make_thinking_checkpoint(servax_cache / "thinking-qwen3")
    with local_llm_servers([
        {"model_loading_config": {"model_id": PLAIN, "model_source": "servax-tiny/llama"}, "engine_kwargs": ENGINE},
        {"model_loading_config": {"model_id": THINKER, "model_source": str(thinker)},
         "engine_kwargs": dict(ENGINE, reasoning_parser="qwen3")},
    ]) as handles, openai_api_server(handles, API_KEY) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    import anthropic

    return anthropic.Anthropic(base_url=base_url, api_key=API_KEY, max_retries=0)


def _events(base_url: str, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", base_url + "/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": API_KEY}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    events = []
    for frame in text.strip().split("\n\n"):
        name, data = frame.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), frame
        events.append((name[len("event: "):], json.loads(data[len("data: "):])))
        assert events[-1][0] == events[-1][1]["type"]
    return events


def test_errors_take_anthropics_shape_with_the_right_status(base_url):
    def post(body, path="/v1/messages", key=API_KEY):
        r = httpx.post(base_url + path, json=body, headers={"x-api-key": key}, timeout=60)
        return r.status_code, r.json()

    ok = {"model": PLAIN, "messages": ASK, "max_tokens": 2}
    for body, status, kind, words in [
        ({**ok, "max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        ({"model": PLAIN, "messages": ASK}, 400, "invalid_request_error", "max_tokens: Field required"),
        ({**ok, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
        ({**ok, "model": "nope"}, 404, "not_found_error", "nope"),
        ({**ok, "messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_request_error", "messages.0.role"),
        ({**ok, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error",
         "at least one user or assistant message"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
         "invalid_request_error", "image content blocks are not supported"),
        ({**ok, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, 400, "invalid_request_error",
         "'other', which is not among the tools"),
        ({**ok, "tools": [WEATHER], "tool_choice": {"type": "tool"}}, 400, "invalid_request_error", "tool_choice.name"),
        ({**ok, "temperature": -1}, 400, "invalid_request_error", "temperature"),
        ({**ok, "thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, "invalid_request_error",
         "budget_tokens must be less than max_tokens"),
        ({**ok, "messages": []}, 400, "invalid_request_error", "at least one user or assistant message"),
    ]:
        got, err = post(body)
        assert (got, err["type"], err["error"]["type"]) == (status, "error", kind), (body, err)
        assert words in err["error"]["message"], (body, err)
    got, err = post(ok, key="wrong")
    assert got == 401 and err["error"]["type"] == "authentication_error"
    got, err = post({"model": PLAIN, "messages": "hi"}, path="/v1/messages/count_tokens")
    assert got == 400 and err["error"]["type"] == "invalid_request_error"
    r = httpx.post(base_url + "/v1/messages", content=b"{not json", headers={"x-api-key": API_KEY,
                                                                            "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.slow
def test_anthropic_client_calls_a_tool_streamed_and_not(client, base_url):
    kw = dict(model=PLAIN, max_tokens=60, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
              messages=ASK, system=[{"type": "text", "text": "You are terse."}], extra_body=GREEDY,
              metadata={"user_id": "u-1"})
    message = client.messages.create(**kw)
    assert message.type == "message" and message.role == "assistant" and message.model == PLAIN
    assert message.id.startswith("msg_") and message.stop_reason == "tool_use"
    (call,) = [b for b in message.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Rome") and call.id
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0

    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.model_dump() for b in final.content if b.type == "tool_use"][0]["input"] == call.input
    body = {k: v for k, v in kw.items() if k != "extra_body"}
    names = [name for name, _ in _events(base_url, {**body, **GREEDY})]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(names)

    # The tool's result goes back as a tool_result block; the reply is text.
    follow = client.messages.create(model=PLAIN, max_tokens=6, extra_body=GREEDY, tools=[WEATHER], messages=[
        *ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                 "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"}]}],
        tool_choice={"type": "none"})
    assert follow.content[0].type == "text" and follow.stop_reason == "max_tokens"

    # Counted as the prompt is rendered: Qwen3's template writes the tools into it.
    counted = client.messages.count_tokens(model=THINKER, messages=ASK, tools=[WEATHER])
    assert counted.input_tokens > client.messages.count_tokens(model=THINKER, messages=ASK).input_tokens > 0


@pytest.mark.slow
def test_stop_sequences_and_routing_by_model(client):
    first = client.messages.create(model=PLAIN, max_tokens=12, extra_body=GREEDY, messages=ASK)
    text = first.content[0].text
    assert first.stop_reason == "max_tokens" and len(text) > 4
    stop = text[3:5]
    cut = client.messages.create(model=PLAIN, max_tokens=12, extra_body=GREEDY, messages=ASK, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    other = client.messages.create(model=THINKER, max_tokens=4, extra_body=GREEDY, messages=ASK,
                                   thinking={"type": "disabled"})
    assert other.model == THINKER and [b.type for b in other.content] == ["text"]


@pytest.mark.slow
def test_reasoning_comes_back_as_thinking_blocks(client, base_url):
    kw = dict(model=THINKER, max_tokens=8, extra_body=GREEDY, messages=ASK)
    message = client.messages.create(**kw)
    assert [b.type for b in message.content] == ["thinking"] and message.stop_reason == "max_tokens"
    assert message.content[0].thinking and message.content[0].signature
    events = _events(base_url, {k: v for k, v in kw.items() if k != "extra_body"} | GREEDY)
    thinking = "".join(e["delta"]["thinking"] for name, e in events
                       if name == "content_block_delta" and e["delta"]["type"] == "thinking_delta")
    assert thinking == message.content[0].thinking
    assert not any(e["delta"]["type"] == "text_delta" for name, e in events if name == "content_block_delta")
    assert any(e["delta"]["type"] == "signature_delta" for name, e in events if name == "content_block_delta")
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens" and events[-2][1]["usage"]["output_tokens"] == 8
    # The thinking goes back to the template as the assistant turn's reasoning.
    again = client.messages.create(model=THINKER, max_tokens=2, extra_body=GREEDY, messages=[
        *ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hmm.", "signature": "s"},
                                                {"type": "text", "text": "Sunny."}]},
        {"role": "user", "content": "Sure?"}])
    assert again.stop_reason == "max_tokens"
