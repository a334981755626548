"""The Responses API's request (`POST /v1/responses`) and its conversion to the chat route: a
Responses body becomes one ChatCompletionRequest (as vLLM 0.32 renders it,
vllm/entrypoints/openai/responses/utils.py), with the errors of that conversion naming the
Responses request's own fields.

- request: `input` (text, or items: messages with input_text / output_text parts,
  `function_call`, `function_call_output`, `reasoning`), `instructions`, `max_output_tokens`,
  sampling fields (vLLM's extra ones too), `tools` (function tools) with `tool_choice` and
  `parallel_tool_calls`, `text.format` (json_schema, json_object), `reasoning.effort`,
  `include: ["message.output_text.logprobs"]` with `top_logprobs`, `store`,
  `previous_response_id`, `background`, `metadata`, `user`, `chat_template_kwargs`;
- conversation: input items, and a stored response's output items, as chat messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from app.openai_requests import ChatCompletionRequest, SamplingFields, chat_request_from
from runtime.engine.errors import InvalidRequestError

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The chat request's names for the Responses request's fields (errors name the client's field).
_CHAT_TO_RESPONSES = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input", "response_format": "text.format",
                      "reasoning_effort": "reasoning.effort", "top_logprobs": "top_logprobs"}


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


class ResponsesRequest(SamplingFields):
    """POST /v1/responses (with the sampling fields of the chat route it converts to)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
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
        return chat_request_from(fields, responses_param)


def responses_param(param: str | None) -> str | None:
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
