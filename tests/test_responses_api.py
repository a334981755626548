"""OpenAI's Responses API (#43) over real HTTP, with the official `openai` client and LangChain.

Two models behind one ingress (routed by `model`): the tiny Llama with hermes tool calls, and the
tiny thinking Qwen3 (tests/thinking_model.py) with `reasoning_parser: qwen3`. The weights are
random, so what is checked is made deterministic: a named tool choice or a JSON schema (the
grammar writes the answer), greedy replies compared streamed and not, and a thinking reply that
never closes its thinking within max_output_tokens.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from conftest import local_llm_servers, openai_api_server, openai_client
from thinking_model import make_thinking_checkpoint

PLAIN, THINKER = "plain-tiny", "thinker-tiny"
API_KEY = "responses-key"
ENGINE = dict(model_impl="jax", max_model_len=640, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=256,
              show_progress=False, enable_auto_tool_choice=True, tool_call_parser="hermes")
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": CITY}
ASK = "What is the weather in Paris?"


def test_items_become_one_chat_conversation():
    """The request's items turn into the chat messages vLLM renders (no server needed)."""
    from pydantic import ValidationError

    from app.responses_request import ResponsesRequest
    from runtime.engine.errors import InvalidRequestError

    request = ResponsesRequest.model_validate({"model": PLAIN, "instructions": "Be terse.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "there"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Think."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        {"role": "developer", "content": "Again."}], "tools": [WEATHER]})
    chat = request.chat_request([])
    assert [(m["role"], m.get("content")) for m in chat.chat_messages()] == [
        ("system", "Be terse."), ("user", "Hi\nthere"), ("assistant", ""), ("tool", "Sunny"),
        ("assistant", "Sunny."), ("developer", "Again.")]
    turn = chat.chat_messages()[2]
    assert turn["reasoning_content"] == "Think." and turn["tool_calls"][0]["function"]["name"] == "get_weather"
    assert chat.tool_choice == "auto" and chat.tools[0].function.parameters == CITY
    assert ResponsesRequest(input="x", tool_choice="auto").tool_choice == "none"  # no tools, as vLLM
    for body, param in [({"input": "x", "tool_choice": "required"}, "tool_choice"),
                        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}},
                         "tool_choice"),
                        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]},
                         "input.0.encrypted_content"),
                        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input.0.content.0.type"),
                        ({"input": "x", "background": True, "store": False}, "background"),
                        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
                         "text.format.schema"),
                        ({"input": "x", "reasoning": {"effort": "high"}, "chat_template_kwargs": 3},
                         "chat_template_kwargs")]:
        with pytest.raises(ValidationError) as e:
            ResponsesRequest.model_validate(body)
        first = e.value.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        named = cause.param if isinstance(cause, InvalidRequestError) else ".".join(map(str, first["loc"]))
        assert named == param, (body, e.value)


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
    return openai_client(base_url, API_KEY)


def _events(base_url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base_url + "/v1/responses", json={**body, "stream": True},
                      headers={"authorization": f"Bearer {API_KEY}"}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    events = []
    for frame in text.strip().split("\n\n"):
        name, data = frame.split("\n", 1)
        events.append(json.loads(data[len("data: "):]))
        assert name == "event: " + events[-1]["type"], frame
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _post(base_url: str, body: dict, path: str = "/v1/responses", key: str = API_KEY) -> tuple[int, dict]:
    r = httpx.post(base_url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=120)
    return r.status_code, r.json()


@pytest.mark.slow
def test_errors_take_openais_shape_with_the_right_status(base_url):
    ok = {"model": PLAIN, "input": ASK, "max_output_tokens": 2}
    for body, status, words in [
        ({"model": PLAIN}, 400, "input: Field required"),
        ({**ok, "input": 5}, 400, "input: Input should be a valid string"),
        ({**ok, "input": [{"type": "web_search_call"}]}, 400, "'web_search_call' found"),
        ({**ok, "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({**ok, "model": "nope"}, 404, "nope"),
        ({**ok, "temperature": -1}, 400, "temperature"),
        ({**ok, "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
        ({**ok, "previous_response_id": "resp_missing"}, 404, "Response with id 'resp_missing' not found."),
        ({**ok, "input": "word " * 700}, 400, "max_model_len=640"),
        ({**ok, "prompt": {"id": "p"}}, 400, "prompt template is not supported"),
        ({**ok, "background": True, "stream": True}, 400, "background streaming"),
        ({**ok, "include": ["file_search_call.results"]}, 400, "include"),
    ]:
        got, err = _post(base_url, body)
        assert got == status and err["error"]["type"] and words in err["error"]["message"], (body, got, err)
    got, err = _post(base_url, ok, key="wrong")
    assert got == 401 and err["error"]["code"] == "invalid_api_key"
    r = httpx.get(base_url + "/v1/responses/resp_missing", headers={"authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"


@pytest.mark.slow
def test_openai_client_text_streamed_and_not_then_retrieved_and_continued(client, base_url):
    kw = dict(model=PLAIN, input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}],
              instructions="Be terse.", max_output_tokens=6, temperature=0, metadata={"k": "v"})
    response = client.responses.create(**kw)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == PLAIN
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output_text
    assert response.usage.output_tokens == 6 and response.usage.input_tokens > 0
    assert response.instructions == "Be terse." and response.metadata == {"k": "v"}

    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert final.output_text == response.output_text and final.status == "incomplete"
    events = _events(base_url, kw)
    names = [e["type"] for e in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == response.output_text

    stored = client.responses.retrieve(response.id)
    assert stored.id == response.id and stored.output_text == response.output_text
    follow = client.responses.create(model=PLAIN, input="And Rome?", previous_response_id=response.id,
                                     max_output_tokens=2, temperature=0)
    assert follow.previous_response_id == response.id and follow.usage.input_tokens > response.usage.input_tokens
    unstored = client.responses.create(**kw, store=False)
    with pytest.raises(Exception) as e:
        client.responses.retrieve(unstored.id)
    assert getattr(e.value, "status_code", None) == 404
    other = client.responses.create(model=THINKER, input=ASK, max_output_tokens=2, temperature=0)
    assert other.model == THINKER and client.responses.retrieve(other.id).model == THINKER  # found on its model


@pytest.mark.slow
def test_function_tool_streamed_and_not_and_its_output_sent_back(client, base_url):
    kw = dict(model=PLAIN, input=ASK, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=60, temperature=0)
    response = client.responses.create(**kw)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome") and call.call_id
    assert call.status == "completed" and response.status == "completed"
    events = _events(base_url, kw)
    names = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" in names and "response.output_text.delta" not in names
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == call.arguments and done["name"] == "get_weather"
    assert events[-1]["response"]["output"][0]["arguments"] == call.arguments

    follow = client.responses.create(model=PLAIN, max_output_tokens=4, temperature=0, tools=[WEATHER], input=[
        {"role": "user", "content": ASK}, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                           "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}], tool_choice="none")
    assert follow.output[0].type == "message" and follow.usage.input_tokens > response.usage.input_tokens


@pytest.mark.slow
def test_text_format_json_schema_and_json_object(client):
    schema = client.responses.create(model=PLAIN, input=ASK, max_output_tokens=60, temperature=0, text={
        "format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}})
    assert json.loads(schema.output_text)["city"] in ("Paris", "Rome") and schema.text.format.type == "json_schema"
    streamed = client.responses.create(model=PLAIN, input=ASK, max_output_tokens=60, temperature=0, stream=True,
                                       text={"format": {"type": "json_schema", "name": "city", "schema": CITY}})
    text = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    assert text == schema.output_text
    any_object = client.responses.create(model=PLAIN, input=ASK, max_output_tokens=100, temperature=0,
                                         text={"format": {"type": "json_object"}})
    assert any_object.status == "incomplete" or isinstance(json.loads(any_object.output_text), dict)


@pytest.mark.slow
def test_reasoning_lands_in_a_reasoning_item_never_in_the_text(client, base_url):
    kw = dict(model=THINKER, input=ASK, max_output_tokens=8, temperature=0)
    response = client.responses.create(**kw)
    assert [item.type for item in response.output] == ["reasoning"] and response.output_text == ""
    thought = response.output[0].content[0].text
    assert thought and response.usage.output_tokens_details.reasoning_tokens == 8
    events = _events(base_url, kw)
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == thought
    assert not any(e["type"] == "response.output_text.delta" for e in events)
    assert events[-1]["response"]["output"][0]["type"] == "reasoning"
    # effort "none" turns Qwen3's thinking off: the reply is text.
    plain = client.responses.create(**kw, reasoning={"effort": "none"})
    assert [item.type for item in plain.output] == ["message"] and plain.usage.output_tokens_details.reasoning_tokens == 0
    # A reasoning item goes back to the template as the assistant turn's reasoning.
    again = client.responses.create(model=THINKER, max_output_tokens=2, temperature=0, input=[
        {"role": "user", "content": ASK}, {"type": "reasoning", "summary": [], "content": [
            {"type": "reasoning_text", "text": "Hmm."}]}, {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Sure?"}])
    assert again.status == "incomplete"


@pytest.mark.slow
def test_background_response_is_polled_and_cancelled(base_url):
    status, queued = _post(base_url, {"model": PLAIN, "input": ASK, "background": True, "max_output_tokens": 600,
                                      "ignore_eos": True, "temperature": 0})
    assert status == 200 and queued["status"] == "queued" and queued["background"] is True
    status, cancelled = _post(base_url, {}, path=f"/v1/responses/{queued['id']}/cancel")
    assert status == 200 and cancelled["status"] == "cancelled", cancelled
    r = httpx.get(base_url + f"/v1/responses/{queued['id']}", headers={"authorization": f"Bearer {API_KEY}"})
    assert r.json()["status"] == "cancelled"
    status, done = _post(base_url, {"model": PLAIN, "input": ASK, "background": True, "max_output_tokens": 3})
    deadline = time.time() + 60
    while done["status"] in ("queued", "in_progress"):
        assert time.time() < deadline
        time.sleep(0.1)
        done = httpx.get(base_url + f"/v1/responses/{done['id']}", headers={"authorization": f"Bearer {API_KEY}"}).json()
    assert done["status"] in ("completed", "incomplete") and done["usage"]["output_tokens"] <= 3
    status, err = _post(base_url, {}, path=f"/v1/responses/{done['id']}/cancel")
    assert status == 400 and "Cannot cancel" in err["error"]["message"]


@pytest.mark.slow
def test_langchain_chat_openai_on_the_responses_api(base_url):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url + "/v1", api_key=API_KEY, model=PLAIN, use_responses_api=True,
                     max_tokens=60, temperature=0, max_retries=0)
    reply = llm.invoke("Hello")
    assert reply.response_metadata["id"].startswith("resp_") and reply.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.text() if callable(chunk.text) else chunk.text for chunk in llm.stream("Hello"))
    assert streamed == (reply.text() if callable(reply.text) else reply.text)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                             "parameters": CITY}}
    called = llm.bind_tools([tool], tool_choice="get_weather").invoke(ASK)
    assert called.tool_calls[0]["name"] == "get_weather" and called.tool_calls[0]["args"]["city"] in ("Paris", "Rome")
    thinker = ChatOpenAI(base_url=base_url + "/v1", api_key=API_KEY, model=THINKER, use_responses_api=True,
                         max_tokens=6, temperature=0, max_retries=0)
    thought = thinker.invoke(ASK)
    assert [block["type"] for block in thought.content] == ["reasoning"] and not thought.text
