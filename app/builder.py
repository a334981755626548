"""build_app: the application builder that `serve run configs/app.yaml` imports.

    serve run configs/app.yaml                    # import_path: app.builder:build_app
    serve run app.builder:build_app config_path=configs/multi-model.yaml
    import_path: app.builder:build_openai_app     # Ray Serve LLM's name, same builder

It validates the args (app.config), then binds one LLMServer deployment per model, named
`LLMServer:<model_id>` with its `deployment_config`, and one OpenAIIngress that routes
to them by model id.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from app.config import AppConfig, LLMConfig, load_app_config
from app.ingress import OpenAIIngress
from app.server import LLMServer


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
    handles = {block.model_id: build_llm_deployment(block) for block in config.llm_configs}
    ingress = config.ingress_config
    return OpenAIIngress.options(name="OpenAIIngress", **ingress.serve_options()).bind(
        handles, ingress.resolved_api_key())


# Ray Serve LLM's builder name, so that `import_path: app.builder:build_openai_app` works too.
build_openai_app = build_app
