"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as an adapter
over the chat route: a Messages body becomes one ChatCompletionRequest (as vLLM converts it,
vllm/entrypoints/anthropic/serving.py), runs through OpenAIServing.chat (the one input processor,
tool parsing, reasoning parser and grammar path), and its bodies and chunks come back as
Anthropic's message, content blocks and stream events. This module owns only the wire format:

- request: `model`, `messages` (text, tool_use, tool_result, thinking blocks), `system` (text or
  text blocks), `max_tokens` (required, >= 1), `stop_sequences`, `temperature`, `top_p`, `top_k`,
  `tools` / `tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`), `thinking`
  (`disabled` turns a template's thinking off), `output_config.format` (a JSON schema), `metadata`,
  and vLLM's `chat_template_kwargs`;
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
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.openai_requests import ChatCompletionRequest, TokenizeRequest
from app.openai_responses import ErrorResponse
from runtime.engine.errors import InvalidRequestError

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


# ---- request bodies -----------------------------------------------------------------------

class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageBlock(_Block):
    type: Literal["image", "document"]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str | None = None


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                         | RedactedThinkingBlock, Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    """A turn; vLLM also takes `system` turns (Claude Code's reminders): their text joins the
    system prompt, where every chat template accepts it."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_tool(self) -> AnthropicToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice.name is required when type is 'tool'")
        return self


class ThinkingConfig(BaseModel):
    """Extended thinking: `disabled` turns the template's thinking off (enable_thinking false);
    `enabled` (its budget_tokens is checked as vLLM checks it, not enforced) and `adaptive`
    leave the model to think as its template has it."""

    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1024)


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"] = "json_schema"
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: OutputFormat | None = None


class _MessagesBody(BaseModel):
    """What a Messages request and a count_tokens request share: the conversation and tools."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    messages: list[AnthropicMessage]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's

    @property
    def ignored_fields(self) -> list[str]:
        """Fields of the body that servax does not know (accepted and ignored)."""
        return sorted(self.model_extra or ())

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI chat messages (vLLM's conversion)."""
        out: list[dict[str, Any]] = []
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or ())
        for message in self.messages:
            if message.role == "system":
                system += message.content if isinstance(message.content, str) else "".join(
                    b.text for b in message.content if isinstance(b, TextBlock))
        if system:
            out.append({"role": "system", "content": system})
        for i, message in enumerate(self.messages):
            if message.role == "system":
                continue
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
                continue
            texts, calls, thoughts = [], [], []
            for j, block in enumerate(message.content):
                if isinstance(block, ImageBlock):
                    raise InvalidRequestError(f"{block.type} content blocks are not supported: servax serves text "
                                              "models", param=f"messages.{i}.content.{j}.type")
                if isinstance(block, TextBlock):
                    texts.append(block.text)
                elif isinstance(block, ThinkingBlock):
                    thoughts.append(block.thinking)
                elif isinstance(block, ToolUseBlock):
                    calls.append({"id": block.id, "type": "function",
                                  "function": {"name": block.name, "arguments": json.dumps(block.input)}})
                elif isinstance(block, ToolResultBlock):
                    if message.role != "user":
                        raise InvalidRequestError("tool_result blocks belong in user messages",
                                                  param=f"messages.{i}.content.{j}")
                    out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": _tool_result_text(block, f"messages.{i}.content.{j}")})
            chat: dict[str, Any] = {"role": message.role}
            if texts:
                chat["content"] = "".join(texts)
            if calls:
                chat["tool_calls"] = calls
                chat.setdefault("content", "")  # templates read an assistant message's content
            if thoughts:
                chat["reasoning"] = chat["reasoning_content"] = "".join(thoughts)
            if "content" in chat or message.role == "assistant":
                chat.setdefault("content", "")
                out.append(chat)
        if all(m["role"] == "system" for m in out):
            raise InvalidRequestError("messages must hold at least one user or assistant message", param="messages")
        return out

    def _chat_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"model": self.model, "messages": self.chat_messages()}
        kwargs = dict(self.chat_template_kwargs or {})
        if self.thinking is not None and self.thinking.type == "disabled":
            kwargs.setdefault("enable_thinking", False)
        if kwargs:
            fields["chat_template_kwargs"] = kwargs
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": {"type": "object", **t.input_schema}}}
                for t in self.tools]
            fields["tool_choice"] = "auto"
        choice = self.tool_choice
        if choice is not None:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type, {"type": "function", "function": {"name": choice.name}})
            if choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        if self.output_config is not None and self.output_config.format is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.json_schema}}
        return fields


def _tool_result_text(block: ToolResultBlock, param: str) -> str:
    if isinstance(block.content, str):
        return block.content
    for k, part in enumerate(block.content):
        if isinstance(part, ImageBlock):
            raise InvalidRequestError(f"{part.type} content blocks are not supported: servax serves text models",
                                      param=f"{param}.content.{k}.type")
    return "\n".join(part.text for part in block.content)


def _as_chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The ChatCompletionRequest of converted fields; a field the chat route refuses is an
    InvalidRequestError in the Messages API's own terms."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        param = getattr(cause, "param", None) or ".".join(str(p) for p in first.get("loc", ()))
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        raise InvalidRequestError(f"{param}: {message}", param=param) from None


class MessagesRequest(_MessagesBody):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # accepted and ignored (user_id), as by vLLM
    service_tier: str | None = None  # accepted and ignored

    @model_validator(mode="after")
    def _converts_to_chat(self) -> MessagesRequest:
        if self.thinking is not None and self.thinking.budget_tokens is not None \
                and self.thinking.budget_tokens >= self.max_tokens:
            raise InvalidRequestError("thinking.budget_tokens must be less than max_tokens",
                                      param="thinking.budget_tokens")
        self.chat_request()  # refused here, at the edge, with the field named
        return self

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this Messages request asks for.

        Raises:
            InvalidRequestError: a block or field the chat route cannot take (.param names it).
        """
        fields = self._chat_fields()
        fields.update(max_tokens=self.max_tokens, stream=self.stream)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.stop_sequences:
            fields["stop"] = self.stop_sequences
        if self.stream:  # the prompt's size for message_start, the usage for message_delta
            fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return _as_chat_request(fields)


class CountTokensRequest(_MessagesBody):
    """POST /v1/messages/count_tokens."""

    @model_validator(mode="after")
    def _converts_to_chat(self) -> CountTokensRequest:
        self.tokenize_request()
        return self

    def tokenize_request(self) -> TokenizeRequest:
        """The /tokenize request that renders this conversation as generation would."""
        chat = _as_chat_request(self._chat_fields())
        return TokenizeRequest(model=self.model, messages=chat.messages, tools=chat.tools,
                               chat_template_kwargs=chat.template_kwargs())


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


class AnthropicServing:
    """The Messages API of one model, over its OpenAIServing (same replica, same engine).

    Args:
        openai: the replica's OpenAIServing.
    """

    def __init__(self, openai: Any):
        self.openai = openai

    async def messages(self, request: MessagesRequest, lora_request: Any = None
                       ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """Yield the Messages reply (or, with stream, each event); or one ErrorResponse first."""
        try:
            chat = request.chat_request()
        except InvalidRequestError as e:
            yield ErrorResponse.make(400, str(e), param=e.param)
            return
        stream = MessageStream() if request.stream else None
        async with aclosing(self.openai.chat(chat, lora_request)) as items:
            async for item in items:
                if isinstance(item, ErrorResponse) or stream is None:
                    yield item if isinstance(item, ErrorResponse) else message_body(item)
                    return
                for event in stream.feed(item):
                    yield event
        if stream is not None and stream.started:
            for event in stream.close():
                yield event

    def count_tokens(self, request: CountTokensRequest) -> dict[str, Any] | ErrorResponse:
        """{input_tokens}: the prompt's tokens as the Messages request would render it."""
        try:
            tokenize = request.tokenize_request()
        except InvalidRequestError as e:
            return ErrorResponse.make(400, str(e), param=e.param)
        result = self.openai.tokenize(tokenize)
        if isinstance(result, ErrorResponse):
            return result
        return {"input_tokens": result["count"], "context_management": {"original_input_tokens": result["count"]}}
