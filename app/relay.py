"""The relay: one path from every door of a replica to its engine and back.

The OpenAI routes (completions, chat) and the Python handle methods (generate, stream) all
describe what to run as one `GenerationRequest` (prompts in any form the engine's
InputProcessor accepts, chat included, and sampling settings it completes) and read what
comes back from `Relay.start`: (prompt index, RequestOutput) pairs, each door turning them
into its own wire format. The relay starts the engine requests, interleaves their outputs,
aborts them when the reader goes away, and records each request's metrics once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from app.metrics import ServerMetrics

logger = logging.getLogger("ray.serve")


@dataclasses.dataclass
class GenerationRequest:
    """What to generate, as every door hands it to the relay.

    Attributes:
        request_id: the id of the whole request; prompt i of several runs as `<id>-<i>`.
        prompts: one engine request each: text, token ids, a prompt dict, chat messages or a
            runtime.engine.input_processor.ChatPrompt.
        sampling: a SamplingParams, a dict of its fields (the InputProcessor fills the unset
            ones, max_tokens included), or None.
        lora_request: the LoRA adapter to generate with, or None.
    """

    request_id: str
    prompts: Sequence[Any]
    sampling: Any = None
    lora_request: Any = None


class Relay:
    """Starts GenerationRequests on one engine and streams their outputs back.

    Args:
        engine: the replica's AsyncLLMEngine.
        model_id: the model's name, for the debug log.
        metrics: where each finished request is recorded.
    """

    def __init__(self, engine: Any, model_id: str, metrics: ServerMetrics):
        self.engine, self.model_id, self.metrics = engine, model_id, metrics

    async def start(self, request: GenerationRequest) -> AsyncIterator[tuple[int, Any]]:
        """Start one engine request per prompt (all at once) and wait for each one's first
        output, so that a refusal raises here, before the caller answers anything.

        Returns:
            An async generator of (prompt index, RequestOutput) as they come; closing it
            aborts the requests that have not finished.

        Raises:
            What the engine raises for a refused request (InvalidRequestError,
            PromptTooLongError, EngineOverloadedError, EngineDeadError); the other prompts'
            requests are aborted first.
        """
        prompts, rid = list(request.prompts), request.request_id
        if len(prompts) == 1:
            return _merge([await self._submit(prompts[0], request, rid)])
        results = await asyncio.gather(*(self._submit(p, request, f"{rid}-{i}") for i, p in enumerate(prompts)),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in results:
                if isinstance(r, RequestStream):
                    await r.aclose()
            raise errors[0]
        return _merge(results)

    async def _submit(self, prompt: Any, request: GenerationRequest, request_id: str) -> RequestStream:
        gen = self.engine.generate(prompt, request.sampling, request_id, lora_request=request.lora_request)
        submitted = time.time()
        start = time.perf_counter()
        try:
            first = await gen.__anext__()
        except BaseException:
            await gen.aclose()
            raise
        return RequestStream(gen, first, start, request_id, self, submitted)

    def _request_done(self, stream: RequestStream) -> None:
        out = stream.last
        e2e = time.perf_counter() - stream.start
        n_gen = sum(len(c.token_ids) for c in out.outputs)
        reasons = {c.finish_reason for c in out.outputs}
        reason = reasons.pop() if len(reasons) == 1 else "mixed"
        reason = reason if out.finished else "abort"
        self.metrics.observe_request(ttft_s=stream.ttft, e2e_s=e2e, prompt_tokens=len(out.prompt_token_ids or ()),
                                     generation_tokens=n_gen, finish_reason=reason, phases=_phases(stream, out, e2e))
        logger.debug("servax request %s model=%s prompt_tokens=%d generated=%d cached=%s finish=%s "
                     "ttft=%.3fs e2e=%.3fs", stream.request_id, self.model_id, len(out.prompt_token_ids or ()),
                     n_gen, getattr(out, "num_cached_tokens", None), reason, stream.ttft or -1.0, e2e)


def _phases(stream: RequestStream, out: Any, e2e_s: float) -> dict[str, float]:
    """Seconds of each phase the request went through: frontend (submitted -> the engine took
    it), queue (-> first scheduled), prefill (-> first token), decode (-> finished)."""
    arrival, scheduled = getattr(out, "arrival_time", None), getattr(out, "first_scheduled_time", None)
    if arrival is None or stream.submitted is None:
        return {}
    phases = {"frontend": arrival - stream.submitted}
    if scheduled is None:
        return phases
    phases["queue"] = scheduled - arrival
    if stream.ttft is not None:
        first_token = stream.submitted + stream.ttft
        phases["prefill"] = first_token - scheduled
        phases["decode"] = stream.submitted + e2e_s - first_token
    return phases


class RequestStream:
    """The RequestOutput snapshots of one engine request (an async iterator).

    `ttft` is the request's time to first token as the replica sees it (from submission to
    the first snapshot with a token), the one the metrics record. `aclose()` closes the
    engine's generator, which aborts the request if it is still running; the request's
    metrics and debug log line are recorded then, once.
    """

    def __init__(self, gen: AsyncIterator[Any], first: Any, start: float, request_id: str, relay: Relay,
                 submitted: float | None = None):
        self._gen, self._pending, self._relay = gen, first, relay
        self.start, self.request_id = start, request_id
        self.last, self.ttft, self._closed = first, None, False
        self.submitted = submitted  # time.time() when the relay handed it to the engine

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
            self._relay._request_done(self)


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

