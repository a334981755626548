"""gpt-oss's harmony channels (#43): with `reasoning_parser: openai_gptoss` the `analysis`
channel reaches `message.reasoning` (and `reasoning_content`), the `final` channel `content`,
streamed or not; calls to `functions.NAME` in the commentary channel become tool calls with
`tool_call_parser: openai` (vLLM's names; app/harmony.py reads the text, no openai_harmony).

The parsers are checked on known harmony texts fed whole and in pieces, and on token ids for
the reasoning-token count. End to end, a tiny random gpt-oss with harmony's special tokens and a
harmony chat template (tests/harmony_model.py) is served over real HTTP; its replies are made
deterministic by a structured output (a grammar over the whole harmony reply: an optional
analysis message, then the final channel, as vLLM's harmony structural tag) and `logit_bias`:
on `analysis` (the reply thinks first) and on `<|end|>` (banned: it thinks until max_tokens;
forced: its thinking ends at once and the grammar picks the answer).
"""

from __future__ import annotations

import json

import httpx
import pytest

from app.reasoning_parsers import ReasoningStream, get_reasoning_parser
from app.tool_parsers import ToolCallStream, final_tool_calls, get_tool_parser
from conftest import local_llm_servers, openai_api_server, openai_client
from harmony_model import make_harmony_checkpoint, harmony_ids

MODEL = "gpt-oss-tiny"
ENGINE = dict(model_impl="jax", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=256,
              show_progress=False, reasoning_parser="openai_gptoss", enable_auto_tool_choice=True,
              tool_call_parser="openai")
MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]
THINK = "<|channel|>analysis<|message|>The user asks about the sky.<|end|>"
ANSWER = "<|start|>assistant<|channel|>final<|message|>Yes, it is.<|return|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>')


def _streamed(parser, pieces: list[str]) -> tuple[str, str]:
    stream, text, reasoning, answer = ReasoningStream(parser), "", "", ""
    for i, piece in enumerate(pieces):
        text += piece
        r, a = stream.update(text, final=i == len(pieces) - 1)
        reasoning, answer = reasoning + r, answer + a
    return reasoning, answer


@pytest.mark.parametrize("text, expected", [
    (THINK + ANSWER, ("The user asks about the sky.", "Yes, it is.")),
    (THINK + "<|start|>assistant<|channel|>analysis<|message|>Then answer.<|end|>" + ANSWER,
     ("The user asks about the sky.\nThen answer.", "Yes, it is.")),
    ("<|channel|>final<|message|>Yes.<|return|>", ("", "Yes.")),
    ("<|channel|>analysis<|message|>cut short by max_tokens", ("cut short by max_tokens", None)),
    # A call without a tool parser is dropped, as vLLM's HarmonyParser drops it.
    (THINK + CALL, ("The user asks about the sky.", "")),
    # Commentary to no one is answer (gpt-oss's preambles); a built-in tool's call is dropped.
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=browser.search"
     "<|message|>{\"query\": \"sky\"}<|call|>", ("", "Checking.")),
    # A reply that never wrote a header is answer, as vLLM recovers it.
    ("plain text", ("", "plain text")),
])
def test_harmony_channels_split_whole_and_streamed(text, expected):
    parser = get_reasoning_parser("openai_gptoss")
    assert parser.split(text) == expected
    reasoning, answer = expected
    for pieces in (list(text), [text[i:i + 5] for i in range(0, len(text), 5)], [text]):
        assert _streamed(parser, pieces) == (reasoning, answer or "")
    for i in range(len(text)):  # what a stream has sent only ever grows
        r, a = parser.split(text[:i], final=False)
        assert reasoning.startswith(r) and (a is None or (answer or "").startswith(a))


# The recipient in the channel header, or in the role header (both forms gpt-oss writes).
ROLE_HEADER_CALL = CALL.replace("<|channel|>commentary to=functions.get_weather <|constrain|>json",
                                " to=functions.get_weather<|channel|>commentary json")


@pytest.mark.parametrize("text", [THINK + CALL, THINK + ROLE_HEADER_CALL])
def test_calls_in_the_commentary_channel_are_tool_calls(text):
    tools = get_tool_parser("openai")
    parser = get_reasoning_parser("openai_gptoss").for_tool_parser(tools)
    reasoning, answer = parser.split(text)
    assert reasoning == "The user asks about the sky."
    content, calls = final_tool_calls(tools, answer)
    assert content is None
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    # Streamed: the reasoning stream's answer so far, read by the tool-call stream.
    thinking, stream, deltas = ReasoningStream(parser), ToolCallStream(tools), []
    for i in range(1, len(text) + 1):
        thinking.update(text[:i], final=i == len(text))
        deltas += stream.update(thinking.answer_so_far(text[:i], final=i == len(text)), final=i == len(text))[1]
    assert deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    # The answer beside a call stays content; without the reasoning parser, analysis is dropped.
    content, calls = final_tool_calls(tools, THINK + ANSWER.replace("<|return|>", "<|end|>") + CALL)
    assert content == "Yes, it is." and len(calls) == 1


def test_reasoning_tokens_are_the_analysis_messages_tokens(servax_cache):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_harmony_checkpoint(servax_cache / "harmony-gpt-oss"))
    parser = get_reasoning_parser("openai_gptoss")
    ids = tokenizer.encode(THINK + ANSWER, add_special_tokens=False)
    assert parser.count_tokens(tokenizer, ids) == len(tokenizer.encode("The user asks about the sky.",
                                                                       add_special_tokens=False))
    assert parser.count_tokens(tokenizer, tokenizer.encode(ANSWER, add_special_tokens=False)) == 0


# ---- end to end: the tiny harmony gpt-oss over HTTP -----------------------------------------

@pytest.fixture(scope="module")
def harmony(servax_cache):
    path = make_harmony_checkpoint(servax_cache / "harmony-gpt-oss")
    ids = harmony_ids(path)
    with local_llm_servers([{"model_loading_config": {"model_id": MODEL, "model_source": str(path)},
                             "engine_kwargs": ENGINE}]) as handles, openai_api_server(handles) as url:
        yield url, ids


def _bias(ids: dict[str, int], end: float) -> dict[str, float]:
    return {str(ids["analysis"]): 100, str(ids["<|end|>"]): end}


@pytest.mark.slow
def test_analysis_channel_never_reaches_content_streamed_or_not(harmony):
    url, ids = harmony
    client = openai_client(url)
    kw = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16,
              extra_body={"logit_bias": _bias(ids, -100), "structured_outputs": {"choice": ["yes", "no"]},
                          "return_token_ids": True})
    reply = client.chat.completions.create(**kw)
    message = reply.choices[0].message.model_dump()
    assert message["content"] is None and message["reasoning"] and message["reasoning_content"] == message["reasoning"]
    token_ids = reply.choices[0].model_dump()["token_ids"]
    assert token_ids[0] == ids["<|channel|>"] and ids["<|message|>"] in token_ids
    assert 0 < reply.usage.completion_tokens_details.reasoning_tokens < reply.usage.completion_tokens == 16

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert all(not d.get("content") for d in deltas)
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert (chunks[-1].usage.completion_tokens_details.reasoning_tokens
            == reply.usage.completion_tokens_details.reasoning_tokens)

    # The Responses API: a reasoning item, no message text.
    body = {"model": MODEL, "input": "Is the sky blue?", "temperature": 0, "max_output_tokens": 16,
            "logit_bias": _bias(ids, -100), "structured_outputs": {"choice": ["yes", "no"]}}
    response = httpx.post(f"{url}/v1/responses", json=body, timeout=120).json()
    assert [item["type"] for item in response["output"]] == ["reasoning"]
    assert response["output"][0]["content"][0]["text"] == message["reasoning"]


@pytest.mark.slow
def test_final_channel_is_the_answer_and_the_grammar_applies_there(harmony):
    url, ids = harmony
    client = openai_client(url)
    ends_at_once = {"logit_bias": _bias(ids, 100), "return_token_ids": True}
    for stream in (False, True):
        kw = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24,
                  extra_body={**ends_at_once, "structured_outputs": {"choice": ["yes", "no"]}})
        if stream:
            deltas = [c.choices[0].delta.model_dump() for c in client.chat.completions.create(stream=True, **kw)
                      if c.choices]
            content = "".join(d.get("content") or "" for d in deltas)
            assert not any(d.get("reasoning") for d in deltas)
        else:
            reply = client.chat.completions.create(**kw)
            content = reply.choices[0].message.content
            token_ids = reply.choices[0].model_dump()["token_ids"]
            # It went through an (empty) analysis message before the final channel.
            assert token_ids.count(ids["<|channel|>"]) == 2 and ids["<|end|>"] in token_ids
            assert reply.choices[0].finish_reason == "stop"
            assert reply.usage.completion_tokens_details.reasoning_tokens == 0
        assert content in ("yes", "no")

    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=100, tools=[tool],
                                           tool_choice="required", parallel_tool_calls=False, extra_body=ends_at_once)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "lookup" and set(json.loads(call.function.arguments)) == {"city"}
    assert not reply.choices[0].message.content
