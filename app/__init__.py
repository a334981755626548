"""servax's entry points: the Ray Serve application and the offline `LLM`.

    config.py    the YAML/args schema (LLMConfig-shaped model blocks, ingress block)
    builder.py   build_app(args): one LLMServer per model + the OpenAI ingress
    server.py    LLMServer: the deployment owning one AsyncLLMEngine (handle API: generate, stream)
    serving.py   the OpenAI protocol on top of an engine (runs inside LLMServer)
    protocol.py  OpenAI request/response bodies
    ingress.py   the FastAPI app and its Serve deployment (routing by `model`, errors, SSE)
    colocated.py one model's LLMServer serving that FastAPI app itself (ingress_config.colocate)
    metrics.py   Serve metrics of a replica
    llm.py       LLM: offline batch generation in this process (vLLM's offline API)

`from app import LLM, SamplingParams` imports neither Ray nor FastAPI.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"LLM": "app.llm", "load_model": "app.llm", "SamplingParams": "runtime.engine.sampling_params",
            "LoRARequest": "runtime.engine.lora_request"}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'app' has no attribute {name!r}")
