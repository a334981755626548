"""The OpenAI protocol on top of one AsyncLLMEngine: requests in, response bodies out.

Runs inside the LLMServer replica, next to the engine and its tokenizer (chat templates,
token strings for logprobs). Each method is an async generator of plain dicts (JSON-ready
bodies or stream chunks) so that the ingress only forwards them; a request the engine
refuses yields a single `ErrorResponse` instead, before any chunk, so that the ingress can
answer with the right HTTP status even for `stream: true`.

Closing a generator (the client went away) closes the engine's generators, which aborts
the requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from app.metrics import ServerMetrics
from app.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatDelta, ChatLogprobs, ChatResponseMessage, ChatTokenLogprob, CompletionChoice, CompletionLogprobs,
    CompletionRequest, CompletionResponse, DetokenizeRequest, ErrorResponse, NamedToolChoice, TokenizeRequest,
    TopLogprob, UsageInfo, new_id,
)
from app.tool_parsers import (
    NamedToolCall, RequiredToolCalls, ToolCallStream, ToolParser, final_tool_calls, get_tool_parser,
)
from runtime.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, PromptTooLongError
from runtime.engine.input_processor import template_message

logger = logging.getLogger("ray.serve")


def error_response(exc: BaseException, prompt_param: str = "prompt") -> ErrorResponse | None:
    """The OpenAI error for an engine error, or None if `exc` is not one we answer for."""
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


def _name_constraint_param(exc: BaseException, request: Any) -> None:
    """Grammar errors name `structured_outputs.<kind>`; say instead the field the client used
    (response_format, guided_json, tools, ...)."""
    if isinstance(exc, InvalidRequestError) and (exc.param or "").startswith("structured_outputs"):
        try:
            _, source = request.structured_outputs_request()
        except InvalidRequestError:
            return
        if source is not None and source != "structured_outputs":
            exc.param = source


class OpenAIServing:
    """Completions and chat completions for one model."""

    def __init__(self, engine: Any, model_id: str, metrics: ServerMetrics):
        self.engine = engine
        self.model_id = model_id
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len: int | None = engine.model_config.get("max_model_len")
        config = getattr(engine, "config", None)
        self.tool_call_parser: str | None = getattr(config, "tool_call_parser", None)
        self.enable_auto_tool_choice: bool = bool(getattr(config, "enable_auto_tool_choice", False))
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails the replica's startup

    # ---- engine access shared by the OpenAI routes and the Python handle methods -------

    async def submit(self, prompt: Any, sampling: Any, request_id: str, lora_request: Any = None) -> RequestStream:
        """Start a request and wait for its first output, so that a refusal raises here.

        `prompt` and `sampling` take every form the engine's InputProcessor accepts (text,
        token ids, prompt dicts, chat messages; SamplingParams or a dict of its fields).

        Returns:
            A RequestStream over all its RequestOutput snapshots (the first included);
            closing it aborts the request if it has not finished.
        """
        gen = self.engine.generate(prompt, sampling, request_id, lora_request=lora_request)
        start = time.perf_counter()
        try:
            first = await gen.__anext__()
        except BaseException:
            await gen.aclose()
            raise
        return RequestStream(gen, first, start, request_id, self)

    def _request_done(self, stream: RequestStream) -> None:
        out = stream.last
        e2e = time.perf_counter() - stream.start
        n_gen = sum(len(c.token_ids) for c in out.outputs)
        reasons = {c.finish_reason for c in out.outputs}
        reason = reasons.pop() if len(reasons) == 1 else "mixed"
        reason = reason if out.finished else "abort"
        self.metrics.observe_request(ttft_s=stream.ttft, e2e_s=e2e, prompt_tokens=len(out.prompt_token_ids or ()),
                                     generation_tokens=n_gen, finish_reason=reason)
        logger.debug("servax request %s model=%s prompt_tokens=%d generated=%d cached=%s finish=%s "
                     "ttft=%.3fs e2e=%.3fs", stream.request_id, self.model_id, len(out.prompt_token_ids or ()),
                     n_gen, getattr(out, "num_cached_tokens", None), reason, stream.ttft or -1.0, e2e)

    async def submit_all(self, prompts: list[str | list[int]], sampling: Any, request_id: str, lora_request: Any = None
                         ) -> AsyncIterator[tuple[int, Any]]:
        """Start one request per prompt (all at once); yield (prompt index, RequestOutput) as they come.

        If any prompt is refused, the others are aborted and the first refusal is raised.
        """
        if len(prompts) == 1:
            return _merge([await self.submit(prompts[0], sampling, f"{request_id}-0", lora_request)])
        results = await asyncio.gather(*(self.submit(p, sampling, f"{request_id}-{i}", lora_request)
                                         for i, p in enumerate(prompts)),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in results:
                if isinstance(r, RequestStream):
                    await r.aclose()
            raise errors[0]
        return _merge(results)

    def _default_max_tokens(self, kwargs: dict[str, Any], prompt_len: int) -> None:
        if "max_tokens" not in kwargs and self.max_model_len:
            kwargs["max_tokens"] = max(1, self.max_model_len - prompt_len)

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
            sampling = self.engine.processor.sampling_params(request.sampling_kwargs())
            outputs = await self.submit_all(prompts, sampling, request_id, lora_request)
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
                                         usage=_usage(last.values())).model_dump(exclude_none=True)
                return
            last = {}
            text_offsets: dict[int, int] = {}  # choice index -> text offset of its next token
            async for i, out in outputs:
                last[i] = out
                choices = []
                for c in out.outputs:
                    index = i * n + c.index
                    text, logprobs = c.delta_text or "", None
                    if request.logprobs is not None and c.delta_logprobs:
                        logprobs = self._completion_logprobs(c.delta_token_ids, c.delta_logprobs, request.logprobs)
                    if request.echo and index not in text_offsets:
                        text, logprobs = self._echo(request, out, text, logprobs)
                    offset = text_offsets.get(index, 0)
                    if logprobs is not None and logprobs.tokens:
                        # Offsets count token strings, as in the non-streamed response.
                        logprobs = _join_logprobs(CompletionLogprobs(), logprobs, offset)
                        offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                    else:
                        offset += len(text)
                    text_offsets[index] = offset
                    if text or c.finish_reason is not None or logprobs is not None:
                        choices.append(dict(index=index, text=text, logprobs=logprobs and logprobs.model_dump(),
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
                if choices:
                    yield {**chunk, "choices": choices, **({"usage": None} if request.include_usage else {})}
            if request.include_usage:
                yield {**chunk, "choices": [], "usage": _usage(last.values()).model_dump(exclude_none=True)}

    def _prompt_text(self, out: Any) -> str:
        if isinstance(out.prompt, str):
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids)

    def _completion_choice(self, request: CompletionRequest, index: int, out: Any, c: Any) -> CompletionChoice:
        text, logprobs = c.text, None
        if request.logprobs is not None:
            logprobs = self._completion_logprobs(c.token_ids, c.logprobs, request.logprobs)
        if request.echo:
            text, logprobs = self._echo(request, out, text, logprobs)
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    def _echo(self, request: CompletionRequest, out: Any, text: str, logprobs: CompletionLogprobs | None
              ) -> tuple[str, CompletionLogprobs | None]:
        """Prefix the prompt (and, with logprobs, the prompt's logprobs) to a completion."""
        prompt_text = self._prompt_text(out)
        if logprobs is not None or request.logprobs is not None:
            prompt_lp = self._completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, request.logprobs)
            logprobs = _join_logprobs(prompt_lp, logprobs or CompletionLogprobs(), len(prompt_text))
        return prompt_text + text, logprobs

    def _token_str(self, token_id: int, logprob: Any = None) -> str:
        decoded = getattr(logprob, "decoded_token", None)
        return decoded if decoded is not None else self.tokenizer.decode([token_id])

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[Any] | None, top_n: int
                             ) -> CompletionLogprobs:
        result, offset = CompletionLogprobs(), 0
        for pos, token_id in enumerate(token_ids):
            entry = logprobs[pos] if logprobs is not None and pos < len(logprobs) else None
            token = self._token_str(token_id, entry.get(token_id) if entry else None)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if entry is None:  # the first prompt token has no logprob
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(entry[token_id].logprob if token_id in entry else None)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
            top = {self._token_str(t, lp): lp.logprob for t, lp in ranked[:max(top_n, 1)]}
            if token_id in entry:
                top.setdefault(token, entry[token_id].logprob)
            result.top_logprobs.append(top)
        return result

    # ---- /v1/chat/completions -----------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest, lora_request: Any = None
                   ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """Yield the response body (or, with stream, each chunk body); or one ErrorResponse.

        lora_request: generate with this LoRA adapter; responses then name the adapter as `model`.
        """
        request_id = new_id("chatcmpl")
        model = lora_request.lora_name if lora_request is not None else self.model_id
        try:
            processor = self.engine.processor
            messages = request.chat_messages()
            tool_parser = self._tool_parser(request)
            _, prompt_ids = processor.render_chat(
                messages, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs, tools=request.tool_dicts())
            # vLLM's chat echo: a reply that continues an assistant message starts with it.
            echo = template_message(messages[-1])["content"] if (
                request.echo and messages[-1].get("role") == "assistant") else ""
            kwargs = request.sampling_kwargs()
            if tool_parser is not None and tool_parser.keeps_special_tokens:
                kwargs["skip_special_tokens"] = False  # the call markers may be special tokens
            self._default_max_tokens(kwargs, len(prompt_ids))
            outputs = await self.submit(prompt_ids, processor.sampling_params(kwargs), request_id, lora_request)
        except Exception as e:
            _name_constraint_param(e, request)
            err = error_response(e, "messages")
            if err is None:
                raise
            yield err
            return
        created = int(time.time())
        async with aclosing(outputs):
            if not request.stream:
                out = None
                async for out in outputs:
                    pass
                choices = []
                for c in out.outputs:
                    message, finish_reason = ChatResponseMessage(content=echo + c.text), c.finish_reason
                    if tool_parser is not None:
                        content, calls = final_tool_calls(tool_parser, c.text, request.parallel_tool_calls)
                        message = ChatResponseMessage(content=content, tool_calls=calls or None)
                        finish_reason = _tool_finish_reason(finish_reason, bool(calls))
                    choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason,
                                              logprobs=self._chat_logprobs(c.token_ids, c.logprobs, request),
                                              stop_reason=c.stop_reason))
                yield ChatCompletionResponse(id=request_id, created=created, model=model,
                                             choices=choices, usage=_usage([out])).model_dump(exclude_none=True)
                return
            usage_field = {"usage": None} if request.include_usage else {}
            started: set[int] = set()
            tool_streams: dict[int, ToolCallStream] = {}
            out = None
            async for out in outputs:
                choices = []
                for c in out.outputs:
                    finish_reason = c.finish_reason
                    if tool_parser is not None:
                        stream = tool_streams.setdefault(c.index, ToolCallStream(tool_parser, request.parallel_tool_calls))
                        text, calls = stream.update(c.text, final=c.finish_reason is not None)
                        delta = ChatDelta(content=text or None, tool_calls=calls or None)
                        finish_reason = _tool_finish_reason(finish_reason, stream.num_calls > 0)
                    else:
                        delta = ChatDelta(content=c.delta_text or "")
                    if c.index not in started:
                        started.add(c.index)
                        delta.role = "assistant"
                        delta.content = echo + (delta.content or "")
                    elif not delta.content and not delta.tool_calls and c.finish_reason is None:
                        continue
                    choices.append(ChatChunkChoice(
                        index=c.index, delta=delta, finish_reason=finish_reason,
                        logprobs=self._chat_logprobs(c.delta_token_ids, c.delta_logprobs, request)))
                if choices:
                    body = ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices)
                    yield {**body.model_dump(exclude_none=True), **usage_field}
            if request.include_usage:
                yield {**ChatCompletionChunk(id=request_id, created=created, model=model,
                                             choices=[]).model_dump(exclude_none=True),
                       "usage": _usage([out]).model_dump(exclude_none=True)}

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
                    chat_template_kwargs=request.chat_template_kwargs)
            else:
                ids = list(processor.tokenizer(request.prompt, add_special_tokens=request.add_special_tokens)
                           .input_ids)
        except InvalidRequestError as e:
            return error_response(e)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if request.return_token_strs:
            body["token_strs"] = processor.tokenizer.convert_ids_to_tokens(ids)
        return body

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any] | ErrorResponse:
        """{prompt}: the text of token ids."""
        tokenizer = self.engine.processor.tokenizer
        vocab = self.engine.processor.vocab_size
        if tokenizer is None:
            return ErrorResponse.make(400, "this model has no tokenizer", param="model")
        if any(t < 0 or t >= vocab for t in request.tokens):
            return ErrorResponse.make(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(request.tokens)}

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[Any] | None, request: ChatCompletionRequest
                       ) -> ChatLogprobs | None:
        if not request.logprobs or logprobs is None:
            return None
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            entry = entry or {}
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
            token = self._token_str(token_id, entry.get(token_id))
            top = [TopLogprob(token=(s := self._token_str(t, lp)), logprob=lp.logprob, bytes=list(s.encode()))
                   for t, lp in ranked[:request.top_logprobs or 0]]
            lp = entry[token_id].logprob if token_id in entry else float("nan")
            content.append(ChatTokenLogprob(token=token, logprob=lp, bytes=list(token.encode()), top_logprobs=top))
        return ChatLogprobs(content=content)


class RequestStream:
    """The RequestOutput snapshots of one submitted request (an async iterator).

    `aclose()` closes the engine's generator, which aborts the request if it is still
    running; the request's metrics and debug log line are recorded then, once.
    """

    def __init__(self, gen: AsyncIterator[Any], first: Any, start: float, request_id: str, owner: OpenAIServing):
        self._gen, self._pending, self._owner = gen, first, owner
        self.start, self.request_id = start, request_id
        self.last, self.ttft, self._closed = first, None, False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Any:
        if self._pending is not None:
            out, self._pending = self._pending, None
        elif self.last.finished or self._closed:
            raise StopAsyncIteration
        else:
            out = await self._gen.__anext__()
        self.last = out
        if self.ttft is None and any(c.token_ids for c in out.outputs):
            self.ttft = time.perf_counter() - self.start
        if out.finished:
            await self.aclose()
        return out

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._gen.aclose()
        finally:
            self._owner._request_done(self)


def _tool_finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended by itself with tool calls."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def _join_logprobs(head: CompletionLogprobs, tail: CompletionLogprobs, shift: int) -> CompletionLogprobs:
    """`head` followed by `tail`, whose text offsets start `shift` characters later."""
    return CompletionLogprobs(
        tokens=head.tokens + tail.tokens, token_logprobs=head.token_logprobs + tail.token_logprobs,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
        text_offset=head.text_offset + [o + shift for o in tail.text_offset],
    )


def _usage(outs: Any) -> UsageInfo:
    outs = [o for o in outs if o is not None]
    prompt = sum(len(o.prompt_token_ids or ()) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": cached})


async def _merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several request streams as (stream index, item); closing closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except BaseException as e:  # surfaced to the consumer below
            await queue.put((i, e))
            raise
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()
