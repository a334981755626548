"""The streamed HTTP bodies of the ingress: server-sent events from an LLMServer's chunks.

A streamed answer's first chunk goes out as soon as it is there (its arrival is what the
ingress waits for before it answers, so the time to first token is untouched). The chunks
after it are sent in batches, as Ray Serve LLM does (`experimental_configs.
stream_batching_interval_ms`): what arrives within the interval after a chunk goes out as one
body write, so Serve carries one message per stream and interval instead of one a token (the
events and their order are unchanged: a client reads the same events). An interval of 0
sends each chunk as it comes.

If the client goes away, Starlette cancels the body's generator; cancelling the handle call
reaches LLMServer, whose engine generator is closed, which aborts the request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from ray.serve.exceptions import RequestCancelledError

from app.anthropic_reply import anthropic_sse
from app.ingress_errors import server_error


async def batches(gen: Any, interval: float) -> AsyncIterator[list[Any]]:
    """The items of `gen` in lists: each list what arrived within `interval` seconds of its
    first item (sooner if `gen` ends); `interval <= 0`: one item a list, as each comes.

    An error of `gen` is raised after the items that came before it. Closing this generator
    stops reading `gen` and returns once nothing reads it (the caller cancels `gen` itself).
    """
    if interval <= 0:
        async for item in gen:
            yield [item]
        return
    arrived: list[Any] = []
    wake = asyncio.Event()

    async def read() -> None:
        try:
            async for item in gen:
                arrived.append(item)
                wake.set()
        finally:
            wake.set()

    reader = asyncio.create_task(read())
    try:
        while True:
            await wake.wait()
            if not reader.done():  # the batch: what else comes within the interval
                await asyncio.wait({reader}, timeout=interval)
            wake.clear()
            items = arrived[:]
            arrived.clear()
            if items:
                yield items
            if reader.done() and not arrived:
                reader.result()  # gen's error, if it had one
                return
    finally:  # the reader ends before the caller cancels gen (a generator being read cannot be closed)
        reader.cancel()
        await asyncio.wait({reader})
        if not reader.cancelled():
            reader.exception()  # an error of gen after the reader was closed is nobody's to raise


async def sse_events(first: dict[str, Any], gen: Any, interval: float = 0.0) -> AsyncIterator[str]:
    """OpenAI's server-sent events: `data: {json}` per chunk, then `data: [DONE]`; a failure
    mid-stream is an error chunk in OpenAI's shape, then [DONE]."""
    finished = False
    try:
        yield f"data: {json.dumps(first)}\n\n"
        async with aclosing(batches(gen, interval)) as gathered:
            async for items in gathered:
                yield "".join(f"data: {json.dumps(item)}\n\n" for item in items)
        finished = True
    except RequestCancelledError:
        return
    except Exception as e:  # noqa: BLE001 - told to the client in OpenAI's shape
        yield f"data: {server_error(e).model_dump_json()}\n\n"
    finally:
        if not finished:
            gen.cancel()
    yield "data: [DONE]\n\n"


async def named_events(first: dict[str, Any], gen: Any, error_event: Callable[[Any, dict[str, Any]], dict[str, Any]],
                       interval: float = 0.0) -> AsyncIterator[str]:
    """Named server-sent events (`event: <type>` + `data: {json}`; no [DONE]), as Anthropic's
    Messages API and OpenAI's Responses API send them; a failure mid-stream is the event
    `error_event(error, last event sent)`."""
    finished, last = False, first
    try:
        yield anthropic_sse(first)
        async with aclosing(batches(gen, interval)) as gathered:
            async for items in gathered:
                last = items[-1]
                yield "".join(anthropic_sse(item) for item in items)
        finished = True
    except RequestCancelledError:
        return
    except Exception as e:  # noqa: BLE001 - told to the client as the API's error event
        yield anthropic_sse(error_event(server_error(e), last))
    finally:
        if not finished:
            gen.cancel()
