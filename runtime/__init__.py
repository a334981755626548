"""servax runtime: the engine that executes every model's step function.

Public API (imported lazily so that `import runtime.ops.step` stays light):

    from runtime import Engine, AsyncLLMEngine, EngineConfig, SamplingParams

The runtime is handed a loaded model and never imports registry/; the offline `LLM`,
which loads one, is `app.LLM`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineConfig": "runtime.engine.config",
    "StepInput": "runtime.ops.step",
    "KVCacheSpec": "runtime.ops.step",
    "LoadedModel": "runtime.ops.step",
    "SamplingParams": "runtime.engine.sampling_params",
    "LoRARequest": "runtime.engine.lora_request",
    "RequestOutput": "runtime.engine.outputs",
    "CompletionOutput": "runtime.engine.outputs",
    "Logprob": "runtime.engine.outputs",
    "Engine": "runtime.engine.core",
    "EngineStats": "runtime.engine.introspection",
    "InputProcessor": "runtime.engine.input_processor",
    "AsyncLLMEngine": "runtime.engine.async_engine",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
