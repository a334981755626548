"""Reasoning output (#43): a thinking model's `<think>` text reaches `message.reasoning` (and its
older name `reasoning_content`), never `content`, streamed or not; structured outputs and tool
calls apply to the answer after the reasoning; reasoning tokens are counted in usage.

The parsers are checked on known texts fed whole, character by character and token by token;
end to end, a tiny random Qwen3 with Qwen3's real chat template and `<think>` tokens
(tests/thinking_model.py) is served over real HTTP with `reasoning_parser: qwen3`, its replies
made deterministic by `logit_bias` on `</think>` (banned: all reasoning; forced: the reasoning
ends at once and a grammar picks the answer).
"""

from __future__ import annotations

import json

import pytest

from app.reasoning_parsers import ReasoningStream, get_reasoning_parser
from conftest import local_llm_servers, openai_api_server, openai_client
from thinking_model import make_thinking_checkpoint, think_ids

MODEL = "thinker"
ENGINE = dict(model_impl="jax", max_model_len=640, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=256,
              show_progress=False, reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes")
MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]
REPLY = "<think>\nThe sky scatters blue light.\n</think>\n\nYes, it is.</think>"


def _streamed(parser, pieces: list[str]) -> tuple[str, str]:
    stream, text, reasoning, answer = ReasoningStream(parser), "", "", ""
    for i, piece in enumerate(pieces):
        text += piece
        r, a = stream.update(text, final=i == len(pieces) - 1)
        reasoning, answer = reasoning + r, answer + a
    return reasoning, answer


@pytest.mark.parametrize("name, text, expected", [
    ("qwen3", REPLY, ("\nThe sky scatters blue light.\n", "\n\nYes, it is.")),
    ("deepseek_r1", REPLY, ("\nThe sky scatters blue light.\n", "\n\nYes, it is.</think>")),
    ("qwen3", "no start marker</think>answer", ("no start marker", "answer")),
    ("deepseek_r1", "thinking, cut short by max_tokens", ("thinking, cut short by max_tokens", None)),
    ("qwen3", 'plan<tool_call>{"name": "f"}</tool_call>', ("plan", '<tool_call>{"name": "f"}</tool_call>')),
    ("deepseek_r1", 'plan<tool_call>x', ("plan<tool_call>x", None)),
])
def test_parsers_split_reasoning_from_answer_whole_and_streamed(name, text, expected):
    parser = get_reasoning_parser(name)
    assert parser.split(text) == expected
    reasoning, answer = expected
    for pieces in (list(text), [text[i:i + 3] for i in range(0, len(text), 3)], [text]):
        assert _streamed(parser, pieces) == (reasoning, answer or "")
    # A stream never sends as reasoning what later turns out to be answer: every prefix's
    # reasoning is a prefix of the final one.
    for i in range(len(text)):
        assert reasoning.startswith(parser.split(text[:i], final=False)[0])


def test_qwen3_thinks_unless_the_template_is_told_not_to():
    parser = get_reasoning_parser("qwen3")
    assert parser.thinks(None) and parser.thinks({"enable_thinking": True})
    assert not parser.thinks({"enable_thinking": False})
    assert get_reasoning_parser("deepseek_r1").thinks({"enable_thinking": False})
    with pytest.raises(ValueError, match="known: deepseek_r1, openai_gptoss, qwen3"):
        get_reasoning_parser("granite")


# ---- end to end: the tiny thinking Qwen3 over HTTP ------------------------------------------

@pytest.fixture(scope="module")
def thinker(servax_cache):
    path = make_thinking_checkpoint(servax_cache / "thinking-qwen3")
    ids = think_ids(path)
    with local_llm_servers([{"model_loading_config": {"model_id": MODEL, "model_source": str(path)},
                             "engine_kwargs": ENGINE}]) as handles, openai_api_server(handles) as url:
        yield url, ids


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, **kw)


@pytest.mark.slow
def test_reasoning_never_reaches_content_streamed_or_not(thinker):
    url, ids = thinker
    client = openai_client(url)
    no_end = {"logit_bias": {str(ids["</think>"]): -100}}  # the model never closes its thinking
    reply = _chat(client, max_tokens=8, extra_body=no_end)
    message = reply.choices[0].message.model_dump()
    assert message["content"] is None and message["reasoning"] and message["reasoning_content"] == message["reasoning"]
    assert reply.usage.completion_tokens_details.reasoning_tokens == 8 == reply.usage.completion_tokens

    chunks = list(_chat(client, max_tokens=8, stream=True, stream_options={"include_usage": True}, extra_body=no_end))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert all(not d.get("content") for d in deltas)
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning"]
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 8

    # Thinking switched off in the template: the whole reply is the answer, as in vLLM.
    off = _chat(client, max_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content and off.choices[0].message.model_dump().get("reasoning") is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.slow
def test_grammar_and_tool_calls_apply_after_the_reasoning(thinker):
    url, ids = thinker
    client = openai_client(url)
    # `</think>` forced: the reasoning ends with the first token; only then does the grammar start
    # (were it applied from the first token, `</think>` could not be sampled at all).
    ends_at_once = {"logit_bias": {str(ids["</think>"]): 100}}
    for stream in (False, True):
        kw = dict(max_tokens=12, extra_body={**ends_at_once, "structured_outputs": {"choice": ["yes", "no"]}})
        if stream:
            deltas = [c.choices[0].delta.model_dump() for c in _chat(client, stream=True, **kw) if c.choices]
            content = "".join(d.get("content") or "" for d in deltas)
            assert not any(d.get("reasoning") for d in deltas)
        else:
            reply = _chat(client, **kw)
            content = reply.choices[0].message.content
            assert reply.choices[0].message.model_dump().get("reasoning") is None
            assert reply.choices[0].finish_reason == "stop"
            assert reply.usage.completion_tokens_details.reasoning_tokens == 0
        assert content in ("yes", "no")

    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
    reply = _chat(client, max_tokens=100, tools=[tool], tool_choice="required", parallel_tool_calls=False,
                  extra_body=ends_at_once)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "lookup" and set(json.loads(call.function.arguments)) == {"city"}
    assert not reply.choices[0].message.content
