"""Structured-output client libraries against a real servax server of the tiny random model.

instructor (TOOLS and JSON_SCHEMA modes) and LangChain (`with_structured_output` by function
calling and by JSON schema, `bind_tools` with a named and with the "required" tool choice),
unmodified, over real HTTP (the OpenAI ingress of tests/test_app_openai.py), on a nested
pydantic model (its schema has `$defs`) with `max_tokens` 160, as a user of `vllm serve`
would call them. The model is noise: only the grammar makes each answer valid, and only
bounded whitespace and objects without unlisted properties let it finish inside the budget,
so every call of every seed must parse.
"""

from __future__ import annotations

from typing import Literal

import pytest
from conftest import local_llm_servers, openai_api_server, openai_client
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

MODEL = "servax-tiny/llama"
API_KEY = "libraries-key"
ENGINE = dict(model_impl="jax", max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128, num_kv_blocks=512,
              show_progress=False)
MESSAGES = [{"role": "user", "content": "Alice, 30, lives at 12 Main St, Paris. Extract her."}]
SEEDS = range(8)
MAX_TOKENS = 160


class Address(BaseModel):
    city: Literal["Paris", "Rome", "Tokyo"]
    zip: str = Field(max_length=5)


class Person(BaseModel):
    """A person and where they live."""

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    address: Address


@pytest.fixture(scope="module")
def base_url(servax_cache):
    assert "$defs" in Person.model_json_schema()
    with local_llm_servers([{"model_loading_config": {"model_id": MODEL}, "engine_kwargs": ENGINE}]) as handles:
        with openai_api_server(handles, API_KEY) as url:
            yield url


def chat_model(base_url: str, seed: int):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=base_url + "/v1", api_key=API_KEY, model=MODEL, max_tokens=MAX_TOKENS,
                      temperature=1.0, seed=seed, max_retries=0)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_parses_every_call(base_url, mode):
    import instructor

    client = instructor.from_openai(openai_client(base_url, API_KEY), mode=getattr(instructor.Mode, mode))
    for seed in SEEDS:
        person, completion = client.chat.completions.create_with_completion(
            model=MODEL, messages=MESSAGES, response_model=Person, max_tokens=MAX_TOKENS, temperature=1.0,
            seed=seed, max_retries=0)
        assert isinstance(person, Person) and completion.usage.completion_tokens < MAX_TOKENS


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output_parses_every_call(base_url, method):
    for seed in SEEDS:
        structured = chat_model(base_url, seed).with_structured_output(Person, method=method, include_raw=True)
        out = structured.invoke(MESSAGES)
        assert out["parsing_error"] is None and isinstance(out["parsed"], Person), out
        assert out["raw"].usage_metadata["output_tokens"] < MAX_TOKENS


@pytest.mark.parametrize("tool_choice", ["Person", "required"])
def test_langchain_bind_tools_calls_the_tool_every_call(base_url, tool_choice):
    # "required" forces an array of calls; one call (parallel_tool_calls false) keeps it bounded.
    for seed in SEEDS:
        message = chat_model(base_url, seed).bind_tools(
            [Person], tool_choice=tool_choice, parallel_tool_calls=False).invoke(MESSAGES)
        (call,) = message.tool_calls
        assert call["name"] == "Person" and not message.invalid_tool_calls
        Person.model_validate(call["args"])
        assert message.response_metadata["finish_reason"] == ("tool_calls" if tool_choice == "required" else "stop")
