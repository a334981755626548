"""The pooling routes: /v1/embeddings, /v1/score (and /score), /rerank (/v1/rerank, /v2/rerank).

Request and reply shapes are vLLM 0.32's (OpenAI's embeddings; vLLM's score; Cohere / Jina's
rerank). Each request becomes pooling requests of the one engine (runtime/engine/pooling.py)
through the one input processor; this module owns only the wire formats. `PoolingServing`
runs inside the model's LLMServer replica; `add_pooling_routes` puts the routes on the ingress.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from app.openai_responses import ErrorResponse, error_response
from runtime.engine.errors import InvalidRequestError
from runtime.engine.pooling import PoolingParams, cosine_similarity, cross_encoder_prompt, score_pairs

# Text, token ids, or a list of either (OpenAI's `input`; LangChain sends lists of token ids).
PoolingInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
ScoreInput = StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]


class _PoolingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    use_activation: bool | None = None


class EmbeddingRequest(_PoolingRequest):
    """POST /v1/embeddings (OpenAI's body, vLLM's extra fields)."""

    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    add_special_tokens: bool = True


class ScoreRequest(_PoolingRequest):
    """POST /v1/score: queries and documents (or vLLM's older text_1 / text_2)."""

    queries: ScoreInput | None = None
    documents: ScoreInput | None = None
    text_1: ScoreInput | None = None
    text_2: ScoreInput | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class RerankRequest(_PoolingRequest):
    """POST /rerank (Cohere / Jina): a query, its documents, top_n, return_documents."""

    query: StrictStr | list[StrictInt]
    documents: list[StrictStr] | list[list[StrictInt]]
    top_n: int = Field(0, ge=0)
    return_documents: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class PoolingServing:
    """The pooling routes of one model on its AsyncLLMEngine.

    Args:
        engine: the replica's AsyncLLMEngine (a pooling engine, or the routes answer 400).
        model_id: the served name in replies.
        chat_template: a score template for cross-encoder prompts (vLLM's --chat-template on
            a reranker), or None (query text followed by document text).
    """

    def __init__(self, engine: Any, model_id: str, chat_template: str | None = None):
        self.engine = engine
        self.model_id = model_id
        self.chat_template = chat_template
        self._ids = itertools.count()

    @property
    def pooler(self) -> Any:
        return self.engine.engine.pooler

    async def _pool(self, prompts: list[Any], params: PoolingParams) -> list[Any]:
        """Run pooling requests together; their outputs in order (the others are aborted if one fails)."""
        base = f"pool-{uuid.uuid4().hex[:12]}"

        async def one(i: int, prompt: Any) -> Any:
            last = None
            async for out in self.engine.generate(prompt, params, request_id=f"{base}-{i}"):
                last = out
            return last

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    def _needs_pooler(self) -> None:
        if self.pooler is None:
            raise InvalidRequestError(
                f"model {self.model_id!r} runs runner='generate': it serves no embeddings or scores "
                "(start it with runner='pooling')", param="model")

    async def embeddings(self, request: EmbeddingRequest) -> dict[str, Any] | ErrorResponse:
        try:
            self._needs_pooler()
            if self.pooler.task != "embed":
                raise InvalidRequestError(
                    f"model {self.model_id!r} pools for task {self.pooler.task!r}; embeddings need an embed "
                    "model (convert='embed')", param="model")
            prompts = _inputs(request.input)
            if not request.add_special_tokens:
                prompts = [self._ids_without_special(p) for p in prompts]
            params = PoolingParams(task="embed", dimensions=request.dimensions, use_activation=request.use_activation,
                                   truncate_prompt_tokens=request.truncate_prompt_tokens)
            outs = await self._pool(prompts, params)
        except Exception as e:  # noqa: BLE001 - engine errors become their HTTP answers
            return _error(e, "input")
        data = []
        for i, out in enumerate(outs):
            vec = np.asarray(out.outputs.data, np.float32)
            embedding: Any = (base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
                              if request.encoding_format == "base64" else vec.tolist())
            data.append({"index": i, "object": "embedding", "embedding": embedding})
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.model_id, "data": data,
                "usage": _usage(tokens)}

    def _ids_without_special(self, prompt: Any) -> Any:
        tokenizer = self.engine.tokenizer
        if isinstance(prompt, str) and tokenizer is not None:
            return list(tokenizer(prompt, add_special_tokens=False).input_ids)
        return prompt

    async def _scores(self, queries: Any, documents: Any, request: Any) -> tuple[list[float], int]:
        """Scores of the pairs, and the prompt tokens they took."""
        self._needs_pooler()
        pairs = score_pairs(queries, documents)
        if self.pooler.task == "embed":  # an embedding model scores with the cosine similarity
            keys = list(dict.fromkeys(_key(x) for pair in pairs for x in pair))
            outs = await self._pool([_unkey(k) for k in keys], PoolingParams(
                task="embed", truncate_prompt_tokens=request.truncate_prompt_tokens))
            vec = {k: o for k, o in zip(keys, outs)}
            scores = [cosine_similarity(vec[_key(q)].outputs.data, vec[_key(d)].outputs.data) for q, d in pairs]
            return scores, sum(len(o.prompt_token_ids) for o in outs)
        prompts = [cross_encoder_prompt(q, d, self.engine.tokenizer, self.chat_template, request.chat_template_kwargs)
                   for q, d in pairs]
        outs = await self._pool(prompts, PoolingParams(
            task="classify", use_activation=request.use_activation, truncate_prompt_tokens=request.truncate_prompt_tokens))
        return [float(o.outputs.data[0]) for o in outs], sum(len(o.prompt_token_ids) for o in outs)

    async def score(self, request: ScoreRequest) -> dict[str, Any] | ErrorResponse:
        try:
            queries = request.queries if request.queries is not None else request.text_1
            documents = request.documents if request.documents is not None else request.text_2
            if queries is None or documents is None:
                raise InvalidRequestError("a score request needs queries and documents (or text_1 and text_2)",
                                          param="queries" if queries is None else "documents")
            scores, tokens = await self._scores(queries, documents, request)
        except Exception as e:  # noqa: BLE001
            return _error(e, "documents")
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.model_id,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": _usage(tokens)}

    async def rerank(self, request: RerankRequest) -> dict[str, Any] | ErrorResponse:
        try:
            if not request.documents:
                raise InvalidRequestError("documents must not be empty", param="documents")
            scores, tokens = await self._scores(request.query, list(request.documents), request)
        except Exception as e:  # noqa: BLE001
            return _error(e, "documents")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[:request.top_n]
        results = []
        for i in order:
            doc = request.documents[i]
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if request.return_documents:
                result["document"] = {"text": doc if isinstance(doc, str) else None, "multi_modal": None}
            results.append(result)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results}


def _usage(tokens: int) -> dict[str, Any]:
    """The usage of an embeddings or score body, with vLLM's null details."""
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
            "prompt_tokens_details": None, "completion_tokens_details": None}


def _inputs(data: Any) -> list[Any]:
    """OpenAI's `input` as a list of prompts (text or token ids).

    Raises:
        InvalidRequestError: an empty input or an empty prompt in it."""
    if isinstance(data, str):
        prompts: list[Any] = [data]
    elif data and all(isinstance(t, int) for t in data):
        prompts = [list(data)]
    else:
        prompts = list(data)
    if not prompts:
        raise InvalidRequestError("input must not be empty", param="input")
    for i, p in enumerate(prompts):
        if (isinstance(p, str) and not p) or (isinstance(p, list) and not p):
            raise InvalidRequestError(f"input[{i}] is empty", param="input")
    return prompts


def _key(data: Any) -> Any:
    return data if isinstance(data, str) else tuple(data)


def _unkey(key: Any) -> Any:
    return key if isinstance(key, str) else list(key)


def _error(exc: BaseException, prompt_param: str) -> ErrorResponse:
    """The HTTP answer of an engine error (400 / 429 / 503); anything else is the server's."""
    answer = error_response(exc, prompt_param)
    if answer is None:
        raise exc
    return answer


def add_pooling_routes(api: Any, router: Any) -> None:
    """POST /v1/embeddings, /v1/score, /score, /rerank, /v1/rerank, /v2/rerank on the ingress's
    FastAPI app, routed by `model` to LLMServer.embeddings / score / rerank."""
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        router.authorize(request)
        return await router.call("embeddings", body)

    async def score(body: ScoreRequest, request: Request) -> Any:
        router.authorize(request)
        return await router.call("score", body)

    async def rerank(body: RerankRequest, request: Request) -> Any:
        router.authorize(request)
        return await router.call("rerank", body)

    api.post("/v1/embeddings")(embeddings)
    for path in ("/v1/score", "/score"):
        api.post(path)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        api.post(path)(rerank)
