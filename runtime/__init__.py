"""servax runtime: the engine that executes every model's step function.

Public API (imported lazily so that `import runtime.step` stays light):

    from runtime import Engine, AsyncLLMEngine, EngineConfig, SamplingParams

The runtime is handed a loaded model and never imports registry/; the offline `LLM`,
which loads one, is `app.LLM`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineConfig": "runtime.config",
    "StepInput": "runtime.step",
    "KVCacheSpec": "runtime.step",
    "LoadedModel": "runtime.step",
    "SamplingParams": "runtime.sampling_params",
    "LoRARequest": "runtime.lora",
    "RequestOutput": "runtime.outputs",
    "CompletionOutput": "runtime.outputs",
    "Logprob": "runtime.outputs",
    "RequestMetrics": "runtime.outputs",
    "Engine": "runtime.engine",
    "EngineStats": "runtime.engine",
    "InputProcessor": "runtime.processor",
    "AsyncLLMEngine": "runtime.async_engine",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
