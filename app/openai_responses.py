"""OpenAI API response bodies and stream chunks (the subset servax serves), and its error body.

Built by app.openai_api from engine outputs; the field names are OpenAI's. `error_response`
is the one mapping from the engine's errors to OpenAI's (status, type, param, code).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from runtime.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, PromptTooLongError


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None
    completion_tokens_details: dict[str, int] | None = None


class PromptLogprob(BaseModel):
    """One token's entry in vLLM's `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt position, token id -> its logprob (None for the first token).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


# Bodies are sent with every field, null ones included, as vLLM sends them (clients read
# `prompt_logprobs`, `token_ids`, ... without checking that the key exists); the fields vLLM
# has and servax never fills (service_tier, kv_transfer_params, ...) are there as null too.

class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


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
    refusal: str | None = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's: {id, type: function, function: {name, arguments}}
    reasoning: str | None = None
    # The same text under its earlier name (vLLM before 0.10, DeepSeek's API), which many
    # clients read; sent only when there is reasoning.
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _no_empty_tool_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)  # as vLLM: tool_calls only when there are some
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        if data.get("reasoning_content") is None:
            data.pop("reasoning_content", None)
        return data


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None  # the same text under its earlier name
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's deltas: {index, id?, type?, function: {...}}


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None

    def body(self, stop_reason: int | str | None = None) -> dict[str, Any]:
        """The chunk's choice as vLLM streams it: the delta without its unset fields, the other
        fields even when null, and stop_reason on the choice's last chunk only."""
        data = {**self.model_dump(exclude={"delta"}), "delta": self.delta.model_dump(exclude_none=True)}
        if self.finish_reason is not None:
            data["stop_reason"] = stop_reason
        return data


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


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
