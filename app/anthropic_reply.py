"""Anthropic's Messages replies: the message of a finished chat completion, the stream events of
its chunks, and Anthropic's error bodies.

- reply: content blocks `thinking` (when the model has a reasoning_parser), `text`, `tool_use`;
  stop_reason end_turn / max_tokens / stop_sequence / tool_use; usage in Anthropic's terms;
- stream: `message_start`, `ping`, `content_block_start` / `content_block_delta` (`text_delta`,
  `thinking_delta`, `signature_delta`, `input_json_delta`) / `content_block_stop`, `message_delta`
  (stop_reason and usage), `message_stop`; an `error` event if the stream fails;
- errors: `{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}` with
  Anthropic's error type for each status.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from app.openai_responses import ErrorResponse

# Anthropic's error type for each HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error",
                529: "overloaded_error"}


def anthropic_error_body(err: ErrorResponse) -> dict[str, Any]:
    """Anthropic's error body for an error servax answers (same status, same message)."""
    status = err.status_code
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.error.message}}


def anthropic_sse(event: dict[str, Any]) -> str:
    """One stream event as Anthropic sends it: its type as the SSE event name, then its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


# ---- replies -------------------------------------------------------------------------------

def _stop_reason(finish_reason: str | None, stop_reason: Any, tool_used: bool, tools_complete: bool
                 ) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a chat choice's finish (vLLM's mapping)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tools_complete:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's usage: input_tokens leave out the prompt tokens read from the prefix cache,
    which Anthropic counts as cache_read_input_tokens."""
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": max(0, (usage.get("prompt_tokens") or 0) - cached),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": usage.get("completion_tokens") or 0}


def _message_id(chat_id: str) -> str:
    return "msg_" + (chat_id.rpartition("-")[2] or uuid.uuid4().hex)


def _tool_input(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def message_body(chat: dict[str, Any]) -> dict[str, Any]:
    """The Messages reply of a chat completion body (its first choice)."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": uuid.uuid4().hex})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    for call in calls:
        arguments = _tool_input(call["function"]["arguments"])
        if arguments is not None:  # a call cut short by max_tokens cannot be run: left out
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": arguments})
    complete = any(block["type"] == "tool_use" for block in content)
    stop_reason, stop_sequence = _stop_reason(choice["finish_reason"], choice.get("stop_reason"), bool(calls), complete)
    return {"id": _message_id(chat["id"]), "type": "message", "role": "assistant", "model": chat["model"],
            "content": content or [{"type": "text", "text": ""}], "stop_reason": stop_reason,
            "stop_sequence": stop_sequence, "usage": _usage(chat.get("usage"))}


class MessageStream:
    """Turns chat completion chunks into Anthropic stream events, one content block at a time."""

    def __init__(self) -> None:
        self.started = False
        self.block: str | None = None  # the open block's type
        self.index = -1  # the open (or last) block's index
        self.tool_ids: dict[int, str] = {}
        self.tool_arguments: dict[str, str] = {}
        self.finish: tuple[str | None, Any] = (None, None)
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if not self.started:
            self.started = True
            usage = {**_usage(self.usage), "output_tokens": 0}
            events.append({"type": "message_start", "message": {
                "id": _message_id(chunk["id"]), "type": "message", "role": "assistant", "model": chunk["model"],
                "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}})
            events.append({"type": "ping"})
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
            if delta.get("content"):
                events += self._open("text", {"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                if call.get("id"):
                    self.tool_ids[call["index"]] = call["id"]
                    self.tool_arguments[call["id"]] = ""
                    events += self._open("tool_use", {"type": "tool_use", "id": call["id"],
                                                      "name": call["function"]["name"], "input": {}}, force=True)
                arguments = (call.get("function") or {}).get("arguments")
                call_id = self.tool_ids.get(call["index"])
                if arguments and call_id is not None:
                    self.tool_arguments[call_id] += arguments
                    events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
            if choice.get("finish_reason") is not None:
                self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        return events

    def close(self) -> list[dict[str, Any]]:
        """The events that end the message: the open block's stop, message_delta, message_stop."""
        events = self._close_block()
        calls = list(self.tool_arguments.values())
        stop_reason, stop_sequence = _stop_reason(self.finish[0] or "stop", self.finish[1], bool(calls),
                                                  bool(calls) and _tool_input(calls[-1]) is not None)
        events.append({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                       "usage": _usage(self.usage)})
        events.append({"type": "message_stop"})
        return events

    def _open(self, kind: str, block: dict[str, Any], force: bool = False) -> list[dict[str, Any]]:
        if self.block == kind and not force:
            return []
        events = self._close_block()
        self.block, self.index = kind, self.index + 1
        events.append({"type": "content_block_start", "index": self.index, "content_block": block})
        return events

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _close_block(self) -> list[dict[str, Any]]:
        if self.block is None:
            return []
        events = []
        if self.block == "thinking":  # Anthropic closes a thinking block with its signature
            events.append(self._delta({"type": "signature_delta", "signature": uuid.uuid4().hex}))
        events.append({"type": "content_block_stop", "index": self.index})
        self.block = None
        return events
