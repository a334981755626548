"""The Responses API's replies: the Response object (its echoed settings, output items, status
and usage) of a finished chat completion, and the Responses stream events of its chunks.

- reply: output items `reasoning` (when the model has a reasoning_parser), `message`
  (output_text) and `function_call`; status completed / incomplete (max_output_tokens) /
  cancelled / failed; usage with reasoning tokens;
- stream: `response.created`, `response.in_progress`, per item `response.output_item.added`,
  (`response.content_part.added`, `response.output_text.delta` / `response.reasoning_text.delta`,
  `response.output_text.done` / `response.reasoning_text.done`, `response.content_part.done`) or
  `response.function_call_arguments.delta` / `.done`, `response.output_item.done`; then
  `response.completed`; each with its sequence_number; an `error` event if the stream fails.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from app.openai_responses import ErrorResponse
from app.responses_request import ResponsesRequest, TextConfig


def _hex() -> str:
    return uuid.uuid4().hex


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0,
                                     "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning, "tool_output_tokens": 0,
                                      "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
            "total_tokens": prompt + completion}


def _logprobs(chat_logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Chat logprobs as an output_text part's: token, logprob, bytes, top_logprobs."""
    out = []
    for entry in (chat_logprobs or {}).get("content") or ():
        top = [{"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes")}
               for t in entry.get("top_logprobs") or ()]
        out.append({"token": entry["token"], "logprob": entry["logprob"], "bytes": entry.get("bytes"),
                    "top_logprobs": top})
    return out


def _text_config(text: TextConfig | None) -> dict[str, Any] | None:
    """The request's text config as the Response echoes it: a json_schema format with its
    fields, the other formats as their type alone."""
    if text is None:
        return None
    body = text.model_dump(by_alias=True)
    if text.format is not None and text.format.type != "json_schema":
        body["format"] = {"type": text.format.type, **(text.format.model_extra or {})}
    return body


def _message_item(item_id: str, text: str, logprobs: list[dict[str, Any]] | None, status: str) -> dict[str, Any]:
    part = {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}
    return {"id": item_id, "content": [part] if text else [], "role": "assistant", "status": status,
            "type": "message", "phase": None}


def _reasoning_item(item_id: str, text: str | None, status: str | None) -> dict[str, Any]:
    content = None if text is None else [{"text": text, "type": "reasoning_text"}]
    return {"id": item_id, "summary": [], "type": "reasoning", "content": content, "encrypted_content": None,
            "status": status}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"arguments": arguments, "call_id": call_id, "name": name, "type": "function_call", "id": item_id,
            "namespace": None, "status": status}


class ResponseBody:
    """The Response object of one request: its echoed settings, then its output and status."""

    def __init__(self, request: ResponsesRequest, model: str, defaults: dict[str, Any], max_model_len: int | None):
        self.request = request
        self.id = request.request_id or f"resp_{_hex()}"
        self.created_at = int(time.time())
        self.model = model
        self.defaults = defaults
        self.max_model_len = max_model_len

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
             error: dict[str, Any] | None = None, input_tokens: int | None = None) -> dict[str, Any]:
        """The Response object; max_output_tokens is the effective one once the prompt's size
        (`usage`, or `input_tokens` before the usage) is known, as vLLM reports it."""
        r = self.request

        def effective(name: str, fallback: float) -> float:
            value = getattr(r, name)
            return float(value if value is not None else self.defaults.get(name, fallback))

        max_tokens = r.max_output_tokens
        input_tokens = usage["input_tokens"] if usage is not None else input_tokens
        if input_tokens is not None and self.max_model_len is not None:
            room = self.max_model_len - input_tokens
            max_tokens = room if max_tokens is None else min(max_tokens, room)
        return {
            "id": self.id, "created_at": self.created_at, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "metadata": r.metadata, "model": self.model, "object": "response",
            "output": output, "parallel_tool_calls": r.parallel_tool_calls,
            "temperature": effective("temperature", 1.0),
            "tool_choice": r.tool_choice if isinstance(r.tool_choice, str) else r.tool_choice.model_dump(),
            "tools": [t.model_dump() for t in r.tools], "top_p": effective("top_p", 1.0),
            "background": r.background, "max_output_tokens": max_tokens, "max_tool_calls": r.max_tool_calls,
            "previous_response_id": r.previous_response_id, "prompt": None,
            "reasoning": r.reasoning.model_dump() if r.reasoning is not None else None,
            "service_tier": r.service_tier, "status": status,
            "text": _text_config(r.text),
            "top_logprobs": r.top_logprobs if r.wants_logprobs else None, "truncation": r.truncation,
            "usage": usage, "user": r.user,
            "presence_penalty": effective("presence_penalty", 0.0),
            "frequency_penalty": effective("frequency_penalty", 0.0),
            "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None, "output_messages": None}

    def from_chat(self, chat: dict[str, Any], plain_text: bool) -> dict[str, Any]:
        """The finished Response of a chat completion body (its first choice).

        plain_text: the server reads no reasoning or tool calls from replies; then the reply is
        always one message item, even an empty one (as vLLM's reply without a parser).
        """
        choice = chat["choices"][0]
        message = choice["message"]
        output = []
        if message.get("reasoning"):
            output.append(_reasoning_item(f"rs_{_hex()}", message["reasoning"], None))
        if message.get("content") or plain_text:
            logprobs = _logprobs(choice.get("logprobs")) if self.request.wants_logprobs else None
            output.append(_message_item(f"msg_{_hex()}", message.get("content") or "", logprobs, "completed"))
        for call in message.get("tool_calls") or ():
            output.append(_call_item(f"fc_{_hex()}", call["id"], call["function"]["name"],
                                     call["function"]["arguments"], "completed"))
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        return self.body(status, output, _usage(chat.get("usage")))


class ResponseStream:
    """Turns chat completion chunks into Responses stream events, one output item at a time
    (vLLM's SimpleStreamingEventProcessor: reasoning, then text, then each function call)."""

    def __init__(self, response: ResponseBody):
        self.response = response
        self.sequence_number = 0
        self.kind: str | None = None  # the open item's: reasoning, message, function_call
        self.item_id = ""
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []
        self.call: tuple[int, str, str] | None = None  # the open call's (index, call_id, name)
        self.output: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {**fields, "sequence_number": self.sequence_number, "type": kind}
        self.sequence_number += 1
        return event

    def start(self, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        """response.created and response.in_progress, sent with the first chunk (whose `usage`
        says the prompt's size, for max_output_tokens)."""
        prompt_tokens = (usage or {}).get("prompt_tokens")
        body = self.response.body("in_progress", [], input_tokens=prompt_tokens)
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._open("reasoning")
                self.text += delta["reasoning"]
                events.append(self._event("response.reasoning_text.delta", content_index=0, delta=delta["reasoning"],
                                          item_id=self.item_id, output_index=len(self.output)))
            if delta.get("content"):
                events += self._open("message")
                logprobs = _logprobs(choice.get("logprobs")) if self.response.request.wants_logprobs else []
                self.text += delta["content"]
                self.logprobs += logprobs
                streamed = [{"token": lp["token"], "logprob": lp["logprob"], "top_logprobs": [
                    {"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]]} for lp in logprobs]
                events.append(self._event("response.output_text.delta", content_index=0, delta=delta["content"],
                                          item_id=self.item_id, logprobs=streamed, output_index=len(self.output)))
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                if call.get("id") or self.kind != "function_call" or (self.call and self.call[0] != call.get("index")):
                    events += self._open("function_call", (call.get("index", 0), call.get("id") or f"call_{_hex()}",
                                                           function.get("name") or ""))
                if function.get("arguments"):
                    self.text += function["arguments"]
                    events.append(self._event("response.function_call_arguments.delta", delta=function["arguments"],
                                              item_id=self.item_id, output_index=len(self.output)))
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def close(self) -> list[dict[str, Any]]:
        """The events that end the response: the open item's, then response.completed."""
        events = self._close_item()
        status = "incomplete" if self.finish_reason == "length" else "completed"
        body = self.response.body(status, self.output, _usage(self.usage))
        events.append(self._event("response.completed", response=body))
        return events

    def _open(self, kind: str, call: tuple[int, str, str] | None = None) -> list[dict[str, Any]]:
        if self.kind == kind and call is None:
            return []
        events = self._close_item()
        self.kind, self.text, self.logprobs, self.call = kind, "", [], call
        index = len(self.output)
        if kind == "function_call":
            self.item_id = f"fc_{_hex()}"
            item = _call_item(self.item_id, call[1], call[2], "", "in_progress")
            return events + [self._event("response.output_item.added", item=item, output_index=index)]
        if kind == "reasoning":
            self.item_id = f"rs_{_hex()}"
            item, part = _reasoning_item(self.item_id, None, "in_progress"), {"text": "", "type": "reasoning_text"}
        else:
            self.item_id = f"msg_{_hex()}"
            item = _message_item(self.item_id, "", [], "in_progress")
            part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        return events + [self._event("response.output_item.added", item=item, output_index=index),
                         self._event("response.content_part.added", content_index=0, item_id=self.item_id,
                                     output_index=index, part=part)]

    def _close_item(self) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        index, kind, self.kind = len(self.output), self.kind, None
        if kind == "function_call":
            _, call_id, name = self.call
            item = _call_item(self.item_id, call_id, name, self.text, "completed")
            events = [self._event("response.function_call_arguments.done", arguments=self.text, item_id=self.item_id,
                                  name=name, output_index=index)]
        elif kind == "reasoning":
            item = _reasoning_item(self.item_id, self.text, "completed")
            part = {"text": self.text, "type": "reasoning_text"}
            events = [self._event("response.reasoning_text.done", content_index=0, item_id=self.item_id,
                                  output_index=index, text=self.text),
                      self._event("response.content_part.done", content_index=0, item_id=self.item_id,
                                  output_index=index, part=part)]
        else:
            item = _message_item(self.item_id, self.text, self.logprobs or None, "completed")
            part = {"annotations": [], "text": self.text, "type": "output_text", "logprobs": self.logprobs or None}
            events = [self._event("response.output_text.done", content_index=0, item_id=self.item_id, logprobs=[],
                                  output_index=index, text=self.text),
                      self._event("response.content_part.done", content_index=0, item_id=self.item_id,
                                  output_index=index, part=part)]
        self.output.append(item)
        events.append(self._event("response.output_item.done", item=item, output_index=index))
        return events


def responses_error_event(err: ErrorResponse, sequence_number: int) -> dict[str, Any]:
    """The `error` stream event of a failure after the stream began."""
    return {"type": "error", "code": err.error.code or err.error.type, "message": err.error.message,
            "param": err.error.param, "sequence_number": sequence_number}
