"""OpenAI API request bodies (the subset servax serves), as pydantic models, and what each
asks the engine for: a GenerationRequest (app.relay) of engine prompts and sampling fields.

Unknown request fields are accepted and ignored, as vLLM does: the ingress logs a warning
naming them and lists them in the `x-servax-ignored-fields` response header. Fields that
OpenAI defines but servax does not implement (audio output, predicted outputs, ...) are
a 400 that says so, never a silent no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from app.openai_messages import ChatCompletionTool, ChatMessage, NamedToolChoice
from app.relay import GenerationRequest
from app.tool_parsers import named_tool_call_schema, required_tool_calls_schema
from runtime.engine.errors import InvalidRequestError
from runtime.engine.input_processor import ChatPrompt


class SamplingFields(BaseModel):
    """The sampling fields (vLLM's names) of every route that samples: completions, chat
    completions and the Responses API (app/responses_request.py)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)  # vLLM's bounds: an int64
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class _Request(SamplingFields):
    """Fields shared by completions and chat completions.

    Types are checked here; value ranges are not: runtime.SamplingParams and the engine's
    InputProcessor own them (one set of limits for HTTP, handles and the offline LLM), and
    their errors reach the client as 400s naming the parameter.
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None  # vLLM's: the top-N logprobs of each prompt token (-1: all)
    return_token_ids: bool | None = None  # vLLM's: prompt and generated token ids beside the text
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:<id>"
    logprob_token_ids: list[int] | None = None  # vLLM's: logprobs of these ids instead of the top N
    truncate_prompt_tokens: int | None = None  # vLLM's: keep this many prompt tokens (-1: what fits)
    truncation_side: Literal["left", "right"] | None = None
    use_beam_search: bool = False  # vLLM's; servax has no beam search: true is a 400 that says so
    length_penalty: float = 1.0  # vLLM's; only beam search reads it
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted and ignored: they do not change what is generated.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs (a dict of
    # runtime.engine.sampling_params.StructuredOutputsParams fields) and its older guided_* names.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    @property
    def ignored_fields(self) -> list[str]:
        """Fields of the request body that servax does not know (accepted and ignored)."""
        return sorted(self.model_extra or ())

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Request:
        if self.logprob_token_ids and self.use_beam_search:
            raise InvalidRequestError("logprob_token_ids is not supported with beam search", param="logprob_token_ids")
        if self.use_beam_search:
            raise InvalidRequestError(
                "use_beam_search is not supported: servax does not implement beam search; sample n choices "
                "instead (n, temperature, seed) and pick by their logprobs", param="use_beam_search")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.stream and self.prompt_logprobs is not None and self.prompt_logprobs != 0:
            raise InvalidRequestError("prompt_logprobs are not available when stream is true (as in vLLM)",
                                      param="prompt_logprobs")
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
                     "repetition_penalty", "seed", "stop_token_ids", "max_tokens", "prompt_logprobs",
                     "truncate_prompt_tokens", "truncation_side"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if self.stop is not None:
            kwargs["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.logit_bias:
            kwargs["logit_bias"] = dict(self.logit_bias)  # SamplingParams checks the ids and values
        if self.logprob_token_ids:  # SamplingParams checks them; the engine, against the vocabulary
            kwargs["logprob_token_ids"] = list(self.logprob_token_ids)
        for name in ("allowed_token_ids", "bad_words"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        spec, _ = self.structured_outputs_request()
        if spec is not None:
            kwargs["structured_outputs"] = spec
        return kwargs

    def structured_outputs_request(self) -> tuple[dict[str, Any] | None, str | None]:
        """(StructuredOutputsParams fields, the request field that asked) or (None, None).

        Raises:
            InvalidRequestError: more than one field asks for a constraint.
        """
        asked: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", dict(self.structured_outputs)))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, {kind: getattr(self, name)}))
        if self.response_format is not None and self.response_format.type != "text":
            asked.append(("response_format", self.response_format.structured_outputs()))
        if len(asked) > 1:
            raise InvalidRequestError(
                f"give one structured output constraint, not {' and '.join(name for name, _ in asked)}",
                param=asked[1][0])
        return (asked[0][1], asked[0][0]) if asked else (None, None)

    def stream_usage(self, force: bool = False) -> tuple[bool, bool]:
        """(a last chunk with the usage, usage on every chunk), as vLLM decides them: from
        stream_options, or both when the server forces them (enable_force_include_usage)."""
        if force:
            return True, True
        include = bool(self.stream_options and self.stream_options.include_usage)
        return include, include and self.stream_options.continuous_usage_stats


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: the schema the reply must follow (`strict` or not, it is enforced)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self

    def structured_outputs(self) -> dict[str, Any]:
        if self.type == "json_object":
            return {"json_object": True}
        schema = self.json_schema.json_schema if self.json_schema is not None else None
        return {"json": schema if schema is not None else {"type": "object"}}


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

    def generation_request(self, request_id: str, lora_request: Any = None) -> GenerationRequest:
        """What the engine runs: one request per prompt of the batch, with this body's sampling."""
        return GenerationRequest(request_id, self.prompts(), self.sampling_kwargs(), lora_request)

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        if self.logprob_token_ids:  # as vLLM: the ids' logprobs, however many logprobs asked
            if self.logprobs is None:
                raise InvalidRequestError("when using logprob_token_ids, logprobs must be set",
                                          param="logprob_token_ids")
            if self.echo and self.max_tokens == 0:
                raise InvalidRequestError("logprob_token_ids is not supported when echo is true and max_tokens "
                                          "is 0: no output tokens are generated", param="logprob_token_ids")
        elif self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
        if self.logprobs is not None and self.echo and self.prompt_logprobs is None:
            kwargs["prompt_logprobs"] = self.logprobs  # the echoed prompt's logprobs, as vLLM
        return kwargs


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # vLLM's: the reply continues (and repeats) the last message's content
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the reply
    # vLLM's: reaches the chat template, and "none" turns Qwen3-style thinking off (enable_thinking)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # OpenAI features servax does not implement: a 400 naming them.
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: list[str] | None = None

    @field_validator("audio", "prediction", "web_search_options", "functions", "function_call")
    @classmethod
    def _not_implemented(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None:
            hint = "; use tools" if info.field_name in ("functions", "function_call") else ""
            raise ValueError(f"{info.field_name} is not supported by servax{hint}")
        return None

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and set(value) - {"text"}:
            raise ValueError(f"only the text modality is supported, got {value}")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, value: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools")
        if value in ("required", "auto") and not tools or isinstance(value, NamedToolChoice) and not tools:
            raise ValueError(f"tool_choice {value if isinstance(value, str) else 'naming a function'} needs tools")
        if isinstance(value, NamedToolChoice) and value.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"tool_choice names {value.function.name!r}, which is not among the tools")
        return value

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs < -1:
            raise InvalidRequestError(f"top_logprobs must be >= 0, or -1 for the whole vocabulary, "
                                      f"got {self.top_logprobs}", param="top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.logprob_token_ids and not self.logprobs:
            raise InvalidRequestError("when using logprob_token_ids, logprobs must be set to true",
                                      param="logprob_token_ids")
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as dicts for the engine's InputProcessor (which renders the template)."""
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def generation_request(self, request_id: str, lora_request: Any = None) -> GenerationRequest:
        """What the engine runs: the conversation, rendered by the engine's InputProcessor with
        this body's template options and tools, and this body's sampling."""
        prompt = ChatPrompt(self.chat_messages(), add_generation_prompt=self.add_generation_prompt,
                            continue_final_message=self.continue_final_message, chat_template=self.chat_template,
                            chat_template_kwargs=self.template_kwargs(), tools=self.tool_dicts())
        return GenerationRequest(request_id, [prompt], self.sampling_kwargs(), lora_request)

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs, with reasoning_effort as vLLM passes it (and enable_thinking
        from it unless the request sets that itself)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        extra = {"reasoning_effort": self.reasoning_effort, "enable_thinking": self.reasoning_effort != "none"}
        return {**extra, **(self.chat_template_kwargs or {})}

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """tool_choice, or OpenAI's default: "auto" with tools, "none" without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template gets them (OpenAI's shape)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        if self.max_completion_tokens is not None:
            kwargs["max_tokens"] = self.max_completion_tokens
        if self.logprobs and not self.logprob_token_ids:  # with ids, as many entries as ids (vLLM's)
            kwargs["logprobs"] = self.top_logprobs or 0
        forced = self.forced_tool_call_schema()
        if forced is not None:  # as vLLM: a forced tool call replaces any other constraint
            kwargs["structured_outputs"] = {"json": forced, "disable_any_whitespace": True}
        return kwargs

    def forced_tool_call_schema(self) -> dict[str, Any] | None:
        """The JSON schema that tool_choice "required" or a named function forces, else None."""
        choice = self.effective_tool_choice
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools or []]
        if choice == "required":
            return required_tool_calls_schema(functions, self.parallel_tool_calls)
        if isinstance(choice, NamedToolChoice):
            return named_tool_call_schema(next(f for f in functions if f["name"] == choice.function.name))
        return None

    def structured_outputs_request(self) -> tuple[dict[str, Any] | None, str | None]:
        if self.forced_tool_call_schema() is not None:
            return None, "tools"
        return super().structured_outputs_request()


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = None  # rendered into the prompt by the chat template
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_xor_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.tools is not None and self.messages is None:
            raise InvalidRequestError("tools are rendered with messages; a prompt has none", param="tools")
        return self

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body; base_model_name picks the base when several serve LoRA)."""

    lora_name: str = ""
    lora_path: str = ""
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body)."""

    lora_name: str = ""
    lora_int_id: int | None = None


TokenizeRequest.model_rebuild()
_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()


def chat_request_from(fields: dict[str, Any], rename: Callable[[str], str] = lambda param: param
                      ) -> ChatCompletionRequest:
    """The ChatCompletionRequest of fields another API converted (Responses, Anthropic Messages);
    a field the chat route refuses is an InvalidRequestError whose param `rename` gives in that
    API's own terms."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        param = rename(getattr(cause, "param", None) or ".".join(str(p) for p in first.get("loc", ())))
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        raise InvalidRequestError(f"{param}: {message}", param=param) from None
