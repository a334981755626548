"""Compare servax's reasoning output, Anthropic Messages API and OpenAI Responses API with `vllm serve`
(not a test: run by hand).

Serves the tiny thinking Qwen3 (tests/thinking_model.py) with servax in this process and sends the
same requests to it and to a running `vllm serve` of the same folder; prints, per request, the
status codes, the JSON shapes (keys and value types, ids and timings aside) where they differ, and
whether the greedy texts are equal. servax never imports vLLM; start vLLM from its reference venv:

    python tests/vllm_compare_api.py --make /tmp/thinking-qwen3        # writes the checkpoint
    PY=$(../shared/tools/vllm-reference | tail -1)
    VLLM_ENABLE_RESPONSES_API_STORE=1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=1 "$(dirname "$PY")/vllm" serve /tmp/thinking-qwen3 \\
        --served-model-name thinking --port 8765 --max-model-len 512 --dtype float32 \\
        --reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes
    python tests/vllm_compare_api.py /tmp/thinking-qwen3 --vllm http://127.0.0.1:8765
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

MODEL = "thinking"
ASK = [{"role": "user", "content": "Is the sky blue?"}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
ANTHROPIC_TOOL = {"name": "lookup", "input_schema": TOOL["function"]["parameters"]}
RESPONSES_TOOL = {"type": "function", "name": "lookup", "parameters": TOOL["function"]["parameters"]}
VOLATILE = {"id", "created", "system_fingerprint", "signature"}


def requests(think: dict[str, int]) -> list[tuple[str, str, dict]]:
    """(name, path, body): the requests both servers get."""
    no_end = {"logit_bias": {str(think["</think>"]): -100}}
    ends = {"logit_bias": {str(think["</think>"]): 100}}
    chat = {"model": MODEL, "messages": ASK, "temperature": 0}
    msg = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 6}
    return [
        ("chat: reasoning never ends", "/v1/chat/completions", {**chat, "max_tokens": 6, **no_end}),
        ("chat: reasoning ends, grammar answers", "/v1/chat/completions",
         {**chat, "max_tokens": 8, **ends, "structured_outputs": {"choice": ["yes", "no"]}}),
        ("chat: enable_thinking false", "/v1/chat/completions",
         {**chat, "max_tokens": 4, "chat_template_kwargs": {"enable_thinking": False}}),
        ("chat: streamed reasoning", "/v1/chat/completions",
         {**chat, "max_tokens": 6, **no_end, "stream": True, "stream_options": {"include_usage": True}}),
        ("chat: required tool after reasoning", "/v1/chat/completions",
         {**chat, "max_tokens": 60, **ends, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}),
        ("messages: text", "/v1/messages", {**msg, "thinking": {"type": "disabled"}}),
        ("messages: thinking", "/v1/messages", msg),
        ("messages: system blocks + stop", "/v1/messages",
         {**msg, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["e"],
          "thinking": {"type": "disabled"}}),
        ("messages: named tool", "/v1/messages",
         {**msg, "max_tokens": 60, "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "tool", "name": "lookup"},
          "thinking": {"type": "disabled"}}),
        ("messages: streamed", "/v1/messages", {**msg, "stream": True, "thinking": {"type": "disabled"}}),
        ("messages: streamed thinking", "/v1/messages", {**msg, "stream": True}),
        ("count_tokens", "/v1/messages/count_tokens", {"model": MODEL, "messages": ASK, "tools": [ANTHROPIC_TOOL]}),
        ("messages: no max_tokens", "/v1/messages", {"model": MODEL, "messages": ASK}),
        ("messages: max_tokens 0", "/v1/messages", {**msg, "max_tokens": 0}),
        ("messages: unknown model", "/v1/messages", {**msg, "model": "nope"}),
        ("messages: system turn in messages", "/v1/messages",
         {**msg, "messages": [{"role": "system", "content": "Be brief."}, *ASK], "thinking": {"type": "disabled"}}),
        *responses_requests(think),
    ]


def responses_requests(think: dict[str, int]) -> list[tuple[str, str, dict]]:
    """The Responses API's requests (vLLM serves them with VLLM_ENABLE_RESPONSES_API_STORE=1)."""
    no_end = {"logit_bias": {str(think["</think>"]): -100}}
    ends = {"logit_bias": {str(think["</think>"]): 100}}
    resp = {"model": MODEL, "input": ASK[0]["content"], "temperature": 0, "max_output_tokens": 6}
    off = {"reasoning": {"effort": "none"}}
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}]
    named = {"tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "lookup"}, "max_output_tokens": 60}
    choice = {"max_output_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}}
    schema = {"format": {"type": "json_schema", "name": "city", "schema": TOOL["function"]["parameters"]}}
    return [
        ("responses: text", "/v1/responses", {**resp, **off, "instructions": "Be brief."}),
        ("responses: reasoning never ends", "/v1/responses", {**resp, **no_end}),
        ("responses: streamed text", "/v1/responses", {**resp, **off, "stream": True}),
        ("responses: streamed reasoning", "/v1/responses", {**resp, **no_end, "stream": True}),
        ("responses: reasoning ends, grammar answers", "/v1/responses", {**resp, **ends, **choice}),
        ("responses: streamed reasoning then grammar answer", "/v1/responses",
         {**resp, **ends, **choice, "stream": True}),
        ("responses: named function tool", "/v1/responses", {**resp, **off, **named}),
        ("responses: streamed named function tool", "/v1/responses", {**resp, **off, **named, "stream": True}),
        ("responses: required tool after reasoning", "/v1/responses",
         {**resp, **ends, "tools": [RESPONSES_TOOL], "tool_choice": "required", "max_output_tokens": 60,
          "parallel_tool_calls": False}),
        ("responses: text.format json_schema", "/v1/responses", {**resp, **off, "text": schema, "max_output_tokens": 40}),
        ("responses: text.format json_object", "/v1/responses",
         {**resp, **off, "text": {"format": {"type": "json_object"}}, "max_output_tokens": 12}),
        ("responses: function_call items in", "/v1/responses",
         {**resp, **off, "input": items, "tools": [RESPONSES_TOOL], "tool_choice": "none"}),
        ("responses: logprobs", "/v1/responses",
         {**resp, **off, "include": ["message.output_text.logprobs"], "top_logprobs": 2, "max_output_tokens": 3}),
        ("responses: max_output_tokens 0", "/v1/responses", {**resp, "max_output_tokens": 0}),
        ("responses: unknown model", "/v1/responses", {**resp, "model": "nope"}),
        ("responses: input not text or items", "/v1/responses", {**resp, "input": 5}),
        ("responses: required without tools", "/v1/responses", {**resp, "tool_choice": "required"}),
        ("responses: unknown previous_response_id", "/v1/responses", {**resp, "previous_response_id": "resp_nope"}),
        ("responses: prompt too long", "/v1/responses", {**resp, "input": "word " * 600}),
        ("responses: cancel a finished response", "/v1/responses/{last}/cancel", {}),
        ("responses: retrieve", "GET /v1/responses/{last}", {}),
        ("responses: previous_response_id", "/v1/responses",
         {**resp, **off, "input": "And Rome?", "previous_response_id": "{last}"}),
    ]


def shape(value, key: str = ""):
    if key in VOLATILE:
        return "<volatile>"
    if isinstance(value, dict):
        return {k: shape(v, k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def flat(tree, prefix: str = "") -> dict[str, str]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else k))
        return out or {prefix: "{}"}
    if isinstance(tree, list):
        return flat(tree[0], prefix + "[]") if tree else {prefix: "[]"}
    return {prefix: tree}


def send(base: str, path: str, body: dict, last: str = "") -> tuple[int, list]:
    """Status and the JSON bodies (one, or each stream event / chunk); `{last}` in the path or
    the previous_response_id is the id of this server's last Response."""
    method, _, path = path.rpartition(" ")
    path = path.replace("{last}", last)
    if body.get("previous_response_id") == "{last}":
        body = {**body, "previous_response_id": last}
    with httpx.stream(method or "POST", base + path, json=body if method != "GET" else None, timeout=300) as r:
        raw = r.read().decode()
    if not body.get("stream") or r.status_code != 200:
        return r.status_code, [json.loads(raw)]
    items = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            items.append(json.loads(line[6:]))
    return r.status_code, items


def _thought(d: dict, key: str) -> str:
    return f"[r:{d[key]}]" if d.get(key) else ""


def text_of(items: list) -> str:
    """What the model wrote, whatever the wire format (reasoning marked)."""
    parts = []
    for item in items:
        for c in item.get("choices") or ():
            m = c.get("message") or c.get("delta") or {}
            parts += [_thought(m, "reasoning"), m.get("content") or ""]
            parts += [json.dumps(t.get("function", {}).get("arguments")) for t in m.get("tool_calls") or ()]
        for b in item.get("content") or ():
            parts.append(b.get("text") or _thought(b, "thinking") or json.dumps(b.get("input")))
        for out in item.get("output") or ():  # a Response
            parts += [_thought({"r": c["text"]}, "r") for c in out.get("content") or () if out["type"] == "reasoning"]
            parts += [c.get("text") or "" for c in out.get("content") or () if out["type"] == "message"]
            parts.append(json.dumps(out["arguments"]) if out["type"] == "function_call" else "")
        d = item.get("delta") or {}
        if isinstance(d, str):  # a Responses stream event
            kind = item.get("type", "")
            parts.append(_thought({"r": d}, "r") if "reasoning" in kind else d if "output_text" in kind else "")
            if kind == "response.function_call_arguments.done":
                parts.append(json.dumps(item["arguments"]))
            continue
        parts.append(d.get("text") or _thought(d, "thinking") or d.get("partial_json") or "")
    return "".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--make", action="store_true", help="only write the checkpoint")
    parser.add_argument("--vllm", default="http://127.0.0.1:8765")
    args = parser.parse_args()
    from thinking_model import make_thinking_checkpoint, think_ids

    make_thinking_checkpoint(args.checkpoint)
    if args.make:
        return
    from conftest import local_llm_servers, openai_api_server

    engine = dict(model_impl="jax", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256, num_kv_blocks=256,
                  show_progress=False, reasoning_parser="qwen3", enable_auto_tool_choice=True,
                  tool_call_parser="hermes")
    config = [{"model_loading_config": {"model_id": MODEL, "model_source": str(args.checkpoint)},
               "engine_kwargs": engine}]
    last = {"vllm": "", "servax": ""}  # each server's last Response id
    with local_llm_servers(config) as handles, openai_api_server(handles) as servax:
        for name, path, body in requests(think_ids(args.checkpoint)):
            (vs, vitems), (ss, sitems) = send(args.vllm, path, body, last["vllm"]), send(servax, path, body,
                                                                                         last["servax"])
            for server, status, items in (("vllm", vs, vitems), ("servax", ss, sitems)):
                if status == 200 and items[-1].get("object") == "response" and path == "/v1/responses":
                    last[server] = items[-1]["id"]
            vkeys = {k: v for item in vitems for k, v in flat(shape(item)).items()}
            skeys = {k: v for item in sitems for k, v in flat(shape(item)).items()}
            only_v = sorted(f"{k}:{v}" for k, v in vkeys.items() if skeys.get(k) != v)
            only_s = sorted(f"{k}:{v}" for k, v in skeys.items() if vkeys.get(k) != v)
            same_text = text_of(vitems) == text_of(sitems)
            print(f"\n## {name}  status vllm={vs} servax={ss}  same text: {same_text}")
            if not same_text or vs != 200:
                print(f"   vllm:   {text_of(vitems)[:160]!r}" if vs == 200 else f"   vllm:   {vitems[0]}")
                print(f"   servax: {text_of(sitems)[:160]!r}" if ss == 200 else f"   servax: {sitems[0]}")
            if only_v:
                print("   only/different in vllm:  ", only_v)
            if only_s:
                print("   only/different in servax:", only_s)
            if body.get("stream") and path in ("/v1/messages", "/v1/responses"):
                print("   events vllm:  ", [i["type"] for i in vitems])
                print("   events servax:", [i["type"] for i in sitems])


if __name__ == "__main__":
    main()
