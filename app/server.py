"""LLMServer: the Serve deployment that owns one model's AsyncLLMEngine.

One deployment per model (the builder names it `LLMServer:<model_id>`). Python callers use
the typed methods through a handle:

    handle = serve.get_deployment_handle("LLMServer:servax-tiny--llama", app_name="servax")
    result = await handle.generate.remote("Once upon a time", {"max_tokens": 16, "temperature": 0})
    async for delta in handle.options(stream=True).stream.remote([{"role": "user", "content": "Hi"}]):
        print(delta.text, end="")

The ingress uses `completion` / `chat` (OpenAI bodies, see app.serving), `model_info`
and `stats`. Serve calls `check_health` periodically and replaces a replica whose
engine loop has died.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from typing import Any

from ray import serve

from app.config import LLMConfig
from app.metrics import ServerMetrics
from app.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ErrorResponse, TokenizeRequest
from app.serving import OpenAIServing

logger = logging.getLogger("ray.serve")

PromptOrMessages = str | list[int] | dict[str, Any] | list[dict[str, Any]]


@dataclass
class Generation:
    """One generated sequence of a `generate` call."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None


@dataclass
class GenerateResult:
    """What `LLMServer.generate` returns: the prompt's ids and `n` generations."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Generation]
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        """The first generation's text (the usual n=1 case)."""
        return self.outputs[0].text


@dataclass
class StreamDelta:
    """One increment of a `stream` call: new text/tokens of generation `index`."""

    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@serve.deployment(max_ongoing_requests=256, health_check_period_s=10, health_check_timeout_s=30)
class LLMServer:
    """A replica serving one model: engine start-up in `__init__`, then requests."""

    def __init__(self, llm_config: LLMConfig | dict[str, Any]):
        """Load the model, build and warm up the engine (the replica's startup; Serve waits for it).

        Raises:
            registry.errors.ModelLoadError / ValueError: the model or its settings are wrong.
        """
        from app.llm import load_model
        from runtime import AsyncLLMEngine

        self.llm_config = LLMConfig.model_validate(llm_config)
        self.model_id = self.llm_config.model_id
        engine_config = self.llm_config.engine_config()
        start = time.perf_counter()
        self.engine = AsyncLLMEngine(engine_config, load_model(engine_config))
        self.startup_s = time.perf_counter() - start
        self.metrics = ServerMetrics(self.model_id, enabled=self.llm_config.log_engine_metrics)
        self.serving = OpenAIServing(self.engine, self.model_id, self.metrics)
        logger.info("servax LLMServer ready: %s", self._startup_summary())

    def _startup_summary(self) -> str:
        mc = dict(self.engine.model_config)
        devices = mc.get("devices") or []
        device_text = f"{len(devices)}x{devices[0]}" if devices else "?"
        buckets = f"tokens={mc.get('token_buckets')} seqs={mc.get('seq_buckets')}"
        return (f"model={self.model_id} source={self.llm_config.model_loading_config.source} "
                f"impl={mc.get('impl')} dtype={mc.get('dtype')} max_model_len={mc.get('max_model_len')} "
                f"devices={device_text} mesh={mc.get('mesh')} kv_blocks={mc.get('kv_blocks')}x{mc.get('block_size')} "
                f"buckets[{buckets}] warmup={mc.get('warmup_seconds')}s startup={self.startup_s:.1f}s "
                f"metrics={'on' if self.metrics.enabled else 'off'}")

    # ---- Python handle API ---------------------------------------------------------------

    async def generate(self, prompt_or_messages: PromptOrMessages,
                       sampling: dict[str, Any] | Any | None = None) -> GenerateResult:
        """Generate to completion.

        Args:
            prompt_or_messages: prompt text, prompt token ids, a prompt dict ({"prompt": ...} or
                {"prompt_token_ids": [...]}), or chat messages ([{"role": ..., "content": ...}],
                rendered with the model's chat template).
            sampling: a runtime.SamplingParams, or a dict of its fields (vLLM's names:
                max_tokens, temperature, top_p, n, seed, stop, logprobs, ...; and
                structured_outputs={"json": schema} / {"regex": ...} / {"choice": [...]} /
                {"grammar": ...}, allowed_token_ids, bad_words).

        Returns:
            GenerateResult with `.text` (first generation) and `.outputs` (all n).

        Raises:
            runtime.errors.InvalidRequestError (and PromptTooLongError), EngineOverloadedError,
            EngineDeadError; through a handle these arrive wrapped in a RayTaskError that is
            also an instance of the original class.
        """
        request_id = f"gen-{uuid.uuid4().hex}"
        stream = await self.serving.submit(prompt_or_messages, sampling, request_id)
        out = None
        async with aclosing(stream):
            async for out in stream:
                pass
        return GenerateResult(
            request_id=request_id, prompt_token_ids=list(out.prompt_token_ids or []),
            outputs=[Generation(c.index, c.text, list(c.token_ids), c.finish_reason, c.cumulative_logprob)
                     for c in out.outputs],
            num_cached_tokens=getattr(out, "num_cached_tokens", 0) or 0,
        )

    async def stream(self, prompt_or_messages: PromptOrMessages,
                     sampling: dict[str, Any] | Any | None = None) -> AsyncIterator[StreamDelta]:
        """Generate, yielding StreamDelta increments; call via `handle.options(stream=True)`.

        Same arguments and errors as `generate`. Cancelling the handle call (or closing the
        generator) aborts the request in the engine.
        """
        request_id = f"gen-{uuid.uuid4().hex}"
        stream = await self.serving.submit(prompt_or_messages, sampling, request_id)
        async with aclosing(stream):
            async for out in stream:
                for c in out.outputs:
                    if c.delta_token_ids or c.delta_text or c.finish_reason is not None:
                        yield StreamDelta(c.index, c.delta_text or "", list(c.delta_token_ids or []),
                                          c.finish_reason)

    # ---- used by the OpenAI ingress ------------------------------------------------------

    async def completion(self, request: CompletionRequest) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """OpenAI /v1/completions bodies (see app.serving.OpenAIServing.completion)."""
        async with aclosing(self.serving.completion(request)) as items:
            async for item in items:
                yield item
        self._update_gauges()

    async def completions(self, request: CompletionRequest) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """Ray Serve LLM's name for `completion`."""
        async with aclosing(self.completion(request)) as items:
            async for item in items:
                yield item

    async def chat(self, request: ChatCompletionRequest) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """OpenAI /v1/chat/completions bodies (see app.serving.OpenAIServing.chat)."""
        async with aclosing(self.serving.chat(request)) as items:
            async for item in items:
                yield item
        self._update_gauges()

    def tokenize(self, request: TokenizeRequest) -> dict[str, Any] | ErrorResponse:
        """vLLM's /tokenize body (see app.serving.OpenAIServing.tokenize)."""
        return self.serving.tokenize(request)

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any] | ErrorResponse:
        """vLLM's /detokenize body."""
        return self.serving.detokenize(request)

    def metric_families(self) -> list[Any]:
        """This replica's Prometheus metric families (for the ingress' GET /metrics)."""
        self._update_gauges()
        return self.metrics.prom.families()

    def model_info(self) -> dict[str, Any]:
        """The model's card for /v1/models: id, source, impl, dtype, max_model_len, ..."""
        mc = dict(self.engine.model_config)
        return dict(id=self.model_id, root=self.llm_config.model_loading_config.source,
                    impl=mc.get("impl"), dtype=mc.get("dtype"), max_model_len=mc.get("max_model_len"),
                    tensor_parallel_size=self.llm_config.engine_config().tensor_parallel_size)

    def stats(self) -> dict[str, Any]:
        """The engine's current EngineStats as a dict (running/waiting, KV blocks, ...)."""
        s = self.engine.stats()
        return asdict(s) if hasattr(s, "__dataclass_fields__") else dict(vars(s))

    def _update_gauges(self) -> None:
        try:
            self.metrics.update_engine_gauges(self.engine.stats())
        except Exception:  # stats are advisory; never fail a request over them
            pass

    def check_health(self) -> None:
        """Raises EngineDeadError when the engine loop has died.

        Serve calls it every health_check_period_s (raising makes Serve replace the replica);
        the ingress calls it for GET /health.
        """
        self.engine.check_health()
        self._update_gauges()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                pass
