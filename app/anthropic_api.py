"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as an adapter
over the chat route: a Messages body becomes one ChatCompletionRequest (app.anthropic_request),
runs through OpenAIServing.chat (the one input processor, tool parsing, reasoning parser and
grammar path), and its bodies and chunks come back as Anthropic's message, content blocks and
stream events (app.anthropic_reply). This module owns the route.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from app.anthropic_reply import MessageStream, message_body
from app.anthropic_request import CountTokensRequest, MessagesRequest
from app.openai_responses import ErrorResponse
from runtime.engine.errors import InvalidRequestError


class AnthropicServing:
    """The Messages API of one model, over its OpenAIServing (same replica, same engine).

    Args:
        openai: the replica's OpenAIServing.
    """

    def __init__(self, openai: Any):
        self.openai = openai

    async def messages(self, request: MessagesRequest, lora_request: Any = None
                       ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """Yield the Messages reply (or, with stream, each event); or one ErrorResponse first."""
        try:
            chat = request.chat_request()
        except InvalidRequestError as e:
            yield ErrorResponse.make(400, str(e), param=e.param)
            return
        stream = MessageStream() if request.stream else None
        async with aclosing(self.openai.chat(chat, lora_request)) as items:
            async for item in items:
                if isinstance(item, ErrorResponse) or stream is None:
                    yield item if isinstance(item, ErrorResponse) else message_body(item)
                    return
                for event in stream.feed(item):
                    yield event
        if stream is not None and stream.started:
            for event in stream.close():
                yield event

    def count_tokens(self, request: CountTokensRequest) -> dict[str, Any] | ErrorResponse:
        """{input_tokens}: the prompt's tokens as the Messages request would render it."""
        try:
            tokenize = request.tokenize_request()
        except InvalidRequestError as e:
            return ErrorResponse.make(400, str(e), param=e.param)
        result = self.openai.tokenize(tokenize)
        if isinstance(result, ErrorResponse):
            return result
        return {"input_tokens": result["count"], "context_management": {"original_input_tokens": result["count"]}}
