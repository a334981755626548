"""Chat messages and tools as OpenAI's clients send them, type-checked at the edge.

Used by the chat completion and /tokenize bodies (app.openai_requests). Keys these models
do not name are kept and reach the chat template, as in vLLM.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ContentPart(BaseModel):
    """A part of a message's content (the engine takes text parts and says so of others)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI's JSON text; an object is taken too


class ToolCallParam(BaseModel):
    """An assistant message's earlier tool call, as OpenAI's clients send it back."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One chat message; its known keys are type-checked here, other keys reach the chat template.

    Any role reaches the template, as in vLLM (system, developer, user, assistant, tool, or
    one the model's template knows); a template that refuses it is a 400.
    """

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(BaseModel):
    """A tool's function: its name, and a JSON schema of its arguments."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    """tool_choice naming the function the reply must call."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: ToolChoiceFunction
