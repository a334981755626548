"""OpenAI API request and response bodies (the subset servax serves), as pydantic models.

Requests forbid unknown fields, so that a misspelt parameter is a 400 naming it rather
than a silently different generation; a few fields OpenAI clients send routinely and that
do not change the output (`user`, `metadata`, ...) are accepted and ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


class _Request(BaseModel):
    """Fields shared by completions and chat completions.

    Types are checked here; value ranges are not: runtime.SamplingParams and the engine's
    InputProcessor own them (one set of limits for HTTP, handles and the offline LLM), and
    their errors reach the client as 400s naming the parameter.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Accepted and ignored: they do not change what is generated.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Request:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """The runtime.SamplingParams fields this request sets (vLLM's names)."""
        kwargs: dict[str, Any] = {"n": self.n}
        # Only what differs from the defaults, so SamplingParams sees what the client asked for.
        for name, default in (("ignore_eos", False), ("min_tokens", 0), ("skip_special_tokens", True),
                              ("include_stop_str_in_output", False)):
            if getattr(self, name) != default:
                kwargs[name] = getattr(self, name)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "seed", "stop_token_ids", "max_tokens"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if self.stop is not None:
            kwargs["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.logit_bias:
            kwargs["logit_bias"] = dict(self.logit_bias)  # SamplingParams checks the ids and values
        return kwargs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


Prompt = str | list[int] | list[str | list[int]]


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: Prompt
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt: Prompt) -> Prompt:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> None:
        if suffix is not None:
            raise ValueError("suffix is not supported")
        return None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of != n:
            raise ValueError(f"best_of ({best_of}) other than n ({n}) is not supported")
        return best_of

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one text or token-id list each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        kwargs.setdefault("max_tokens", 16)  # OpenAI's default for completions
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
            if self.echo:
                kwargs["prompt_logprobs"] = self.logprobs
        return kwargs


class ChatMessage(BaseModel):
    """One chat message; extra keys (tool_calls, tool_call_id, ...) reach the chat template."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as dicts for the engine's InputProcessor (which renders the template)."""
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        if self.max_completion_tokens is not None:
            kwargs["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        return kwargs


# Responses. Built by app.serving; the field names are OpenAI's.

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


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
