"""Anthropic's Messages request (`POST /v1/messages`, `POST /v1/messages/count_tokens`) and its
conversion to the chat route: a Messages body becomes one ChatCompletionRequest (as vLLM converts
it, vllm/entrypoints/anthropic/serving.py), a count_tokens body one TokenizeRequest, with the
errors of that conversion naming the Messages request's own fields.

- request: `model`, `messages` (text, tool_use, tool_result, thinking blocks), `system` (text or
  text blocks), `max_tokens` (required, >= 1), `stop_sequences`, `temperature`, `top_p`, `top_k`,
  `tools` / `tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`), `thinking`
  (`disabled` turns a template's thinking off), `output_config.format` (a JSON schema), `metadata`,
  and vLLM's `chat_template_kwargs`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.openai_requests import ChatCompletionRequest, TokenizeRequest, chat_request_from
from runtime.engine.errors import InvalidRequestError


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
        return chat_request_from(fields)


class CountTokensRequest(_MessagesBody):
    """POST /v1/messages/count_tokens."""

    @model_validator(mode="after")
    def _converts_to_chat(self) -> CountTokensRequest:
        self.tokenize_request()
        return self

    def tokenize_request(self) -> TokenizeRequest:
        """The /tokenize request that renders this conversation as generation would."""
        chat = chat_request_from(self._chat_fields())
        return TokenizeRequest(model=self.model, messages=chat.messages, tools=chat.tools,
                               chat_template_kwargs=chat.template_kwargs())
