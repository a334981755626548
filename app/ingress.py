"""The OpenAI-compatible HTTP front: one FastAPI app routing by `model` to LLMServer handles.

`build_openai_api(router)` makes the FastAPI app; `OpenAIIngress` is the Serve deployment
that builds it at replica start from the handles the builder binds. The app does no
tokenization: it validates the body, picks the model, forwards the request to the model's
LLMServer as one streaming handle call and relays what comes back (a JSON body, SSE
chunks, or an OpenAI error with its status: app.ingress_errors).
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import inspect
import logging
import time
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.handle import DeploymentHandle
from pydantic import ValidationError

from app.anthropic_reply import anthropic_error_body
from app.anthropic_request import CountTokensRequest, MessagesRequest
from app.body_limit import BodySizeLimit
from app.ingress_errors import ANTHROPIC_PREFIX, APIError, add_error_handlers, json_error, server_error, unwrap
from app.metrics import render_families
from app.openai_requests import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoRAAdapterRequest, TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from app.openai_responses import ErrorResponse, ModelCard, ModelList
from app.pooling_api import add_pooling_routes
from app.responses_output import responses_error_event
from app.responses_request import ResponsesRequest
from app.sse import named_events, sse_events
from runtime.engine.lora_request import stable_lora_id

logger = logging.getLogger("ray.serve")


SERVAX_VERSION = importlib.metadata.version("servax")
# The model's chunks stream to the ingress by value over the replicas' gRPC channel, not as
# one Ray object per chunk (Serve's default, "by reference"), which costs the ingress less CPU
# per token (measured in benchmarks/RESULTS.md, "Stop 33"). The option is private to Ray Serve
# (what RAY_SERVE_THROUGHPUT_OPTIMIZED sets for every handle); a Ray without it keeps the default.
STREAM_OPTIONS = ({"stream": True, "_by_reference": False}
                  if "_by_reference" in inspect.signature(DeploymentHandle.options).parameters else {"stream": True})
# Lists the request fields servax did not know and ignored (vLLM only logs them), each
# percent-encoded: a field's name is the client's, and a header holds only latin-1 text.
IGNORED_FIELDS_HEADER = "x-servax-ignored-fields"


class OpenAIRouter:
    """Picks the model's handle, checks the API key, and relays LLMServer's answers."""

    def __init__(self, handles: dict[str, DeploymentHandle], api_key: str | None = None,
                 lora: dict[str, Any] | None = None, stream_batching: dict[str, float] | None = None):
        self.handles = handles
        self.api_key = api_key
        # Seconds a model's streamed chunks are gathered before a body write (app.sse), by model id.
        self.stream_batching = dict(stream_batching or {})
        self._cards: dict[str, ModelCard] = {}
        lora = lora or {}
        # LoRA adapters by name -> {"base": model id, "path": folder}: the static lora_modules,
        # then those loaded through /v1/load_lora_adapter.
        self.adapters: dict[str, dict[str, str]] = dict(lora.get("adapters") or {})
        self.multiplexed_bases: set[str] = set(lora.get("multiplexed_bases") or ())
        self.lora_bases: list[str] = list(lora.get("lora_bases") or ())
        self.allow_runtime_lora_updating = bool(lora.get("allow_runtime_updating"))

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if "x-api-key" in request.headers and not header:  # Anthropic's clients send the key there
            scheme, token = "bearer", request.headers["x-api-key"]
        # Constant-time, on bytes (compare_digest refuses non-ASCII str; headers arrive as latin-1).
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(ErrorResponse.make(
                401, "missing or incorrect API key (send Authorization: Bearer <key>, or x-api-key: <key>)",
                code="invalid_api_key"))

    def handle_for(self, model: str | None) -> DeploymentHandle:
        return self.route(model)[0]

    def route(self, model: str | None) -> tuple[DeploymentHandle, dict[str, Any] | None]:
        """The handle serving `model` and the LoRA adapter to apply (None: the base model).

        `model` is a base model id, a LoRA adapter's name (lora_modules or a loaded adapter),
        or Ray Serve LLM's "<base model id>:<adapter>" for a base with a lora_config (the
        handle then asks Serve's model multiplexing for a replica that has the adapter).
        """
        if model is None:
            if len(self.handles) == 1:
                return next(iter(self.handles.values())), None
            raise APIError(ErrorResponse.make(
                400, f"`model` is required; available: {self._available()}", param="model"))
        if model in self.handles:
            return self.handles[model], None
        if model in self.adapters:
            adapter = self.adapters[model]
            lora = {"lora_name": model, "lora_int_id": stable_lora_id(model, adapter["path"]),
                    "lora_path": adapter["path"], "base_model_name": adapter["base"]}
            return self.handles[adapter["base"]], lora
        base, sep, adapter = model.partition(":")
        if sep and adapter and base in self.multiplexed_bases:
            return self.handles[base].options(multiplexed_model_id=model), None
        raise APIError(ErrorResponse.make(
            404, f"The model `{model}` does not exist; available: {self._available()}",
            param="model", code="model_not_found"))

    def base_model(self, model: str | None) -> str | None:
        """The id of the model that serves `model` (a model id, an adapter's name, or
        "<base>:<adapter>"); None where none does."""
        if model is None:
            return next(iter(self.handles)) if len(self.handles) == 1 else None
        if model in self.handles:
            return model
        if model in self.adapters:
            return self.adapters[model]["base"]
        return model.partition(":")[0] or None

    def _available(self) -> list[str]:
        return sorted(self.handles) + sorted(self.adapters)

    async def models(self) -> ModelList:
        missing = [m for m in self.handles if m not in self._cards]
        infos = await asyncio.gather(*(self.handles[m].model_info.remote() for m in missing))
        for model_id, info in zip(missing, infos):
            self._cards[model_id] = ModelCard(**info)
        adapters = [ModelCard(id=name, root=a["path"], parent=a["base"],
                              max_model_len=self._cards[a["base"]].max_model_len)
                    for name, a in sorted(self.adapters.items())]
        return ModelList(data=[self._cards[m] for m in self.handles] + adapters)

    # ---- LoRA adapters at run time (vLLM's routes) ----------------------------------------

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> Response:
        """Validate the adapter on a replica of its base, then serve it by name."""
        if not body.lora_name or not body.lora_path:
            raise APIError(ErrorResponse.make(400, "Both 'lora_name' and 'lora_path' must be provided.",
                                              type="InvalidUserInput"))
        if body.lora_name in self.adapters or body.lora_name in self.handles:
            raise APIError(ErrorResponse.make(
                400, f"The lora adapter '{body.lora_name}' has already been loaded.", type="InvalidUserInput"))
        base = body.base_model_name or (self.lora_bases[0] if len(self.lora_bases) == 1 else None)
        if base not in self.lora_bases:
            raise APIError(ErrorResponse.make(
                400, f"base_model_name must name a model served with enable_lora: {self.lora_bases}",
                param="base_model_name"))
        lora = {"lora_name": body.lora_name, "lora_int_id": stable_lora_id(body.lora_name, body.lora_path),
                "lora_path": body.lora_path, "base_model_name": base}
        try:
            result = await self.handles[base].load_lora_adapter.remote(lora)
        except Exception as e:
            raise APIError(server_error(e)) from e
        if isinstance(result, ErrorResponse):
            return json_error(result)
        self.adapters[body.lora_name] = {"base": base, "path": body.lora_path}
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> Response:
        """Stop serving an adapter by name (replicas drop it from their caches as they evict)."""
        if not body.lora_name and body.lora_int_id is None:
            raise APIError(ErrorResponse.make(400, "either 'lora_name' and 'lora_int_id' needs to be provided.",
                                              type="InvalidUserInput"))
        adapter = self.adapters.get(body.lora_name or "")
        if adapter is None:
            raise APIError(ErrorResponse.make(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                                              type="NotFoundError", code="model_not_found"))
        del self.adapters[body.lora_name]
        lora_id = stable_lora_id(body.lora_name, adapter["path"])
        try:  # free it on the replica the call reaches; others forget it when their LRU evicts it
            await self.handles[adapter["base"]].unload_lora_adapter.remote(lora_id)
        except Exception:  # noqa: BLE001 - the adapter is already unreachable by name
            logger.warning("servax: unloading LoRA adapter %r on its replica failed", body.lora_name, exc_info=True)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    async def health(self) -> dict[str, str]:
        results = await asyncio.gather(*(h.check_health.remote() for h in self.handles.values()),
                                       return_exceptions=True)
        return {m: ("ok" if not isinstance(r, BaseException) else f"{type(unwrap(r)).__name__}: {unwrap(r)}")
                for m, r in zip(self.handles, results)}

    async def call(self, method: str, body: Any, anthropic: bool = False) -> JSONResponse:
        """Call LLMServer.<method>(body) once (no streaming) and answer with its body or error."""
        handle = self.handle_for(body.model)
        try:
            result = await getattr(handle, method).remote(body)
        except Exception as e:
            raise APIError(server_error(e)) from e
        return json_error(result, anthropic) if isinstance(result, ErrorResponse) else JSONResponse(result)

    async def tokenizer_info(self, model: str | None) -> JSONResponse:
        """vLLM's GET /tokenizer_info of `model` (the only model when None)."""
        handle = self.handle_for(model)
        try:
            result = await handle.tokenizer_info.remote()
        except Exception as e:
            raise APIError(server_error(e)) from e
        return json_error(result) if isinstance(result, ErrorResponse) else JSONResponse(result)

    async def invocations(self, body: Any) -> Any:
        """SageMaker's POST /invocations, as vLLM routes it: the body of the first route whose
        request it is (chat completions, then completions)."""
        for model, method in ((ChatCompletionRequest, "chat"), (CompletionRequest, "completion")):
            try:
                request = model.model_validate(body)
            except ValidationError:
                continue
            return await self.relay(method, request)
        raise APIError(ErrorResponse.make(400, "Cannot find suitable handler for request. Expected one of: "
                                               "['ChatCompletionRequest', 'CompletionRequest']"))

    async def relay(self, method: str,
                    body: CompletionRequest | ChatCompletionRequest | MessagesRequest | ResponsesRequest) -> Any:
        """Call LLMServer.<method>(body) and turn what it yields into the HTTP response (for
        Anthropic's Messages API, its errors and its named stream events; for the Responses
        API, its named stream events)."""
        anthropic = isinstance(body, MessagesRequest)
        handle, lora = self.route(body.model)
        ignored = body.ignored_fields
        headers = {IGNORED_FIELDS_HEADER: ",".join(quote(name, safe="_-.") for name in ignored)} if ignored else {}
        if ignored:
            logger.warning("The following fields were present in the request but ignored: %s", ignored)
        gen = getattr(handle.options(**STREAM_OPTIONS), method).remote(body, lora, sent_at=time.time())
        try:
            first = await gen.__anext__()
        except asyncio.CancelledError:  # the client left before the first token
            gen.cancel()
            raise
        except StopAsyncIteration:
            raise APIError(ErrorResponse.make(500, "the model server returned nothing", type="server_error"))
        except Exception as e:
            raise APIError(server_error(e)) from e
        if isinstance(first, ErrorResponse):
            gen.cancel()
            return json_error(first, anthropic)
        if not body.stream:
            return JSONResponse(first, headers=headers)
        interval = self.stream_batching.get(self.base_model(body.model), 0.0)
        if anthropic:
            events = named_events(first, gen, lambda err, _: anthropic_error_body(err), interval)
        elif isinstance(body, ResponsesRequest):
            events = named_events(first, gen, lambda err, last: responses_error_event(
                err, last.get("sequence_number", -1) + 1), interval)
        else:
            events = sse_events(first, gen, interval)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})

    async def stored_response(self, method: str, response_id: str) -> JSONResponse:
        """LLMServer.<method>(response_id) (retrieve_response, cancel_response) on every model:
        the answer of the replica that stored the response, else the 404."""
        results = await asyncio.gather(*(getattr(h, method).remote(response_id) for h in self.handles.values()),
                                       return_exceptions=True)
        found = [r for r in results if not isinstance(r, (ErrorResponse, BaseException)) or
                 isinstance(r, ErrorResponse) and r.status_code != 404]
        if found:
            return json_error(found[0]) if isinstance(found[0], ErrorResponse) else JSONResponse(found[0])
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise APIError(server_error(failed[0]))
        return json_error(results[0])


def build_openai_api(router: OpenAIRouter) -> FastAPI:
    """The FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses (and
    GET /v1/responses/{id}, POST /v1/responses/{id}/cancel), Anthropic's /v1/messages
    (and /v1/messages/count_tokens), /health, and vLLM's other routes (/tokenize, /detokenize,
    /tokenizer_info, /invocations, /ping, /version, /metrics)."""
    api = FastAPI(title="servax", description="OpenAI-compatible LLM serving on JAX")
    api.add_middleware(BodySizeLimit)
    add_error_handlers(api)

    @api.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        router.authorize(request)
        return JSONResponse((await router.models()).model_dump(exclude_none=True))

    @api.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> JSONResponse:
        router.authorize(request)
        router.handle_for(model_id)
        cards = {c.id: c for c in (await router.models()).data}
        return JSONResponse(cards[model_id].model_dump(exclude_none=True))

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        router.authorize(request)
        return await router.relay("completion", body)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        router.authorize(request)
        return await router.relay("chat", body)

    @api.post(ANTHROPIC_PREFIX)
    async def messages(body: MessagesRequest, request: Request) -> Any:
        """Anthropic's Messages API (app.anthropic_api)."""
        router.authorize(request)
        return await router.relay("messages", body)

    @api.post(ANTHROPIC_PREFIX + "/count_tokens")
    async def count_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
        router.authorize(request)
        return await router.call("count_tokens", body, anthropic=True)

    @api.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        """OpenAI's Responses API (app.responses_api)."""
        router.authorize(request)
        return await router.relay("responses", body)

    @api.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request, stream: bool = False) -> JSONResponse:
        """A stored Response (stored by the replica that answered it: see app.responses_api)."""
        router.authorize(request)
        if stream:
            raise APIError(ErrorResponse.make(400, "streaming a stored response needs background streaming, "
                                                   "which servax does not support", param="stream"))
        return await router.stored_response("retrieve_response", response_id)

    @api.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> JSONResponse:
        router.authorize(request)
        return await router.stored_response("cancel_response", response_id)

    if router.allow_runtime_lora_updating:
        @api.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
            router.authorize(request)
            return await router.load_lora_adapter(body)

        @api.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
            router.authorize(request)
            return await router.unload_lora_adapter(body)

    @api.get("/health")
    async def health() -> JSONResponse:
        status = await router.health()
        ok = all(v == "ok" for v in status.values())
        return JSONResponse({"status": "ok" if ok else "unhealthy", "models": status},
                            status_code=200 if ok else 503)

    @api.get("/ping")
    @api.post("/ping")
    async def ping() -> JSONResponse:
        """SageMaker's health check (vLLM's): /health's answer."""
        return await health()

    @api.post("/invocations")
    async def invocations(request: Request) -> Any:
        router.authorize(request)
        try:
            body = await request.json()
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested past the parser's depth
            raise APIError(ErrorResponse.make(400, f"request body is not valid JSON: {type(e).__name__}")) from None
        return await router.invocations(body)

    @api.get("/tokenizer_info")
    async def tokenizer_info(request: Request, model: str | None = None) -> JSONResponse:
        router.authorize(request)
        return await router.tokenizer_info(model)

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
        router.authorize(request)
        return await router.call("tokenize", body)

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
        router.authorize(request)
        return await router.call("detokenize", body)

    @api.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": SERVAX_VERSION})

    @api.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format: every model's replica metrics, as servax:* and under vLLM's vllm:* names."""
        families = await asyncio.gather(*(h.metric_families.remote() for h in router.handles.values()))
        return Response(render_families(list(families)), media_type=CONTENT_TYPE_LATEST)

    add_pooling_routes(api, router)  # /v1/embeddings, /v1/score, /rerank (app/pooling_api.py)
    return api


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class OpenAIIngress:
    """The HTTP ingress deployment; bound by app.builder to one LLMServer handle per model."""

    def __init__(self, llm_handles: dict[str, DeploymentHandle], api_key: str | None = None,
                 lora: dict[str, Any] | None = None, stream_batching: dict[str, float] | None = None):
        self.router = OpenAIRouter(llm_handles, api_key, lora, stream_batching)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_openai_api(self.router)
