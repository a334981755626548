"""servax's entry points: the Ray Serve application and the offline `LLM`.

    config.py          the YAML/args schema: AppConfig (models + ingress), IngressConfig, YAML includes
    llm_config.py      one model's block (Ray Serve LLM's LLMConfig shape: loading, engine_kwargs, deployment, LoRA)
    serving_config.py  the OpenAI routes' settings the engine never reads (tool_call_parser, ...)
    builder.py         build_app(args): one LLMServer per model + the OpenAI ingress
    llm_server.py      LLMServer: the Serve deployment owning one AsyncLLMEngine (handle API: generate, stream)
    relay.py           the one path from every door of a replica to its engine and back (GenerationRequest)
    openai_api.py      the OpenAI routes of one model on the relay (runs inside LLMServer)
    openai_requests.py OpenAI request bodies, each turned into a GenerationRequest
    openai_responses.py OpenAI response bodies, stream chunks and errors
    tool_parsers.py    tool calls read from replies (tool_call_parser) and forced by tool_choice
    ingress.py         the FastAPI app and its Serve deployment (routing by `model`, errors, SSE)
    colocated.py       one model's LLMServer serving that FastAPI app itself (ingress_config.colocate)
    routing.py         a prefix-cache-aware Serve request router
    metrics.py         a replica's metrics, one table exposed through Ray and Prometheus
    llm.py             LLM: offline batch generation in this process (vLLM's offline API)

`from app import LLM, SamplingParams` imports neither Ray nor FastAPI.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"LLM": "app.llm", "load_model": "app.llm", "SamplingParams": "runtime.engine.sampling_params",
            "LoRARequest": "runtime.engine.lora_request", "PoolingParams": "runtime.engine.pooling"}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'app' has no attribute {name!r}")
