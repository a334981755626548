"""build_app: the application builder that `serve run configs/app.yaml` imports.

    serve run configs/app.yaml                    # import_path: app.builder:build_app
    serve run app.builder:build_app config_path=configs/multi-model.yaml
    import_path: app.builder:build_openai_app     # Ray Serve LLM's name, same builder

It validates the args (app.config), then binds one LLMServer deployment per model, named
`LLMServer:<model_id>` with its `deployment_config`, and one OpenAIIngress that routes
to them by model id; or, with `ingress_config.colocate` (one model), only that model's
LLMServer, which answers HTTP itself (app.colocated). `build_pd_openai_app` (app.pd) builds
the prefill/decode disaggregated app from `prefill_config` / `decode_config`.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from app.colocated import ColocatedLLMServer
from app.config import AppConfig, load_app_config
from app.ingress import OpenAIIngress
from app.llm_config import LLMConfig
from app.llm_server import LLMServer
from app.pd import build_pd_openai_app  # noqa: F401 - Ray Serve LLM's P/D builder, importable from here too


def build_llm_deployment(llm_config: LLMConfig) -> serve.Application:
    """One model's LLMServer, bound to its config, with its Serve options applied."""
    return LLMServer.options(name=llm_config.deployment_name(), **llm_config.serve_options()).bind(
        llm_config.model_dump())


def build_app(args: dict[str, Any] | AppConfig) -> serve.Application:
    """The Serve application for `args` (see app.config.AppConfig for the schema).

    Raises:
        ValueError: the args are invalid; the message names each wrong field.
    """
    config = args if isinstance(args, AppConfig) else load_app_config(dict(args))
    ingress = config.ingress_config
    if ingress.colocate:
        block = config.llm_configs[0]
        return ColocatedLLMServer.options(name=block.deployment_name(), **block.serve_options()).bind(
            block.model_dump(), ingress.resolved_api_key(), lora_routes(config))
    handles = {block.model_id: build_llm_deployment(block) for block in config.llm_configs}
    return OpenAIIngress.options(name="OpenAIIngress", **ingress.serve_options()).bind(
        handles, ingress.resolved_api_key(), lora_routes(config),
        {block.model_id: block.stream_batching_s() for block in config.llm_configs})


def lora_routes(config: AppConfig) -> dict[str, Any]:
    """What the ingress needs to route LoRA adapters (app.ingress.OpenAIRouter's `lora`):
    the static lora_modules by name, the bases with Serve-multiplexed adapters, the bases
    that serve adapters at all, and whether adapters may be loaded at run time."""
    return {
        "adapters": {m.name: {"base": block.model_id, "path": m.path}
                     for block in config.llm_configs for m in block.lora_modules},
        "multiplexed_bases": [block.model_id for block in config.llm_configs
                              if block.lora_config is not None and block.lora_config.dynamic_lora_loading_path],
        "lora_bases": [block.model_id for block in config.llm_configs if block.engine_config().enable_lora],
        "allow_runtime_updating": config.ingress_config.runtime_lora_updating(),
    }


# Ray Serve LLM's builder name, so that `import_path: app.builder:build_openai_app` works too.
build_openai_app = build_app
