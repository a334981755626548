"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel`) as an adapter over the chat route: a Responses body becomes one
ChatCompletionRequest (as vLLM 0.32 renders it, vllm/entrypoints/openai/responses/utils.py),
runs through OpenAIServing.chat (the one input processor, tool parsing, reasoning parser and
grammar path), and its body or chunks come back as a Response object and Responses stream events.
This module owns only the wire format and the per-replica store:

- request: `input` (text, or items: messages with input_text / output_text parts,
  `function_call`, `function_call_output`, `reasoning`), `instructions`, `max_output_tokens`,
  sampling fields (vLLM's extra ones too), `tools` (function tools) with `tool_choice` and
  `parallel_tool_calls`, `text.format` (json_schema, json_object), `reasoning.effort`,
  `include: ["message.output_text.logprobs"]` with `top_logprobs`, `store`,
  `previous_response_id`, `background`, `metadata`, `user`, `chat_template_kwargs`;
- reply: output items `reasoning` (when the model has a reasoning_parser), `message`
  (output_text) and `function_call`; status completed / incomplete (max_output_tokens) /
  cancelled / failed; usage with reasoning tokens;
- stream: `response.created`, `response.in_progress`, per item `response.output_item.added`,
  (`response.content_part.added`, `response.output_text.delta` / `response.reasoning_text.delta`,
  `response.output_text.done` / `response.reasoning_text.done`, `response.content_part.done`) or
  `response.function_call_arguments.delta` / `.done`, `response.output_item.done`; then
  `response.completed`; each with its sequence_number; an `error` event if the stream fails;
- store: the last MAX_STORED_RESPONSES responses of this replica (with the conversation that
  led to each, for `previous_response_id`), in memory: per replica, as vLLM's is per server.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from app.openai_requests import ChatCompletionRequest
from app.openai_responses import ErrorResponse
from runtime.engine.errors import InvalidRequestError

MAX_STORED_RESPONSES = 1024  # per replica; the oldest is dropped first
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The chat request's names for the Responses request's fields (errors name the client's field).
_CHAT_TO_RESPONSES = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input", "response_format": "text.format",
                      "reasoning_effort": "reasoning.effort", "top_logprobs": "top_logprobs"}


def _hex() -> str:
    return uuid.uuid4().hex


# ---- request bodies -----------------------------------------------------------------------

class _Item(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Item):
    """A part of a message's content: input_text / output_text / text carry text; refusal is
    taken as its text; images, files and audio are refused (servax serves text models)."""

    type: str
    text: str | None = None
    refusal: str | None = None

    def text_of(self, param: str) -> str:
        if self.type == "refusal":
            return self.refusal or ""
        if self.type not in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            raise InvalidRequestError(f"{self.type} content is not supported: servax serves text models",
                                      param=f"{param}.type")
        if self.text is None:
            raise InvalidRequestError(f"a {self.type} part needs its text", param=f"{param}.text")
        return self.text


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    status: str | None = None

    def text(self, param: str) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text_of(f"{param}.content.{k}") for k, part in enumerate(self.content))


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[ContentPart] = Field(default_factory=list)
    content: list[ContentPart] | None = None
    encrypted_content: str | None = None


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else "?"
    return getattr(value, "type", "message")


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(_Item):
    """A function tool, in the Responses API's flat shape; other tool types (web search, file
    search, MCP, ...) need servers servax does not run."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(BaseModel):
    """text.format: plain text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise InvalidRequestError("text.format of type json_schema needs a schema", param="text.format.schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None  # echoed; a reply makes its calls in one turn
    text: TextConfig | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    reasoning: ReasoningConfig | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning item out
    include: list[str] | None = None
    top_logprobs: int = Field(0, ge=0, le=20)
    store: bool = True
    stream: bool = False
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    truncation: Literal["auto", "disabled"] = "disabled"
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's
    request_id: str | None = Field(None, min_length=1)  # vLLM's: the response's id
    prompt: Any = None  # OpenAI's stored prompt templates: refused, as by vLLM

    @property
    def ignored_fields(self) -> list[str]:
        """Fields of the body that servax does not know (accepted and ignored)."""
        return sorted(self.model_extra or ())

    @model_validator(mode="after")
    def _converts_to_chat(self) -> ResponsesRequest:
        if self.prompt is not None:
            raise InvalidRequestError("prompt template is not supported", param="prompt")
        if self.background and not self.store:
            raise InvalidRequestError("background can only be used when `store` is true", param="background")
        if self.background and self.stream:
            raise InvalidRequestError("background streaming is not supported by servax: poll "
                                      "GET /v1/responses/{id} instead", param="stream")
        unknown = sorted(set(self.include or ()) - {LOGPROBS_INCLUDE, "reasoning.encrypted_content"})
        if unknown:
            raise InvalidRequestError(f"include {unknown} is not supported; servax can include "
                                      f"{LOGPROBS_INCLUDE!r}", param="include")
        if not self.tools:
            if self.tool_choice == "required":
                raise InvalidRequestError("Tool choice 'required' must be specified with 'tools' parameter.",
                                          param="tool_choice")
            if isinstance(self.tool_choice, NamedFunction):
                raise InvalidRequestError("Tool choice 'function' not found in 'tools' parameter.",
                                          param="tool_choice")
            self.tool_choice = "none"
        elif isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in {t.name for t in self.tools}:
            raise InvalidRequestError("Tool choice 'function' not found in 'tools' parameter.", param="tool_choice")
        if self.text is not None and self.text.format is not None and self.text.format.type != "text" \
                and self.structured_outputs is not None:
            raise InvalidRequestError("Cannot specify both structured_outputs and text.format",
                                      param="structured_outputs")
        self.chat_request([])  # refused here, at the edge, with the field named
        return self

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's input as chat messages (vLLM's construct_chat_messages_with_tool_call):
        a function call or reasoning joins the assistant message before it, as one turn."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_to_messages(self.input, "input")

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion this request asks for, after `history` (the stored conversation
        of previous_response_id, without its system messages).

        Raises:
            InvalidRequestError: an item or field the chat route cannot take (.param names it).
        """
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += history + self.input_messages()
        for m in messages:  # templates read an assistant turn's content
            if m["role"] == "assistant" and m.get("content") is None:
                m["content"] = ""
        fields: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream,
                                  "parallel_tool_calls": self.parallel_tool_calls,
                                  "include_reasoning": self.include_reasoning}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "seed", "stop", "stop_token_ids", "logit_bias", "chat_template_kwargs",
                     "structured_outputs"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        for name, default in (("ignore_eos", False), ("skip_special_tokens", True),
                              ("include_stop_str_in_output", False)):
            if getattr(self, name) != default:
                fields[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in self.tools]
            choice = self.tool_choice
            fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                            "function": {"name": choice.name}}
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.json_schema, "strict": fmt.strict}}
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["reasoning_effort"] = self.reasoning.effort
        if self.wants_logprobs:
            fields.update(logprobs=True, top_logprobs=self.top_logprobs)
        if self.stream:  # the prompt's size before the first event, the usage for response.completed
            fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:
            first = e.errors()[0]
            cause = (first.get("ctx") or {}).get("error")
            param = getattr(cause, "param", None) or ".".join(str(p) for p in first.get("loc", ()))
            param = _responses_param(param)
            message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
            raise InvalidRequestError(f"{param}: {message}", param=param) from None


def _responses_param(param: str | None) -> str | None:
    """The Responses request's name for a chat request's field (`messages.3` -> `input`)."""
    if not param:
        return param
    head, _, rest = param.partition(".")
    if head in ("messages", "prompt"):
        return "input"
    return _CHAT_TO_RESPONSES.get(head, head) + ("." + rest if rest else "")


def items_to_messages(items: list[Any], param: str) -> list[dict[str, Any]]:
    """Responses items as chat messages (vLLM's conversion; reasoning kept for the template)."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{param}.{i}"
        last = out[-1] if out and out[-1]["role"] == "assistant" else None
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, ReasoningItem):
            if item.encrypted_content:
                raise InvalidRequestError("Encrypted content is not supported.", param=f"{where}.encrypted_content")
            parts = item.content or item.summary
            text = parts[0].text_of(f"{where}.content.0") if parts else ""
            if last is not None and last.get("reasoning") is None:
                last["reasoning"] = last["reasoning_content"] = text
            else:
                out.append({"role": "assistant", "content": None, "reasoning": text, "reasoning_content": text})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "".join(
                part.text_of(f"{where}.output.{k}") for k, part in enumerate(item.output))
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif item.role == "assistant":
            text = item.text(where)
            if last is not None and last.get("content") is None:
                last["content"] = text
            else:
                out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": item.role, "content": item.text(where)})
    return out


def output_to_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output as the conversation's next assistant turn: its text and its
    function calls (reasoning is left out, as vLLM leaves it out)."""
    items: list[Any] = []
    for item in output:
        if item["type"] == "message":
            items.append(MessageItem(role="assistant", content="".join(p.get("text") or "" for p in item["content"])))
        elif item["type"] == "function_call":
            items.append(FunctionCallItem.model_validate(item))
    return items_to_messages(items, "previous_response_id")


# ---- replies -------------------------------------------------------------------------------

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


def _not_found(response_id: str) -> ErrorResponse:
    return ErrorResponse.make(404, f"Response with id '{response_id}' not found.", param="response_id",
                              code="response_not_found")


def _renamed(err: ErrorResponse) -> ErrorResponse:
    """A chat route's error naming the Responses request's field instead of the chat one."""
    param = err.error.param
    new = _responses_param(param)
    if new != param:
        message = err.error.message
        if param and message.startswith(param):
            message = new + message[len(param):]
        err = ErrorResponse.make(err.status_code, message, type=err.error.type, param=new, code=err.error.code)
    return err


# ---- the route -----------------------------------------------------------------------------

class _Stored:
    """A stored response: its body, the conversation it answered, its background task."""

    def __init__(self, body: dict[str, Any], messages: list[dict[str, Any]]):
        self.body = body
        self.messages = messages
        self.task: asyncio.Task | None = None


class ResponsesServing:
    """The Responses API of one model, over its OpenAIServing (same replica, same engine), with
    this replica's store of responses.

    Args:
        openai: the replica's OpenAIServing.
        max_stored: how many responses the store keeps (the oldest leaves first).
    """

    def __init__(self, openai: Any, max_stored: int = MAX_STORED_RESPONSES):
        self.openai = openai
        self.max_stored = max_stored
        self.store: collections.OrderedDict[str, _Stored] = collections.OrderedDict()

    def _keep(self, response_id: str, stored: _Stored) -> None:
        self.store[response_id] = stored
        self.store.move_to_end(response_id)
        while len(self.store) > self.max_stored:
            self.store.popitem(last=False)

    def _plain_text(self) -> bool:
        o = self.openai
        return o.reasoning_parser is None and not (o.enable_auto_tool_choice and o.tool_call_parser)

    async def create(self, request: ResponsesRequest, lora_request: Any = None
                     ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """Yield the Response (or, with stream, each event); or one ErrorResponse first."""
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                yield _not_found(request.previous_response_id)
                return
            history = [m for m in previous.messages if m["role"] != "system"]
            history += output_to_messages(previous.body["output"])
        try:
            chat = request.chat_request(history)
        except InvalidRequestError as e:
            yield ErrorResponse.make(400, str(e), param=e.param)
            return
        model = lora_request.lora_name if lora_request is not None else self.openai.model_id
        response = ResponseBody(request, model, self.openai.engine.processor.sampling_defaults,
                                self.openai.max_model_len)
        stored = _Stored(response.body("queued", []), chat.chat_messages()) if request.store else None
        if request.background:
            self._keep(response.id, stored)
            stored.task = asyncio.get_running_loop().create_task(self._background(chat, lora_request, response, stored))
            yield stored.body
            return
        stream = ResponseStream(response) if request.stream else None
        async with aclosing(self.openai.chat(chat, lora_request)) as items:
            async for item in items:
                if isinstance(item, ErrorResponse):
                    yield _renamed(item)
                    return
                if stream is None:
                    body = response.from_chat(item, self._plain_text())
                    if stored is not None:
                        stored.body = body
                        self._keep(response.id, stored)
                    yield body
                    return
                events = [] if stream.sequence_number else stream.start(item.get("usage"))
                for event in events + stream.feed(item):
                    yield event
        if stream is not None and stream.sequence_number:
            events = stream.close()
            if stored is not None:
                stored.body = events[-1]["response"]
                self._keep(response.id, stored)
            for event in events:
                yield event

    async def _background(self, chat: ChatCompletionRequest, lora_request: Any, response: ResponseBody,
                          stored: _Stored) -> None:
        """Run a background request to its end, its stored body following its status."""
        stored.body = response.body("in_progress", [])
        try:
            async with aclosing(self.openai.chat(chat, lora_request)) as items:
                async for item in items:
                    if isinstance(item, ErrorResponse):
                        err = _renamed(item)
                        stored.body = response.body("failed", [], error={
                            "code": err.error.code or err.error.type, "message": err.error.message})
                    else:
                        stored.body = response.from_chat(item, self._plain_text())
                    return
        except asyncio.CancelledError:
            stored.body = {**stored.body, "status": "cancelled"}
            raise
        except Exception as e:  # noqa: BLE001 - the stored response says it failed
            stored.body = response.body("failed", [], error={"code": "server_error",
                                                              "message": f"{type(e).__name__}: {e}"})

    def retrieve(self, response_id: str) -> dict[str, Any] | ErrorResponse:
        """The stored Response (a background one as it stands now); 404 if this replica has none."""
        stored = self.store.get(response_id)
        return _not_found(response_id) if stored is None else stored.body

    async def cancel(self, response_id: str) -> dict[str, Any] | ErrorResponse:
        """Cancel a background response still queued or in progress: its generation is aborted
        and its status becomes cancelled. Raises nothing; a finished one is a 400 (vLLM's)."""
        stored = self.store.get(response_id)
        if stored is None:
            return _not_found(response_id)
        if stored.body["status"] not in ("queued", "in_progress") or stored.task is None:
            return ErrorResponse.make(400, "Cannot cancel a synchronous response.", param="response_id")
        stored.task.cancel()
        try:
            await stored.task
        except asyncio.CancelledError:
            pass
        stored.body = {**stored.body, "status": "cancelled"}
        return stored.body
