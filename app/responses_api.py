"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel`) as an adapter over the chat route: a Responses body becomes one
ChatCompletionRequest (app.responses_request), runs through OpenAIServing.chat (the one input
processor, tool parsing, reasoning parser and grammar path), and its body or chunks come back as
a Response object and Responses stream events (app.responses_output). This module owns the route
and the per-replica store:

- store: the last MAX_STORED_RESPONSES responses of this replica (with the conversation that
  led to each, for `previous_response_id`), in memory: per replica, as vLLM's is per server;
- background: a stored request run to its end as a task, retrieved and cancelled by its id.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from app.openai_requests import ChatCompletionRequest
from app.openai_responses import ErrorResponse
from app.responses_output import ResponseBody, ResponseStream
from app.responses_request import ResponsesRequest, output_to_messages, responses_param
from runtime.engine.errors import InvalidRequestError

MAX_STORED_RESPONSES = 1024  # per replica; the oldest is dropped first


def _not_found(response_id: str) -> ErrorResponse:
    return ErrorResponse.make(404, f"Response with id '{response_id}' not found.", param="response_id",
                              code="response_not_found")


def _renamed(err: ErrorResponse) -> ErrorResponse:
    """A chat route's error naming the Responses request's field instead of the chat one."""
    param = err.error.param
    new = responses_param(param)
    if new != param:
        message = err.error.message
        if param and message.startswith(param):
            message = new + message[len(param):]
        err = ErrorResponse.make(err.status_code, message, type=err.error.type, param=new, code=err.error.code)
    return err


# ---- the route -----------------------------------------------------------------------------

class _Stored:
    """A stored response: its body, the conversation it answered, its background task."""

    def __init__(self, body: dict[str, Any], messages: list[dict[str, Any]]):
        self.body = body
        self.messages = messages
        self.task: asyncio.Task | None = None


class ResponsesServing:
    """The Responses API of one model, over its OpenAIServing (same replica, same engine), with
    this replica's store of responses.

    Args:
        openai: the replica's OpenAIServing.
        max_stored: how many responses the store keeps (the oldest leaves first).
    """

    def __init__(self, openai: Any, max_stored: int = MAX_STORED_RESPONSES):
        self.openai = openai
        self.max_stored = max_stored
        self.store: collections.OrderedDict[str, _Stored] = collections.OrderedDict()

    def _keep(self, response_id: str, stored: _Stored) -> None:
        self.store[response_id] = stored
        self.store.move_to_end(response_id)
        while len(self.store) > self.max_stored:
            self.store.popitem(last=False)

    def _plain_text(self) -> bool:
        o = self.openai
        return o.reasoning_parser is None and not (o.enable_auto_tool_choice and o.tool_call_parser)

    async def create(self, request: ResponsesRequest, lora_request: Any = None
                     ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """Yield the Response (or, with stream, each event); or one ErrorResponse first."""
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                yield _not_found(request.previous_response_id)
                return
            history = [m for m in previous.messages if m["role"] != "system"]
            history += output_to_messages(previous.body["output"])
        try:
            chat = request.chat_request(history)
        except InvalidRequestError as e:
            yield ErrorResponse.make(400, str(e), param=e.param)
            return
        model = lora_request.lora_name if lora_request is not None else self.openai.model_id
        response = ResponseBody(request, model, self.openai.engine.processor.sampling_defaults,
                                self.openai.max_model_len)
        stored = _Stored(response.body("queued", []), chat.chat_messages()) if request.store else None
        if request.background:
            self._keep(response.id, stored)
            stored.task = asyncio.get_running_loop().create_task(self._background(chat, lora_request, response, stored))
            yield stored.body
            return
        stream = ResponseStream(response) if request.stream else None
        async with aclosing(self.openai.chat(chat, lora_request)) as items:
            async for item in items:
                if isinstance(item, ErrorResponse):
                    yield _renamed(item)
                    return
                if stream is None:
                    body = response.from_chat(item, self._plain_text())
                    if stored is not None:
                        stored.body = body
                        self._keep(response.id, stored)
                    yield body
                    return
                events = [] if stream.sequence_number else stream.start(item.get("usage"))
                for event in events + stream.feed(item):
                    yield event
        if stream is not None and stream.sequence_number:
            events = stream.close()
            if stored is not None:
                stored.body = events[-1]["response"]
                self._keep(response.id, stored)
            for event in events:
                yield event

    async def _background(self, chat: ChatCompletionRequest, lora_request: Any, response: ResponseBody,
                          stored: _Stored) -> None:
        """Run a background request to its end, its stored body following its status."""
        stored.body = response.body("in_progress", [])
        try:
            async with aclosing(self.openai.chat(chat, lora_request)) as items:
                async for item in items:
                    if isinstance(item, ErrorResponse):
                        err = _renamed(item)
                        stored.body = response.body("failed", [], error={
                            "code": err.error.code or err.error.type, "message": err.error.message})
                    else:
                        stored.body = response.from_chat(item, self._plain_text())
                    return
        except asyncio.CancelledError:
            stored.body = {**stored.body, "status": "cancelled"}
            raise
        except Exception as e:  # noqa: BLE001 - the stored response says it failed
            stored.body = response.body("failed", [], error={"code": "server_error",
                                                              "message": f"{type(e).__name__}: {e}"})

    def retrieve(self, response_id: str) -> dict[str, Any] | ErrorResponse:
        """The stored Response (a background one as it stands now); 404 if this replica has none."""
        stored = self.store.get(response_id)
        return _not_found(response_id) if stored is None else stored.body

    async def cancel(self, response_id: str) -> dict[str, Any] | ErrorResponse:
        """Cancel a background response still queued or in progress: its generation is aborted
        and its status becomes cancelled. Raises nothing; a finished one is a 400 (vLLM's)."""
        stored = self.store.get(response_id)
        if stored is None:
            return _not_found(response_id)
        if stored.body["status"] not in ("queued", "in_progress") or stored.task is None:
            return ErrorResponse.make(400, "Cannot cancel a synchronous response.", param="response_id")
        stored.task.cancel()
        try:
            await stored.task
        except asyncio.CancelledError:
            pass
        stored.body = {**stored.body, "status": "cancelled"}
        return stored.body
