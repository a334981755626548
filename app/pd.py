"""Prefill/decode disaggregation on Ray Serve (#44): Ray Serve LLM's P/D app, on servax engines.

    applications:
    - name: servax-pd
      route_prefix: /
      import_path: app.pd:build_pd_openai_app     # also app.builder:build_pd_openai_app
      args:
        prefill_config:                           # an LLMConfig: its own replicas and engine settings
          model_loading_config: {model_id: tiny, model_source: servax-tiny/llama}
          engine_kwargs: {max_model_len: 1024, max_num_batched_tokens: 512}
          deployment_config: {num_replicas: 1}
        decode_config:
          model_loading_config: {model_id: tiny, model_source: servax-tiny/llama}
          engine_kwargs: {max_model_len: 1024, max_num_seqs: 64}
          deployment_config: {num_replicas: 2}

Three tiers, as Ray Serve LLM's `build_pd_openai_app`: OpenAIIngress -> `Decode:<model>` (the
model the ingress sees) -> `Prefill:<model>`. For a completion or chat request the decode
replica asks a prefill replica to run the same OpenAI route with max_tokens=1 and to export
the prompt's KV blocks (runtime/engine/kv_transfer.py); the prefill replica `ray.put`s them
(numpy arrays) and returns the ObjectRef, which the decode replica reads straight from the
object store (the blocks never pass through the ingress), imports into its own paged cache and
streams the rest. The prefill replica's prefix cache keeps the blocks after the export, so a
repeated prefix skips recomputation there. On TPU / GPU the move would be device to device
(jax.experimental.transfer between replicas' devices) rather than through host memory.

What is not moved runs whole on the decode replica, as a colocated replica would run it:
several prompts in one body, n > 1, prompt logprobs, LoRA adapters, the other routes
(messages, responses, embeddings); and any request whose prefill fails or whose first token
already ends it. A decode replica that dies ends its streams with a 503 (the ingress' answer to
a dead replica), and a retry reaches another replica.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import Field, ValidationError, model_validator
from ray import serve

from app.config import IngressConfig
from app.ingress import OpenAIIngress
from app.llm_config import LLMConfig, StrictBlock, describe_errors, sanitize_name
from app.llm_server import SERVER_DEFAULTS, LLMServerImpl
from app.openai_requests import ChatCompletionRequest, CompletionRequest
from app.openai_responses import ErrorResponse

logger = logging.getLogger("ray.serve")

# The P/D step of the request this task serves (a _Prefill or a _Decode), read by _PDEngine when
# the route's relay starts the engine request; None: an ordinary request.
_PD_STEP: contextvars.ContextVar[Any] = contextvars.ContextVar("servax_pd_step", default=None)


class PDServingArgs(StrictBlock):
    """The args of a P/D app (Ray Serve LLM's PDServingArgs)."""

    prefill_config: LLMConfig
    decode_config: LLMConfig
    ingress_config: IngressConfig = Field(default_factory=IngressConfig)
    ingress_deployment_config: dict[str, Any] | None = Field(
        None, description="Ray Serve LLM's name for the ingress' Serve options; merged into ingress_config.")

    @model_validator(mode="after")
    def _one_model(self) -> PDServingArgs:
        p, d = self.prefill_config, self.decode_config
        if p.model_id != d.model_id:
            raise ValueError(f"prefill_config and decode_config serve one model: model_id {p.model_id!r} != "
                             f"{d.model_id!r}")
        if p.model_loading_config.source != d.model_loading_config.source:
            raise ValueError("prefill_config and decode_config must load the same model_source")
        for name, block in (("prefill_config", p), ("decode_config", d)):
            if block.lora_config is not None or block.lora_modules:
                raise ValueError(f"{name}: LoRA adapters are not supported with prefill/decode disaggregation")
        pe, de = p.engine_config(), d.engine_config()
        for key in ("block_size", "dtype", "kv_cache_dtype", "tensor_parallel_size"):
            if getattr(pe, key, None) != getattr(de, key, None):
                raise ValueError(f"engine_kwargs.{key} must be equal on both sides (the KV blocks move as they "
                                 f"are): prefill {getattr(pe, key, None)!r}, decode {getattr(de, key, None)!r}")
        if self.ingress_deployment_config:
            self.ingress_config = IngressConfig.model_validate(
                {**self.ingress_config.model_dump(exclude_unset=True), **self.ingress_deployment_config})
        if self.ingress_config.colocate:
            raise ValueError("ingress_config.colocate does not apply to a P/D app")
        return self


# ---- the engine seam --------------------------------------------------------------------

class _PDEngine:
    """The replica's AsyncLLMEngine as its Relay sees it: `generate` runs the request's P/D
    step when the serving task set one (_PD_STEP), else the plain request."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt: Any, sampling: Any, request_id: str, lora_request: Any = None) -> AsyncIterator[Any]:
        step = _PD_STEP.get()
        _PD_STEP.set(None)  # one engine request per step
        if step is None:
            return self._engine.generate(prompt, sampling, request_id, lora_request=lora_request)
        return step.run(self._engine, prompt, sampling, request_id)


class _Prefill:
    """Run the prompt and the first token, export the KV (what a prefill replica does)."""

    def __init__(self) -> None:
        self.transfer = None
        self.finish_reason: str | None = None
        self.max_tokens: int | None = None  # what the request asked for

    async def run(self, engine: Any, prompt: Any, sampling: Any, request_id: str) -> AsyncIterator[Any]:
        from runtime.engine.kv_transfer import ExportKV

        if isinstance(sampling, dict) or sampling is None:
            sampling = dict(sampling or {})
            self.max_tokens = sampling.get("max_tokens")
            sampling["max_tokens"] = 1
            if sampling.get("min_tokens"):
                sampling["min_tokens"] = 1  # keeps EOS suppressed for the first token, as the request has it
        else:  # a SamplingParams
            self.max_tokens = sampling.max_tokens
            sampling = dataclasses.replace(sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1))
        try:
            async for out in engine.generate(prompt, sampling, request_id, kv_transfer=ExportKV()):
                if out.finished:
                    completion = out.outputs[0]
                    self.finish_reason = completion.finish_reason
                    self.transfer = await asyncio.get_running_loop().run_in_executor(None, engine.take_kv, request_id)
                    if self.transfer is not None and completion.logprobs:
                        self.transfer.first_logprobs = completion.logprobs[0]
                yield out
        finally:
            engine.engine.kv_transfer.discard(request_id)  # exported but never taken (the reader went away)

    @property
    def continues(self) -> bool:
        """Whether the request goes on after its first token (it stopped only at max_tokens=1)."""
        return self.transfer is not None and self.finish_reason == "length" and self.max_tokens != 1


class _Decode:
    """Start the request from a transfer's KV (what a decode replica does)."""

    def __init__(self, transfer: Any):
        self.transfer = transfer

    def run(self, engine: Any, prompt: Any, sampling: Any, request_id: str) -> AsyncIterator[Any]:
        return engine.generate(prompt, sampling, request_id, kv_transfer=self.transfer)


def movable(request: Any) -> bool:
    """Whether a completion / chat body runs as prefill + decode: one prompt, one sequence, no
    prompt logprobs (the other bodies run whole on the decode replica)."""
    if getattr(request, "n", 1) != 1 or getattr(request, "best_of", None) not in (None, 1):
        return False
    if getattr(request, "prompt_logprobs", None) is not None:
        return False
    if isinstance(request, CompletionRequest):
        return len(request.prompts()) == 1 and not (request.echo and request.logprobs is not None)
    return isinstance(request, ChatCompletionRequest)


# ---- the two deployments ------------------------------------------------------------------

class PDPrefillServerImpl(LLMServerImpl):
    """An LLMServer whose `prefill` runs a body's prompt and first token and hands the KV on."""

    def __init__(self, llm_config: LLMConfig | dict[str, Any]):
        super().__init__(llm_config)
        self.engine.enable_kv_transfer()
        self.relay.engine = _PDEngine(self.engine)

    async def prefill(self, kind: str, request: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
        """Run `request` ("completion" or "chat") to its first token and export its blocks.

        Returns:
            {"kv": [ObjectRef of a runtime.engine.kv_transfer.KVTransfer], "nbytes": ...} when
            the request continues on a decode replica; {"kv": None, "why": ...} when it does not
            (the first token ended it, or the body was refused: the decode replica then answers
            it whole, with the same result or the same error)."""
        import ray

        step = _Prefill()
        route = self.serving.completion if kind == "completion" else self.serving.chat
        _PD_STEP.set(step)
        try:
            async with aclosing(route(request, None)) as items:
                async for item in items:
                    if isinstance(item, ErrorResponse):
                        return {"kv": None, "why": "refused"}
        finally:
            _PD_STEP.set(None)
        if not step.continues:
            return {"kv": None, "why": f"finished after one token ({step.finish_reason})"}
        ref = await asyncio.get_running_loop().run_in_executor(None, ray.put, step.transfer)
        return {"kv": [ref], "nbytes": step.transfer.nbytes}

    def pd_stats(self) -> dict[str, Any]:
        """The engine's stats plus its KV transfer counters and this replica's id (tests, benchmarks)."""
        return _pd_stats(self)


class PDDecodeServerImpl(LLMServerImpl):
    """An LLMServer whose completion / chat start from a prefill replica's KV.

    Args:
        llm_config: the decode side's model block.
        prefill_server: the handle of the `Prefill:<model>` deployment.
    """

    def __init__(self, llm_config: LLMConfig | dict[str, Any], prefill_server: Any):
        super().__init__(llm_config)
        self.engine.enable_kv_transfer()
        self.relay.engine = _PDEngine(self.engine)
        self.prefill_server = prefill_server

    async def completion(self, request: CompletionRequest, lora: dict[str, Any] | None = None, **serve_kwargs: Any
                         ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """LLMServer.completion, its prompt prefilled on a prefill replica (`serve_kwargs`: what the
        ingress passes on to LLMServer's routes)."""
        async with aclosing(self._disaggregated(self.serving.completion, "completion", request, lora,
                                                serve_kwargs)) as items:
            async for item in items:
                yield item

    async def chat(self, request: ChatCompletionRequest, lora: dict[str, Any] | None = None, **serve_kwargs: Any
                   ) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        """LLMServer.chat, its prompt prefilled on a prefill replica."""
        async with aclosing(self._disaggregated(self.serving.chat, "chat", request, lora, serve_kwargs)) as items:
            async for item in items:
                yield item

    async def _disaggregated(self, route: Any, kind: str, request: Any, lora: dict[str, Any] | None,
                             serve_kwargs: dict[str, Any]) -> AsyncIterator[dict[str, Any] | ErrorResponse]:
        step = await self._prefill(kind, request) if lora is None and movable(request) else None
        _PD_STEP.set(step)
        try:
            async with aclosing(self._serve(route, request, lora, **serve_kwargs)) as items:
                async for item in items:
                    yield item
        finally:
            _PD_STEP.set(None)

    async def _prefill(self, kind: str, request: Any) -> _Decode | None:
        """The prefill replica's transfer for `request`, or None to compute it here."""
        try:
            answer = await self.prefill_server.prefill.remote(kind, request)
            if answer["kv"] is None:
                return None
            return _Decode(await answer["kv"][0])
        except Exception as e:  # noqa: BLE001 - a prefill replica that fails costs time, not the request
            logger.warning("servax P/D: prefill failed (%r); decoding %s from scratch", e, kind)
            return None

    def pd_stats(self) -> dict[str, Any]:
        """The engine's stats plus its KV transfer counters and this replica's id (tests, benchmarks)."""
        return _pd_stats(self)


def _pd_stats(server: LLMServerImpl) -> dict[str, Any]:
    s = dataclasses.asdict(server.engine.stats())
    s["replica"] = serve.get_replica_context().replica_id.unique_id  # which replica answered (several per side)
    mover = server.engine.engine.kv_transfer
    s.update(kv_requests_exported=mover.num_exported, kv_blocks_exported=mover.blocks_exported,
             kv_requests_imported=mover.num_imported, kv_blocks_imported=mover.blocks_imported,
             kv_exports_pending=mover.num_pending_exports)
    return s


PDPrefillServer = serve.deployment(name="PDPrefillServer", **SERVER_DEFAULTS)(PDPrefillServerImpl)
PDDecodeServer = serve.deployment(name="PDDecodeServer", **SERVER_DEFAULTS)(PDDecodeServerImpl)


def load_pd_args(args: dict[str, Any] | PDServingArgs) -> PDServingArgs:
    """Validate a P/D app's args. Raises ValueError naming every wrong field."""
    if isinstance(args, PDServingArgs):
        return args
    try:
        return PDServingArgs.model_validate(dict(args))
    except ValidationError as e:
        raise ValueError("invalid servax P/D config:\n" + describe_errors(e, prefix="args")) from None


def build_pd_openai_app(args: dict[str, Any] | PDServingArgs) -> serve.Application:
    """The P/D application: OpenAIIngress -> Decode:<model> -> Prefill:<model> (see module doc).

    Raises:
        ValueError: the args are invalid; the message names each wrong field.
    """
    config = load_pd_args(args)
    p, d = config.prefill_config, config.decode_config
    name = sanitize_name(d.model_id)
    prefill = PDPrefillServer.options(name=f"Prefill:{name}", **p.serve_options()).bind(p.model_dump())
    decode = PDDecodeServer.options(name=f"Decode:{name}", **d.serve_options()).bind(d.model_dump(), prefill)
    no_lora = {"adapters": {}, "multiplexed_bases": [], "lora_bases": [], "allow_runtime_updating": False}
    return OpenAIIngress.options(name="OpenAIIngress", **config.ingress_config.serve_options()).bind(
        {d.model_id: decode}, config.ingress_config.resolved_api_key(), no_lora, {d.model_id: d.stream_batching_s()})
