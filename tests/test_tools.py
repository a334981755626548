"""Tool calling and structured outputs over the OpenAI API.

The parsers first (text in, content and calls out; streamed deltas reassemble to the final
parse), then the real HTTP stack (tests/test_app_openai.py explains the setup) on the tiny
random model: `response_format` through the official client's `parse`, vLLM's
`structured_outputs` / `guided_*` fields, tool calls forced by `tool_choice` (valid even
though the model is noise), Hermes calls read back under `tool_choice: auto`, a tool-result
round trip through a chat template, and 400s that name the offending field.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Literal

import httpx
import jsonschema
import pytest
from conftest import assert_openai_error, local_llm_server, local_llm_servers, openai_api_server, openai_client, sse_events
from pydantic import BaseModel, ConfigDict, Field

from app.tool_parsers import (
    HermesToolParser, Llama3JsonToolParser, NamedToolCall, RequiredToolCalls, ToolCallStream, final_tool_calls,
    get_tool_parser,
)

MODEL = "servax-tiny/llama"
API_KEY = "tools-key"
# test_structured_output's engine shape (shared compiled programs), with Hermes tool calls on.
ENGINE = dict(model_impl="jax", max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128, num_kv_blocks=512,
              show_progress=False, enable_auto_tool_choice=True, tool_call_parser="hermes")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Tokyo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 5}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
# The random tiny model's draws are seed-determined; under a grammar of bounded strings and
# whitespace they finish well within max_tokens.
SAMPLED = dict(temperature=1.0, seed=2, max_tokens=200)


def reassemble(deltas: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) per call from OpenAI tool-call deltas."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], ["", ""])
        call[0] += d.get("function", {}).get("name") or ""
        call[1] += d.get("function", {}).get("arguments") or ""
    return [tuple(calls[i]) for i in sorted(calls)]


def stream_all(parser, text: str, step: int = 3) -> tuple[str, list[tuple[str, str]]]:
    """Feed `text` a few characters at a time; the content and calls that come out."""
    stream, content, deltas = ToolCallStream(parser), "", []
    for end in list(range(step, len(text), step)) + [len(text)]:
        c, d = stream.update(text[:end], final=end == len(text))
        content += c
        deltas += d
    return content, reassemble(deltas)


# ---- parsers ---------------------------------------------------------------------------------

HERMES_TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>{"arguments": {"zone": "CET"}, "name": "get_time"}</tool_call>')


def test_hermes_calls_and_content():
    content, calls = final_tool_calls(HermesToolParser(), HERMES_TEXT)
    assert content == "Let me check. \n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert final_tool_calls(HermesToolParser(), "no tools here")[1] == []
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert final_tool_calls(HermesToolParser(), broken) == (broken, [])


@pytest.mark.parametrize("parser, text", [
    (HermesToolParser(), HERMES_TEXT),
    (Llama3JsonToolParser(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}; '
                             '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
    (RequiredToolCalls(), '[{"name":"get_weather","parameters":{"city":"Tokyo","days":3}},'
                          '{"name":"get_time","parameters":{"zone":"JST"}}]'),
    (NamedToolCall("get_time"), '{"zone":"a\\"}{"}'),
])
def test_streamed_deltas_reassemble_to_the_final_parse(parser, text):
    content, calls = final_tool_calls(parser, text)
    for step in (1, 2, 7):
        streamed_content, streamed_calls = stream_all(parser, text, step)
        assert streamed_calls == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert streamed_content == (content or "")


def test_partial_markers_are_held_back():
    stream = ToolCallStream(HermesToolParser())
    assert stream.update("Hi <tool_", final=False) == ("Hi ", [])
    content, deltas = stream.update('Hi <tool_call>{"name": "get_time", "arguments": {"zo', final=False)
    assert content == "" and deltas == [{"index": 0, "id": deltas[0]["id"], "type": "function",
                                         "function": {"name": "get_time", "arguments": '{"zo'}}]
    assert ToolCallStream(Llama3JsonToolParser()).update("   ", final=False) == ("", [])
    assert final_tool_calls(Llama3JsonToolParser(), "Plain answer.") == ("Plain answer.", [])


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="hermes.*llama3_json"):
        get_tool_parser("mistral")


# ---- over HTTP -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def handles(servax_cache):
    with local_llm_servers([{"model_loading_config": {"model_id": MODEL}, "engine_kwargs": ENGINE}]) as result:
        yield result


@pytest.fixture(scope="module")
def base_url(handles):
    with openai_api_server(handles, API_KEY) as url:
        yield url


@pytest.fixture
def client(base_url):
    return openai_client(base_url, API_KEY)


@pytest.fixture
def http(base_url):
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def wait_idle(handles, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while True:
        stats = handles[MODEL].stats.remote().result()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        assert time.time() < deadline, stats
        time.sleep(0.05)


def assert_valid_call(name: str, arguments: str) -> None:
    assert name in PARAMS
    jsonschema.validate(json.loads(arguments), PARAMS[name])


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]


@pytest.mark.slow
def test_openai_parse_returns_a_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], response_format=Person, **SAMPLED)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and completion.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_response_format_on_completions_streamed(http):
    schema = Person.model_json_schema()
    body = dict(model=MODEL, prompt="A person:", stream=True, **SAMPLED,
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
                structured_outputs=None)
    body.pop("structured_outputs")
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [e for e in sse_events(r) if e != "[DONE]"]
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    Person.model_validate_json(text)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.slow
def test_vllm_structured_output_fields(client):
    choice = client.completions.create(model=MODEL, prompt="Pick:", **SAMPLED,
                                       extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert choice.choices[0].text in ("left", "right")
    regex = client.completions.create(model=MODEL, prompt="Code:", **SAMPLED, extra_body={"guided_regex": r"[A-Z]{3}\d"})
    assert re.fullmatch(r"[A-Z]{3}\d", regex.choices[0].text)
    # Any object: its keys and strings are unbounded, so the seed is one whose noise closes it.
    obj = client.chat.completions.create(model=MODEL, messages=USER, response_format={"type": "json_object"},
                                         temperature=1.0, seed=9, max_tokens=200)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    plain = client.chat.completions.create(model=MODEL, messages=USER, response_format={"type": "text"},
                                           temperature=0, max_tokens=4, extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == 4


@pytest.mark.slow
def test_tool_choice_required_returns_a_valid_call(client):
    reply = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, **SAMPLED)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert_valid_call(call.function.name, call.function.arguments)


@pytest.mark.slow
def test_named_tool_choice_calls_that_function(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, **SAMPLED,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = reply.choices[0].message.tool_calls
    # As OpenAI and vLLM: a named tool_choice finishes as "stop", its content is "".
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == ""
    assert_valid_call(call.function.name, call.function.arguments)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_cut_off_returns_the_partial_arguments(client, stream):
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, temperature=1.0, seed=2, max_tokens=4,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 4
    assert call.function.name == "get_weather" and call.function.arguments.startswith('{"')
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # cut off: not yet a whole object
    if stream:
        deltas, finish = [], None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                deltas += [d.model_dump(exclude_none=True) for d in c.delta.tool_calls or []]
                finish = c.finish_reason or finish
        assert reassemble(deltas) == [("get_weather", call.function.arguments)] and finish == "length"


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_deltas_reassemble_to_the_same_calls(client, tool_choice):
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice, **dict(SAMPLED, seed=3))
    whole = client.chat.completions.create(**kwargs).choices[0]
    deltas, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            deltas += [d.model_dump(exclude_none=True) for d in c.delta.tool_calls or []]
            finish = c.finish_reason or finish
    assert reassemble(deltas) == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert finish == whole.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    for name, arguments in reassemble(deltas):
        assert_valid_call(name, arguments)


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Rome", "Tokyo"]
    zip: str = Field(max_length=5)


class Shipment(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: Address
    back: Address | None = None
    count: int = Field(ge=1, le=9)


# Pydantic writes nested models as "$ref": "#/$defs/Address" with the definitions beside them.
SHIP = {"type": "function", "function": {"name": "ship", "parameters": Shipment.model_json_schema()}}


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "ship"}}])
def test_tools_with_defs_are_forced_with_their_definitions(client, tool_choice):
    assert "$defs" in SHIP["function"]["parameters"]
    reply = client.chat.completions.create(model=MODEL, messages=USER, tools=[SHIP, CLOCK], tool_choice=tool_choice,
                                           parallel_tool_calls=False, **SAMPLED)
    choice = reply.choices[0]
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    (call,) = choice.message.tool_calls
    if call.function.name == "ship":
        Shipment.model_validate_json(call.function.arguments)
    else:
        assert tool_choice == "required"
        assert_valid_call(call.function.name, call.function.arguments)


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.slow
def test_tools_defining_one_name_differently_are_a_400_naming_tools(http):
    a = _tool("a", {"type": "object", "properties": {"x": {"$ref": "#/$defs/T"}}, "$defs": {"T": {"type": "string"}}})
    b = _tool("b", {"type": "object", "properties": {"y": {"$ref": "#/$defs/T"}}, "$defs": {"T": {"type": "integer"}}})
    body = dict(model=MODEL, messages=USER, tools=[a, b], tool_choice="required", max_tokens=50)
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, "tools")
    assert "'T'" in error["message"]
    # A tool's bad schema: the message names the field the client sent, as the param does.
    bad = _tool("c", {"type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}})
    body = dict(body, tools=[bad], tool_choice={"type": "function", "function": {"name": "c"}})
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, "tools")
    assert error["message"].startswith("tools: ")


HERMES_REGEX = (r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
                r'"days": [1-7]\}\}</tool_call>')


@pytest.mark.slow
def test_auto_tool_choice_reads_hermes_calls(client):
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, **SAMPLED, extra_body={"guided_regex": HERMES_REGEX})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.content == "Sure. " and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert_valid_call(call.function.name, call.function.arguments)
    content, deltas = "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            deltas += [d.model_dump(exclude_none=True) for d in c.delta.tool_calls or []]
    assert content == "Sure. " and reassemble(deltas) == [(call.function.name, call.function.arguments)]


TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    '<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>tool\n<tool_response id=\"{{ m.tool_call_id }}\">{{ m.content }}"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.slow
def test_tool_result_round_trip_renders_through_the_template(client, handles):
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, parallel_tool_calls=False,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           extra_body={"chat_template": TOOL_TEMPLATE}, **SAMPLED)
    message = first.choices[0].message
    (call,) = message.tool_calls
    messages = USER + [message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                            extra_body={"chat_template": TOOL_TEMPLATE}, temperature=0, max_tokens=4)
    text, ids = local_llm_server(MODEL).engine.processor.render_chat(messages, tools=TOOLS,
                                                                     chat_template=TOOL_TEMPLATE)
    assert second.usage.prompt_tokens == len(ids)  # the server rendered exactly this
    arguments = json.dumps(json.loads(call.function.arguments))  # an object to the template, not a string
    assert f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>' in text
    assert f'<tool_response id="{call.id}">{{"temp_c": 21}}</tool_response>' in text
    assert "Tools: get_weather get_time<|im_end|>" in text


@pytest.mark.slow
def test_python_handles_take_structured_outputs(handles):
    from runtime import SamplingParams

    handle = handles[MODEL]
    result = handle.generate.remote("Pick one:", {"structured_outputs": {"choice": ["yes", "no"]}, **SAMPLED}).result()
    assert result.text in ("yes", "no") and result.outputs[0].finish_reason == "stop"
    params = SamplingParams(structured_outputs={"regex": r"[0-9]{4}"}, **SAMPLED)
    text = "".join(d.text for d in handle.options(stream=True).stream.remote(USER, params))
    assert re.fullmatch(r"[0-9]{4}", text)


# ---- bad input -------------------------------------------------------------------------------

BAD = [
    ({"messages": USER, "tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strung"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strung"}}}}}}, "response_format"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}},
     "response_format"),
    ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format"),
    ({"prompt": "x", "structured_outputs": {"regex": "(abc"}}, "structured_outputs.regex"),
    ({"prompt": "x", "guided_regex": "(abc"}, "guided_regex"),
    ({"prompt": "x", "guided_grammar": "start: nothing_here"}, "guided_grammar"),
    ({"prompt": "x", "guided_json": "{oops"}, "guided_json"),
    ({"prompt": "x", "guided_choice": ["a"], "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": "x", "allowed_token_ids": [10**7]}, "allowed_token_ids"),
]


@pytest.mark.slow
def test_bad_input_is_a_400_naming_the_field_and_harms_nothing(http, handles):
    # A long request keeps running while the bad ones are refused.
    long = {}

    def run_long():
        long["r"] = http.post("/v1/completions", json=dict(model=MODEL, prompt="Keep going", max_tokens=200,
                                                           temperature=0, ignore_eos=True))

    thread = threading.Thread(target=run_long)
    thread.start()
    for body, param in BAD:
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        for stream in (False, True):
            assert_openai_error(http.post(route, json=dict(body, model=MODEL, stream=stream)), 400, param)
    thread.join(timeout=60)
    assert long["r"].status_code == 200 and long["r"].json()["usage"]["completion_tokens"] == 200
    stats = wait_idle(handles)
    assert stats["kv_blocks_used"] == 0 and stats["compilations_since_warmup"] == 0


@pytest.mark.slow
def test_auto_tool_choice_needs_the_engine_settings(http):
    serving = local_llm_server(MODEL).serving
    serving.enable_auto_tool_choice = False
    try:
        r = http.post("/v1/chat/completions", json=dict(model=MODEL, messages=USER, tools=TOOLS))
    finally:
        serving.enable_auto_tool_choice = True
    error = assert_openai_error(r, 400, "tool_choice")
    assert "enable_auto_tool_choice" in error["message"]
