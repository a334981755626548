"""LLMServer: the Serve deployment that owns one model's AsyncLLMEngine.

One deployment per model (the builder names it `LLMServer:<model_id>`). Python callers use
the typed methods through a handle:

    handle = serve.get_deployment_handle("LLMServer:servax-tiny--llama", app_name="servax")
    result = await handle.generate.remote("Once upon a time", {"max_tokens": 16, "temperature": 0})
    async for delta in handle.options(stream=True).stream.remote([{"role": "user", "content": "Hi"}]):
        print(delta.text, end="")

The ingress uses `completion` / `chat` (OpenAI bodies, see app.openai_api), `messages` /
`count_tokens` (Anthropic's, see app.anthropic_api), `responses` / `retrieve_response` /
`cancel_response` (OpenAI's Responses API, see app.responses_api), `model_info`
and `stats` (the stats Serve, its routers and the ingress read are in app.replica_stats).
Every generating method, handle or OpenAI, runs through the replica's one
Relay (app.relay). Serve calls `check_health` periodically and replaces a replica whose
engine loop has died.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from app.anthropic_api import AnthropicServing
from app.anthropic_request import CountTokensRequest, MessagesRequest
from app.llm_config import LLMConfig
from app.metrics import ServerMetrics
from app.openai_api import OpenAIServing
from app.openai_requests import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from app.openai_responses import ErrorResponse, error_response
from app.pooling_api import EmbeddingRequest, PoolingServing, RerankRequest, ScoreRequest
from app.relay import GenerationRequest, Relay
from app.replica_stats import ReplicaStats
from app.responses_api import ResponsesServing
from app.responses_request import ResponsesRequest
from runtime.engine.errors import InvalidRequestError
from runtime.engine.lora_request import LoRARequest, stable_lora_id

logger = logging.getLogger("ray.serve")
_EXIT_GRACE_S = 0.25  # between an engine's death and its replica's exit (the failed streams flush)

PromptOrMessages = str | list[int] | dict[str, Any] | list[dict[str, Any]]


def _servax_logs_beside_serves() -> None:
    """In a replica's own process (a Ray actor), the "servax" loggers (engine, registry,
    runtime) write where Serve's own do (the replica's log file and the driver's console), at
    INFO: Ray configures only "ray.serve" there, and the root logger would drop INFO lines. A
    replica in the caller's process (local testing mode) leaves that process's logging as it is."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return
    serve_logger, ours = logging.getLogger("ray.serve"), logging.getLogger("servax")
    if serve_logger.handlers and not ours.handlers:
        for handler in serve_logger.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


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


class LLMServerImpl(ReplicaStats):
    """A replica serving one model: engine start-up in `__init__`, then requests (the class
    behind the `LLMServer` deployment, and the base of app.colocated's ingress replica)."""

    def __init__(self, llm_config: LLMConfig | dict[str, Any]):
        """Load the model, build and warm up the engine (the replica's startup; Serve waits for it).

        Raises:
            registry.errors.ModelLoadError / ValueError: the model or its settings are wrong.
        """
        # Here, not at the top: the builder imports this module to bind the deployment, in a
        # process that runs no engine, and these bring JAX.
        from app.llm import load_model
        from runtime.engine.async_engine import AsyncLLMEngine

        _servax_logs_beside_serves()
        self.llm_config = LLMConfig.model_validate(llm_config)
        self.model_id = self.llm_config.model_id
        engine_config = self.llm_config.engine_config()
        start = time.perf_counter()
        self.engine = AsyncLLMEngine(engine_config, load_model(engine_config))
        self.engine.on_death = self._exit_replica
        self.startup_s = time.perf_counter() - start
        self.metrics = ServerMetrics(self.model_id, enabled=self.llm_config.log_engine_metrics)
        self.relay = Relay(self.engine, self.model_id, self.metrics)
        self.serving = OpenAIServing(self.engine, self.model_id, self.relay, self.llm_config.serving_config())
        self.anthropic = AnthropicServing(self.serving)
        self.pooling = PoolingServing(self.engine, self.model_id)
        self.responses_api = ResponsesServing(self.serving)
        self._load_multiplexed = None
        self._kv_cursor, self._kv_hashes = -1, set()  # the engine's cached block hashes (record_routing_stats)
        lora_config = self.llm_config.lora_config
        if lora_config is not None and lora_config.dynamic_lora_loading_path:
            # Ray Serve LLM's model multiplexing: Serve keeps max_num_adapters_per_replica
            # adapters per replica (LRU) and routes "<model_id>:<adapter>" to a replica that has it.
            async def read_adapter(model_id: str) -> _ResidentAdapter:  # a function: Serve tags it
                return await self._read_adapter(model_id)

            self._load_multiplexed = serve.multiplexed(
                max_num_models_per_replica=lora_config.max_num_adapters_per_replica)(read_adapter)
        for module in self.llm_config.lora_modules:  # read (and validated) at startup
            self.engine.add_lora(LoRARequest(module.name, stable_lora_id(module.name, module.path),
                                                    module.path, self.model_id))
        logger.info("servax LLMServer ready: %s", self._startup_summary())

    # ---- LoRA adapters -------------------------------------------------------------------

    async def _read_adapter(self, multiplexed_model_id: str) -> "_ResidentAdapter":
        """Serve's multiplexed loader: "<model_id>:<adapter>" -> the adapter, read into the engine."""
        adapter = multiplexed_model_id.partition(":")[2]
        path = self.llm_config.lora_config.adapter_path(adapter)
        if not os.path.isdir(path):
            raise _AdapterNotFound(f"The model `{multiplexed_model_id}` does not exist: no adapter folder {path}")
        lora = LoRARequest(multiplexed_model_id, stable_lora_id(multiplexed_model_id, path), path, self.model_id)
        await asyncio.get_running_loop().run_in_executor(None, self.engine.add_lora, lora)
        return _ResidentAdapter(lora, self.engine)

    async def _lora_for(self, lora: dict[str, Any] | LoRARequest | None) -> LoRARequest | None:
        if isinstance(lora, dict):
            return LoRARequest(**lora)
        if lora is not None:
            return lora
        multiplexed = serve.get_multiplexed_model_id()
        if multiplexed and self._load_multiplexed is not None:
            return (await self._load_multiplexed(multiplexed)).lora
        return None

    async def load_lora_adapter(self, lora: dict[str, Any]) -> None | ErrorResponse:
        """Read and validate an adapter into this replica's engine (POST /v1/load_lora_adapter)."""
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, self.engine.add_lora, LoRARequest(**lora))
        except Exception as e:  # noqa: BLE001 - answered in OpenAI's shape
            err = error_response(e, "lora_path")
            if err is None:
                raise
            return err
        return None

    def unload_lora_adapter(self, lora_int_id: int) -> bool:
        """Drop an adapter from this replica's engine (False if it was not here)."""
        try:
            return self.engine.remove_lora(lora_int_id)
        except InvalidRequestError:
            return False  # still serving requests: it leaves the slots when they finish and it is evicted

    def _startup_summary(self) -> str:
        mc = dict(self.engine.model_config)
        devices = mc.get("devices") or []
        device_text = f"{len(devices)}x{devices[0]}" if devices else "?"
        buckets = f"tokens={mc.get('token_buckets')} seqs={mc.get('seq_buckets')}"
        return (f"model={self.model_id} source={self.llm_config.model_loading_config.source} "
                f"impl={mc.get('impl')} dtype={mc.get('dtype')} max_model_len={mc.get('max_model_len')} "
                f"devices={device_text} mesh={mc.get('mesh')} kv_blocks={mc.get('kv_blocks')}x{mc.get('block_size')} "
                f"attention={mc.get('attention_backend')} "
                f"buckets[{buckets}] warmup={mc.get('warmup_seconds')}s startup={self.startup_s:.1f}s "
                f"metrics={'on' if self.metrics.enabled else 'off'}")

    # ---- Python handle API ---------------------------------------------------------------

    async def generate(self, prompt_or_messages: PromptOrMessages,
                       sampling: dict[str, Any] | Any | None = None,
                       lora_request: LoRARequest | None = None) -> GenerateResult:
        """Generate to completion.

        Args:
            prompt_or_messages: prompt text, prompt token ids, a prompt dict ({"prompt": ...} or
                {"prompt_token_ids": [...]}), or chat messages ([{"role": ..., "content": ...}],
                rendered with the model's chat template).
            sampling: a runtime.SamplingParams, or a dict of its fields (vLLM's names:
                max_tokens, temperature, top_p, n, seed, stop, logprobs, ...; and
                structured_outputs={"json": schema} / {"regex": ...} / {"choice": [...]} /
                {"grammar": ...}, allowed_token_ids, bad_words).
            lora_request: a runtime.LoRARequest to generate with (the model needs enable_lora),
                or None; with Serve multiplexing, handle.options(multiplexed_model_id=
                "<model_id>:<adapter>") picks the adapter instead.

        Returns:
            GenerateResult with `.text` (first generation) and `.outputs` (all n).

        Raises:
            runtime.engine.errors.InvalidRequestError (and PromptTooLongError), EngineOverloadedError,
            EngineDeadError; through a handle these arrive wrapped in a RayTaskError that is
            also an instance of the original class.
        """
        request_id = f"gen-{uuid.uuid4().hex}"
        outputs = await self.relay.start(GenerationRequest(request_id, [prompt_or_messages], sampling,
                                                           await self._lora_for(lora_request)))
        out = None
        async with aclosing(outputs):
            async for _, out in outputs:
                pass
        return GenerateResult(
            request_id=request_id, prompt_token_ids=list(out.prompt_token_ids or []),
            outputs=[Generation(c.index, c.text, list(c.token_ids), c.finish_reason, c.cumulative_logprob)
                     for c in out.outputs],
            num_cached_tokens=getattr(out, "num_cached_tokens", 0) or 0,
        )

    async def stream(self, prompt_or_messages: PromptOrMessages,
                     sampling: dict[str, Any] | Any | None = None,
                     lora_request: LoRARequest | None = None) -> AsyncIterator[StreamDelta]:
        """Generate, yielding StreamDelta increments; call via `handle.options(stream=True)`.

        Same arguments and errors as `generate`. Cancelling the handle call (or closing the
        generator) aborts the request in the engine.
        """
        request_id = f"gen-{uuid.uuid4().hex}"
        outputs = await self.relay.start(GenerationRequest(request_id, [prompt_or_messages], sampling,
                                                           await self._lora_for(lora_request)))
        async with aclosing(outputs):
            async for _, out in outputs:
                for c in out.outputs:
                    if c.delta_token_ids or c.delta_text or c.finish_reason is not None:
                        yield StreamDelta(c.index, c.delta_text or "", list(c.delta_token_ids or []),
                                          c.finish_reason)

    # ---- used by the OpenAI ingress ------------------------------------------------------

    async def completion(self, request: CompletionRequest, lora: dict[str, Any] | None = None,
                         sent_at: float | None = None
                         ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """OpenAI /v1/completions bodies (see app.openai_api.OpenAIServing.completion); `lora`: the
        adapter the ingress resolved from `model` (or the multiplexed model id's)."""
        async with aclosing(self._serve(self.serving.completion, request, lora, sent_at)) as items:
            async for item in items:
                yield item

    async def completions(self, request: CompletionRequest, lora: dict[str, Any] | None = None
                          ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """Ray Serve LLM's name for `completion`."""
        async with aclosing(self.completion(request, lora)) as items:
            async for item in items:
                yield item

    async def chat(self, request: ChatCompletionRequest, lora: dict[str, Any] | None = None,
                   sent_at: float | None = None
                   ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """OpenAI /v1/chat/completions bodies (see app.openai_api.OpenAIServing.chat)."""
        async with aclosing(self._serve(self.serving.chat, request, lora, sent_at)) as items:
            async for item in items:
                yield item

    async def _serve(self, route: Any, request: Any, lora: dict[str, Any] | None, sent_at: float | None = None
                     ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """One OpenAI route's bodies under the request's adapter (an adapter that cannot be
        read is the answer's error), then the gauges refreshed. `sent_at`: when the ingress
        handed the request to its handle (time.time()), for request_routing_time_seconds."""
        if sent_at is not None:
            self.metrics.observe_routing(time.time() - sent_at)
        try:
            lora_request = await self._lora_for(lora)
        except Exception as e:  # noqa: BLE001
            yield _lora_error(e)
            return
        async with aclosing(route(request, lora_request)) as items:
            async for item in items:
                yield item
        self._update_gauges()

    async def messages(self, request: MessagesRequest, lora: dict[str, Any] | None = None,
                       sent_at: float | None = None
                       ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """Anthropic /v1/messages bodies: the message, or with stream each event (see
        app.anthropic_api.AnthropicServing.messages)."""
        async with aclosing(self._serve(self.anthropic.messages, request, lora, sent_at)) as items:
            async for item in items:
                yield item

    async def responses(self, request: ResponsesRequest, lora: dict[str, Any] | None = None,
                        sent_at: float | None = None
                        ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """OpenAI /v1/responses bodies: the Response, or with stream each event (see
        app.responses_api.ResponsesServing.create); stored in this replica unless store is false."""
        async with aclosing(self._serve(self.responses_api.create, request, lora, sent_at)) as items:
            async for item in items:
                yield item

    def retrieve_response(self, response_id: str) -> dict[str, Any] | ErrorResponse:
        """GET /v1/responses/{id}: a Response this replica stored (404 if it has none)."""
        return self.responses_api.retrieve(response_id)

    async def cancel_response(self, response_id: str) -> dict[str, Any] | ErrorResponse:
        """POST /v1/responses/{id}/cancel: abort a background Response of this replica."""
        return await self.responses_api.cancel(response_id)

    def count_tokens(self, request: CountTokensRequest) -> dict[str, Any] | ErrorResponse:
        """Anthropic /v1/messages/count_tokens body: {input_tokens}."""
        return self.anthropic.count_tokens(request)

    async def embeddings(self, request: EmbeddingRequest) -> dict[str, Any] | ErrorResponse:
        """OpenAI /v1/embeddings body (a pooling engine: runner="pooling"; app.pooling_api)."""
        return await self.pooling.embeddings(request)

    async def score(self, request: ScoreRequest) -> dict[str, Any] | ErrorResponse:
        """vLLM's /v1/score body: a score per (query, document) pair."""
        return await self.pooling.score(request)

    async def rerank(self, request: RerankRequest) -> dict[str, Any] | ErrorResponse:
        """/rerank body (Cohere / Jina shape): documents ordered by relevance to the query."""
        return await self.pooling.rerank(request)

    def tokenize(self, request: TokenizeRequest) -> dict[str, Any] | ErrorResponse:
        """vLLM's /tokenize body (see app.openai_api.OpenAIServing.tokenize)."""
        return self.serving.tokenize(request)

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any] | ErrorResponse:
        """vLLM's /detokenize body."""
        return self.serving.detokenize(request)

    def tokenizer_info(self) -> dict[str, Any] | ErrorResponse:
        """vLLM's /tokenizer_info body (enable_tokenizer_info_endpoint)."""
        return self.serving.tokenizer_info()

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The adapters this replica's engine has read (name, id, path) and its slot counters."""
        return [dict(lora_name=r.lora_name, lora_int_id=r.lora_int_id, lora_path=r.lora_path)
                for r in self.engine.list_loras()]

    def model_info(self) -> dict[str, Any]:
        """The model's card for /v1/models: id, source, impl, dtype, max_model_len, ..."""
        mc = dict(self.engine.model_config)
        return dict(id=self.model_id, root=self.llm_config.model_loading_config.source,
                    impl=mc.get("impl"), dtype=mc.get("dtype"), max_model_len=mc.get("max_model_len"),
                    tensor_parallel_size=self.llm_config.engine_config().tensor_parallel_size)

    @staticmethod
    def _exit_replica(error: BaseException) -> None:
        """The engine loop died (its streams have their 503s): end this replica's process, as
        vLLM's API server exits when its engine dies, so that Serve's routers stop sending it
        requests at once and Serve starts a new replica, instead of routing to it (a replica that
        answers 503 at once looks idle) until a health check fails. VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1
        keeps it up, answering 503 until Serve's health check replaces it. Not in local testing
        mode (no actor: the process is the caller's)."""
        import threading

        import ray

        if os.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "0").lower() in ("1", "true"):
            return
        if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
            return
        logger.error("servax: the engine died (%r); this replica exits in %.1f s so that Serve replaces it "
                     "(VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps it answering 503 instead)", error, _EXIT_GRACE_S)
        threading.Timer(_EXIT_GRACE_S, os._exit, args=(1,)).start()  # the failed streams' 503s go out first

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


# Serve's deployment of LLMServerImpl (the builder names each `LLMServer:<model_id>`).
SERVER_DEFAULTS = dict(max_ongoing_requests=256, health_check_period_s=10, health_check_timeout_s=30)
LLMServer = serve.deployment(name="LLMServer", **SERVER_DEFAULTS)(LLMServerImpl)


class _ResidentAdapter:
    """What Serve's multiplexing holds per loaded adapter; evicting it drops the adapter from
    the engine (unless requests still use it: then the engine's own LRU drops it later)."""

    def __init__(self, lora: LoRARequest, engine: Any):
        self.lora = lora
        self._engine = engine

    def __del__(self) -> None:
        try:
            self._engine.remove_lora(self.lora.lora_int_id)
        except Exception:  # noqa: BLE001 - in use, or the engine is gone
            pass


class _AdapterNotFound(LookupError):
    """A "<model_id>:<adapter>" whose adapter is not under lora_config.dynamic_lora_loading_path."""


def _lora_error(exc: BaseException) -> ErrorResponse:
    if isinstance(exc, _AdapterNotFound):
        return ErrorResponse.make(404, str(exc), param="model", code="model_not_found")
    err = error_response(exc, "model")
    if err is None:
        return ErrorResponse.make(400, f"cannot load the LoRA adapter: {exc}", param="model")
    return err
