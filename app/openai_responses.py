"""OpenAI API response bodies and stream chunks (the subset servax serves), and its error body.

Built by app.openai_api from engine outputs; the field names are OpenAI's. `error_response`
is the one mapping from the engine's errors to OpenAI's (status, type, param, code).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from runtime.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, PromptTooLongError


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's: {id, type: function, function: {name, arguments}}


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's deltas: {index, id?, type?, function: {...}}


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One entry of GET /v1/models, with servax's own metadata beside OpenAI's fields."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "servax"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    impl: str | None = None
    dtype: str | None = None
    tensor_parallel_size: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body; `status_code` travels beside it from the server to the ingress."""

    error: ErrorInfo
    status_code: int = Field(400, exclude=True)

    @classmethod
    def make(cls, status_code: int, message: str, type: str = "invalid_request_error",
             param: str | None = None, code: str | None = None) -> ErrorResponse:
        return cls(error=ErrorInfo(message=message, type=type, param=param, code=code), status_code=status_code)


def error_response(exc: BaseException, prompt_param: str = "prompt") -> ErrorResponse | None:
    """The OpenAI error for an engine error, or None if `exc` is not one we answer for.

    `prompt_param` names the field a too-long prompt came in (prompt, messages, ...).
    """
    if isinstance(exc, PromptTooLongError):
        return ErrorResponse.make(400, str(exc), param=exc.param or prompt_param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return ErrorResponse.make(400, str(exc), param=exc.param)
    if isinstance(exc, EngineOverloadedError):
        return ErrorResponse.make(429, str(exc) or "engine queue is full, retry later",
                                  type="rate_limit_error", code="rate_limit_exceeded")
    if isinstance(exc, EngineDeadError):
        return ErrorResponse.make(503, str(exc) or "engine is dead", type="server_error", code="engine_dead")
    return None
