"""The OpenAI API of one model, inside its LLMServer replica: request bodies in, response
bodies out.

Runs next to the engine and its tokenizer (token strings for logprobs). Each route turns
its body into one GenerationRequest, runs it through the replica's Relay (the path the
Python handle methods take too), and turns the engine's outputs into OpenAI's bodies. Each
route is an async generator of plain dicts (JSON-ready bodies or stream chunks) so that the
ingress only forwards them; a request the engine refuses yields a single `ErrorResponse`
instead, before any chunk, so that the ingress can answer with the right HTTP status even
for `stream: true`.

Closing a generator (the client went away) closes the relay's, which aborts the requests
and frees their KV blocks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from app.openai_requests import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, NamedToolChoice, TokenizeRequest,
)
from app.openai_logprobs import LogprobFormatter, join_logprobs
from app.openai_responses import (
    ChatChoice, ChatChunkChoice, ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatResponseMessage,
    CompletionChoice, CompletionLogprobs, CompletionResponse, ErrorResponse, UsageInfo, error_response, new_id,
)
from app.reasoning_parsers import ReasoningParser, ReasoningStream, get_reasoning_parser
from app.relay import Relay
from app.serving_config import ServingConfig
from app.tool_parsers import NamedToolCall, RequiredToolCalls, ToolCallStream, ToolParser, final_tool_calls, get_tool_parser
from runtime.engine.errors import InvalidRequestError, check_token_ids
from runtime.engine.input_processor import template_message


def _name_constraint_param(exc: BaseException, request: Any) -> None:
    """Grammar errors name `structured_outputs.<kind>`; say instead the field the client used
    (response_format, guided_json, tools, ...)."""
    if isinstance(exc, InvalidRequestError) and (exc.param or "").startswith("structured_outputs"):
        try:
            _, source = request.structured_outputs_request()
        except InvalidRequestError:
            return
        if source is not None and source != "structured_outputs":
            message = str(exc)
            if message.startswith(exc.param + ":"):  # the message names the field too
                exc.args = (source + message[len(exc.param):],)
            exc.param = source


class OpenAIServing:
    """Completions, chat completions, /tokenize and /detokenize for one model.

    Args:
        engine: the replica's AsyncLLMEngine.
        model_id: the name responses carry as `model` (an adapter's name when one is used).
        relay: the replica's Relay on that engine.
        serving_config: how replies are read for tool calls.
    """

    def __init__(self, engine: Any, model_id: str, relay: Relay, serving_config: ServingConfig | None = None):
        self.engine = engine
        self.model_id = model_id
        self.relay = relay
        self.tokenizer = engine.tokenizer
        self.logprobs = LogprobFormatter(engine.tokenizer)
        self.max_model_len: int | None = engine.model_config.get("max_model_len")
        serving_config = serving_config or ServingConfig()
        self.tool_call_parser: str | None = serving_config.tool_call_parser
        self.enable_auto_tool_choice: bool = serving_config.enable_auto_tool_choice
        self.force_include_usage: bool = serving_config.enable_force_include_usage
        self.enable_tokenizer_info: bool = serving_config.enable_tokenizer_info_endpoint
        self.return_tokens_as_token_ids: bool = serving_config.return_tokens_as_token_ids
        self.reasoning_parser: ReasoningParser | None = (
            get_reasoning_parser(serving_config.reasoning_parser) if serving_config.reasoning_parser else None)

    # ---- /v1/completions ----------------------------------------------------------------

    async def completion(self, request: CompletionRequest, lora_request: Any = None
                         ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """Yield the response body (or, with stream, each chunk body); or one ErrorResponse.

        lora_request: generate with this LoRA adapter; responses then name the adapter as `model`.
        """
        request_id = new_id("cmpl")
        model = lora_request.lora_name if lora_request is not None else self.model_id
        prompts = request.prompts()
        try:
            outputs = await self.relay.start(request.generation_request(request_id, lora_request))
        except Exception as e:
            _name_constraint_param(e, request)
            err = error_response(e, "prompt")
            if err is None:
                raise
            yield err
            return
        n = request.n
        chunk = dict(id=request_id, object="text_completion", created=int(time.time()), model=model)
        async with aclosing(outputs):
            if not request.stream:
                last: dict[int, Any] = {}
                async for i, out in outputs:
                    last[i] = out
                choices = [self._completion_choice(request, i * n + c.index, last[i], c)
                           for i in range(len(prompts)) for c in last[i].outputs]
                yield CompletionResponse(id=request_id, created=chunk["created"], model=model,
                                         choices=sorted(choices, key=lambda c: c.index),
                                         usage=_usage(last.values())).model_dump()
                return
            include_usage, continuous_usage = request.stream_usage(self.force_include_usage)
            last = {}
            text_offsets: dict[int, int] = {}  # choice index -> text offset of its next token
            finished: set[int] = set()  # choices whose finish_reason was sent: nothing more of them
            async for i, out in outputs:
                last[i] = out
                choices = []
                for c in out.outputs:
                    index = i * n + c.index
                    if index in finished:
                        continue
                    first = index not in text_offsets
                    text, logprobs = c.delta_text or "", None
                    if request.logprobs is not None and c.delta_logprobs:
                        logprobs = self.logprobs.completion(c.delta_token_ids, c.delta_logprobs, request.logprobs,
                                                            as_ids=self._as_ids(request),
                                                            named=bool(request.logprob_token_ids))
                    if request.echo and first:
                        text, logprobs = self._echo(request, out, text, logprobs)
                    offset = text_offsets.get(index, 0)
                    if logprobs is not None and logprobs.tokens:
                        # Offsets count token strings, as in the non-streamed response.
                        logprobs = join_logprobs(CompletionLogprobs(), logprobs, offset)
                        offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                    else:
                        offset += len(text)
                    text_offsets[index] = offset
                    if text or c.finish_reason is not None or logprobs is not None:
                        ids = request.return_token_ids  # the prompt's on a choice's first chunk, as vLLM
                        choice = dict(index=index, text=text, logprobs=logprobs and logprobs.model_dump(),
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                      prompt_token_ids=list(out.prompt_token_ids) if ids and first else None,
                                      token_ids=list(c.delta_token_ids) if ids else None)
                        usage = {"usage": _choice_usage(out, c) if continuous_usage else None} if include_usage else {}
                        choices.append({**chunk, "choices": [choice], **usage})
                        if c.finish_reason is not None:
                            finished.add(index)
                for body in choices:  # one choice a chunk, as vLLM streams them
                    yield body
            if include_usage:
                yield {**chunk, "choices": [], "usage": _usage(last.values()).model_dump(exclude_none=True)}

    def _prompt_text(self, out: Any) -> str:
        if isinstance(out.prompt, str):
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids)

    def _completion_choice(self, request: CompletionRequest, index: int, out: Any, c: Any) -> CompletionChoice:
        text, logprobs = c.text, None
        if request.logprobs is not None:
            logprobs = self.logprobs.completion(c.token_ids, c.logprobs, request.logprobs, as_ids=self._as_ids(request),
                                                named=bool(request.logprob_token_ids))
        if request.echo:
            text, logprobs = self._echo(request, out, text, logprobs)
        ids = request.return_token_ids
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                prompt_logprobs=self.logprobs.prompt(out.prompt_logprobs),
                                prompt_token_ids=list(out.prompt_token_ids) if ids else None,
                                token_ids=list(c.token_ids) if ids else None)

    def _echo(self, request: CompletionRequest, out: Any, text: str, logprobs: CompletionLogprobs | None
              ) -> tuple[str, CompletionLogprobs | None]:
        """Prefix the prompt (and, with logprobs, the prompt's logprobs) to a completion; with
        return_token_ids the prompt's ids stand for its text, which vLLM then leaves out."""
        prompt_text = self._prompt_text(out)
        if logprobs is not None or request.logprobs is not None:
            prompt_lp = self.logprobs.completion(out.prompt_token_ids, out.prompt_logprobs, request.logprobs,
                                                 as_ids=self._as_ids(request))
            logprobs = join_logprobs(prompt_lp, logprobs or CompletionLogprobs(), len(prompt_text))
        return ("" if request.return_token_ids else prompt_text) + text, logprobs

    # ---- /v1/chat/completions -----------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest, lora_request: Any = None
                   ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """Yield the response body (or, with stream, each chunk body); or one ErrorResponse.

        lora_request: generate with this LoRA adapter; responses then name the adapter as `model`.
        """
        request_id = new_id("chatcmpl")
        model = lora_request.lora_name if lora_request is not None else self.model_id
        try:
            tool_parser = self._tool_parser(request)
            last = request.chat_messages()[-1]
            # vLLM's chat echo: a reply that continues an assistant message starts with it.
            echo = template_message(last)["content"] if request.echo and last.get("role") == "assistant" else ""
            generation = request.generation_request(request_id, lora_request)
            if tool_parser is not None and tool_parser.keeps_special_tokens:
                generation.sampling["skip_special_tokens"] = False  # the call markers may be special tokens
            reasoning = self._reasoning(request, generation.sampling, tool_parser)
            outputs = await self.relay.start(generation)
        except Exception as e:
            _name_constraint_param(e, request)
            err = error_response(e, "messages")
            if err is None:
                raise
            yield err
            return
        created = int(time.time())
        chunk = dict(id=request_id, object="chat.completion.chunk", created=created, model=model)
        async with aclosing(outputs):
            if not request.stream:
                out = None
                async for _, out in outputs:
                    pass
                choices = []
                for c in out.outputs:
                    thought, answer = (None, c.text) if reasoning is None else reasoning.split(c.text)
                    message, finish_reason = ChatResponseMessage(content=echo + (answer or "")), c.finish_reason
                    if reasoning is not None:
                        message.content = echo + answer if answer else None
                    if tool_parser is not None and answer is not None:
                        content, calls = final_tool_calls(tool_parser, answer, request.parallel_tool_calls)
                        message = ChatResponseMessage(content=content, tool_calls=calls or None)
                        finish_reason = _tool_finish_reason(finish_reason, bool(calls), tool_parser)
                    if thought and request.include_reasoning:
                        message.reasoning = message.reasoning_content = thought
                    choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason,
                                              logprobs=self._chat_logprobs(c.token_ids, c.logprobs, request),
                                              stop_reason=c.stop_reason,
                                              token_ids=list(c.token_ids) if request.return_token_ids else None))
                yield ChatCompletionResponse(
                    id=request_id, created=created, model=model, choices=choices,
                    usage=self._chat_usage(out, reasoning),
                    prompt_logprobs=self.logprobs.prompt(out.prompt_logprobs),
                    prompt_token_ids=list(out.prompt_token_ids) if request.return_token_ids else None).model_dump()
                return
            include_usage, continuous_usage = request.stream_usage(self.force_include_usage)
            started: set[int] = set()
            finished: set[int] = set()  # choices whose finish_reason was sent: nothing more of them
            tool_streams: dict[int, ToolCallStream] = {}
            thought_streams: dict[int, ReasoningStream] = {}
            out = None
            async for _, out in outputs:
                choices = []
                for c in out.outputs:
                    if c.index in finished:
                        continue
                    finish_reason, final = c.finish_reason, c.finish_reason is not None
                    thought, answer_delta, answer = "", c.delta_text or "", c.text
                    if reasoning is not None:
                        thinking = thought_streams.setdefault(c.index, ReasoningStream(reasoning))
                        thought, answer_delta = thinking.update(c.text, final)
                        answer = thinking.answer_so_far(c.text, final)
                    if tool_parser is not None:
                        stream = tool_streams.setdefault(c.index, ToolCallStream(tool_parser, request.parallel_tool_calls))
                        text, calls = stream.update(answer, final=final)
                        delta = ChatDelta(content=text or None, tool_calls=calls or None)
                        called = stream.num_calls > 0
                        finish_reason = _tool_finish_reason(finish_reason, called, tool_parser)
                    else:
                        delta = ChatDelta(content=answer_delta or ("" if reasoning is None else None))
                    if thought and request.include_reasoning:
                        delta.reasoning = delta.reasoning_content = thought
                    head = {}  # fields of the chunk beside its choice
                    if c.index not in started:
                        started.add(c.index)
                        delta.role = "assistant"
                        delta.content = echo + (delta.content or "")
                        if request.return_token_ids:  # as vLLM: on each choice's first chunk
                            head["prompt_token_ids"] = list(out.prompt_token_ids)
                    elif not delta.content and not delta.tool_calls and not delta.reasoning and c.finish_reason is None:
                        continue
                    choice = ChatChunkChoice(index=c.index, delta=delta, finish_reason=finish_reason,
                                             logprobs=self._chat_logprobs(c.delta_token_ids, c.delta_logprobs, request),
                                             token_ids=list(c.delta_token_ids) if request.return_token_ids else None)
                    if include_usage:
                        head["usage"] = self._chat_choice_usage(out, c, reasoning) if continuous_usage else None
                    choices.append({**chunk, "choices": [choice.body(c.stop_reason)], **head})
                    if c.finish_reason is not None:
                        finished.add(c.index)
                for body in choices:  # one choice a chunk, as vLLM streams them
                    yield body
            if include_usage:
                yield {**chunk, "choices": [], "usage": self._chat_usage(out, reasoning).model_dump(exclude_none=True)}

    def _reasoning(self, request: ChatCompletionRequest, sampling: dict[str, Any], tool_parser: ToolParser | None
                   ) -> ReasoningParser | None:
        """How this request's replies split into reasoning and answer (None: all answer); a
        grammar it asks for (structured outputs, a forced tool call) then applies to the
        answer only, as in vLLM."""
        parser = self.reasoning_parser
        if parser is None or not parser.thinks(request.template_kwargs()):
            return None
        parser = parser.for_tool_parser(tool_parser)
        if parser.keeps_special_tokens:
            sampling["skip_special_tokens"] = False  # its markers are special tokens
        spec = sampling.get("structured_outputs")
        if isinstance(spec, dict) and self.tokenizer is not None:
            sampling["structured_outputs"] = parser.constrain(spec, self.tokenizer)
        return parser

    def _chat_usage(self, out: Any, reasoning: ReasoningParser | None) -> UsageInfo:
        """_usage, with vLLM's completion_tokens_details.reasoning_tokens on a server with a
        reasoning_parser (0 for a request that does not think)."""
        usage = _usage([out])
        if self.reasoning_parser is not None and out is not None:
            usage.completion_tokens_details = {
                "reasoning_tokens": sum(_reasoning_tokens(reasoning, self.tokenizer, c) for c in out.outputs)}
        return usage

    def _chat_choice_usage(self, out: Any, c: Any, reasoning: ReasoningParser | None) -> dict[str, Any]:
        usage: dict[str, Any] = _choice_usage(out, c)
        if self.reasoning_parser is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": _reasoning_tokens(reasoning, self.tokenizer, c)}
        return usage

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[Any] | None, request: ChatCompletionRequest
                       ) -> ChatLogprobs | None:
        if not request.logprobs:
            return None
        return self.logprobs.chat(token_ids, logprobs, request.top_logprobs, as_ids=self._as_ids(request),
                                  named=bool(request.logprob_token_ids))

    def _as_ids(self, request: Any) -> bool:
        """Whether logprobs name tokens "token_id:<id>": the request's return_tokens_as_token_ids,
        else the model's serving setting (vLLM's)."""
        asked = request.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if asked is None else asked

    def _tool_parser(self, request: ChatCompletionRequest) -> ToolParser | None:
        """How tool calls are read from this request's reply; None when it has no tools to call.

        Raises:
            InvalidRequestError: tool_choice "auto" on a server without enable_auto_tool_choice
                and a tool_call_parser (as vLLM).
        """
        choice = request.effective_tool_choice
        if not request.tools or choice == "none":
            return None
        if choice == "required":
            return RequiredToolCalls()
        if isinstance(choice, NamedToolChoice):
            return NamedToolCall(choice.function.name)
        if not (self.enable_auto_tool_choice and self.tool_call_parser):
            raise InvalidRequestError(
                '"auto" tool choice needs the engine settings enable_auto_tool_choice: true and tool_call_parser '
                '(e.g. hermes); or send tool_choice "required", "none" or a named function', param="tool_choice")
        return get_tool_parser(self.tool_call_parser)

    # ---- /tokenize, /detokenize (vLLM's) -------------------------------------------------

    def tokenize(self, request: TokenizeRequest) -> dict[str, Any] | ErrorResponse:
        """{count, max_model_len, tokens[, token_strs]} of a prompt or rendered chat messages."""
        processor = self.engine.processor
        try:
            if processor.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer", param="model")
            if request.messages is not None:
                _, ids = processor.render_chat(
                    [m.model_dump(exclude_none=True) for m in request.messages],
                    add_generation_prompt=request.add_generation_prompt,
                    continue_final_message=request.continue_final_message, chat_template=request.chat_template,
                    chat_template_kwargs=request.chat_template_kwargs, tools=request.tool_dicts())
            else:
                ids = list(processor.tokenizer(request.prompt, add_special_tokens=request.add_special_tokens)
                           .input_ids)
        except InvalidRequestError as e:
            return error_response(e)
        strs = processor.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def tokenizer_info(self) -> dict[str, Any] | ErrorResponse:
        """vLLM's /tokenizer_info: the tokenizer's init arguments (files left out), its class and
        the chat template; a 404 unless the model's serving settings enable it, as in vLLM."""
        tokenizer = self.engine.processor.tokenizer
        if not self.enable_tokenizer_info:
            return ErrorResponse.make(404, "/tokenizer_info is off for this model (enable_tokenizer_info_endpoint)",
                                      type="NotFoundError")
        if tokenizer is None:
            return ErrorResponse.make(400, "this model has no tokenizer", param="model")
        config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
                  if k not in ("vocab_file", "merges_file")}
        info = {**_json_ready(config), "tokenizer_class": type(tokenizer).__name__}
        if getattr(tokenizer, "chat_template", None):
            info["chat_template"] = tokenizer.chat_template
        return info

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any] | ErrorResponse:
        """{prompt}: the text of token ids."""
        tokenizer = self.engine.processor.tokenizer
        vocab = self.engine.processor.vocab_size
        if tokenizer is None:
            return ErrorResponse.make(400, "this model has no tokenizer", param="model")
        try:
            check_token_ids(request.tokens, vocab, "tokens")
        except InvalidRequestError as e:
            return error_response(e)
        return {"prompt": tokenizer.decode(request.tokens)}


def _tool_finish_reason(finish_reason: str | None, called: bool, parser: ToolParser) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended by itself with tool calls (not for a named
    tool_choice: that finishes as "stop", as in OpenAI and vLLM)."""
    return "tool_calls" if called and finish_reason == "stop" and parser.finishes_as_tool_calls else finish_reason


def _reasoning_tokens(reasoning: ReasoningParser | None, tokenizer: Any, c: Any) -> int:
    return 0 if reasoning is None or tokenizer is None else reasoning.count_tokens(tokenizer, c.token_ids)


def _json_ready(value: Any) -> Any:
    """A tokenizer setting as JSON: special tokens (AddedToken) as their text, as vLLM sends them."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def _choice_usage(out: Any, c: Any) -> dict[str, int]:
    """The usage a chunk carries under continuous_usage_stats, as vLLM counts it: its prompt's
    tokens and the tokens its choice has generated so far."""
    prompt, generated = len(out.prompt_token_ids or ()), len(c.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def _usage(outs: Any) -> UsageInfo:
    outs = [o for o in outs if o is not None]
    prompt = sum(len(o.prompt_token_ids or ()) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": cached})
