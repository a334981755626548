"""ServingConfig: the settings of the OpenAI routes that the engine never reads.

Users write them where vLLM users do, among the engine arguments: a YAML model block's
`engine_kwargs` (`engine_kwargs: {tool_call_parser: hermes, enable_auto_tool_choice: true}`)
or `LLM(model, ...)`'s keywords. `split_engine_kwargs` takes them out before the rest
becomes the EngineConfig.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.reasoning_parsers import get_reasoning_parser
from app.tool_parsers import get_tool_parser


class ServingConfig(BaseModel):
    """How one model's OpenAI routes read replies (vLLM's argument names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_auto_tool_choice: bool = Field(
        False, description='Let the model decide to call tools (tool_choice "auto"); needs tool_call_parser.')
    tool_call_parser: str | None = Field(
        None, description="How tool calls are read from replies: hermes (Hermes, Qwen 2/2.5/3), llama3_json or "
                          "openai (gpt-oss's harmony).")
    enable_tokenizer_info_endpoint: bool = Field(
        False, description="Serve GET /tokenizer_info (the tokenizer's configuration, chat template included).")
    enable_force_include_usage: bool = Field(
        False, description="Every stream reports usage, on each chunk and in a last chunk, as if it asked "
                           "stream_options {include_usage, continuous_usage_stats}.")
    reasoning_parser: str | None = Field(
        None, description="How a thinking model's reasoning is told from its answer: qwen3, deepseek_r1 or "
                          "openai_gptoss (gpt-oss's harmony channels) "
                          "(app.reasoning_parsers); replies then carry it as message.reasoning.")
    return_tokens_as_token_ids: bool = Field(
        False, description='Logprobs name tokens as "token_id:<id>" rather than their text (a request\'s '
                           "return_tokens_as_token_ids overrides it).")

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, name: str | None) -> str | None:
        if name is not None:
            get_tool_parser(name)  # raises ValueError naming the known parsers
        return name

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, name: str | None) -> str | None:
        if name is not None:
            get_reasoning_parser(name)  # raises ValueError naming the known parsers
        return name

    @model_validator(mode="after")
    def _auto_tool_choice_needs_parser(self) -> ServingConfig:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (e.g. hermes or llama3_json)")
        return self


SERVING_KEYS = frozenset(ServingConfig.model_fields)


def split_engine_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], ServingConfig]:
    """(the EngineConfig fields, the ServingConfig) of engine arguments as users write them.

    Raises:
        pydantic.ValidationError: a serving setting is wrong.
    """
    engine = {k: v for k, v in kwargs.items() if k not in SERVING_KEYS}
    return engine, ServingConfig(**{k: v for k, v in kwargs.items() if k in SERVING_KEYS})
