"""One replica that is both the OpenAI ingress and the model's LLMServer (no ingress hop).

With one model, the ingress' only job is to relay each stream chunk from the LLMServer
replica to Serve's HTTP proxy: one more process and one more Serve stream per token. Set
`ingress_config.colocate: true` and the builder deploys `ColocatedLLMServer` instead: the
same LLMServer (same deployment name, same handle methods), serving the same FastAPI app
(app.ingress.build_openai_api) itself, its router calling this replica's methods in process
through `LocalHandle`.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from fastapi import FastAPI
from ray import serve

from app.ingress import OpenAIRouter, build_openai_api
from app.llm_server import SERVER_DEFAULTS, LLMServerImpl

_closing: set[asyncio.Task] = set()  # generators being closed by LocalStream.cancel


class LocalStream:
    """An async generator of this process, shaped like a streaming DeploymentResponseGenerator."""

    def __init__(self, gen: Any):
        self._gen = gen

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> Any:
        return await self._gen.__anext__()

    def cancel(self) -> None:
        """Close the generator (it aborts its engine request), as cancelling a handle call does."""
        task = asyncio.get_running_loop().create_task(self._gen.aclose())
        _closing.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(_closing.discard)


class _LocalMethod:
    def __init__(self, fn: Any):
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """A stream for a generator method; else an awaitable of its result, whose errors
        (as with a handle) are raised when it is awaited, not here."""
        if inspect.isasyncgenfunction(self._fn):
            return LocalStream(self._fn(*args, **kwargs))
        return self._call(*args, **kwargs)

    async def _call(self, *args: Any, **kwargs: Any) -> Any:
        result = self._fn(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result


class LocalHandle:
    """What OpenAIRouter needs of a DeploymentHandle, answered by an object in this process."""

    def __init__(self, target: Any):
        self._target = target

    def options(self, **_: Any) -> LocalHandle:
        return self

    def __getattr__(self, method: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._target, method))


class _ColocatedLLMServer(LLMServerImpl):
    """LLMServer plus the OpenAI HTTP routes, served by this replica for its one model."""

    def __init__(self, llm_config: Any, api_key: str | None = None, lora: dict[str, Any] | None = None):
        super().__init__(llm_config)
        self.router = OpenAIRouter({self.model_id: LocalHandle(self)}, api_key, lora,
                                   {self.model_id: self.llm_config.stream_batching_s()})

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_openai_api(self.router)


ColocatedLLMServer = serve.deployment(name="LLMServer", **SERVER_DEFAULTS)(serve.ingress()(_ColocatedLLMServer))
