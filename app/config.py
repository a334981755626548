"""The typed configuration users write: the `args` of `serve run configs/app.yaml`.

    applications:
    - name: servax
      route_prefix: /
      import_path: app.builder:build_app
      args:
        ingress_config: {api_key_env: SERVAX_API_KEY, max_ongoing_requests: 1024}
        llm_configs:
        - model_loading_config: {model_id: tiny-llama, model_source: servax-tiny/llama}
          engine_kwargs: {model_impl: jax, dtype: float32, max_model_len: 512}
          deployment_config: {num_replicas: 1, ray_actor_options: {num_cpus: 1}}
        - models/gpt2.yaml      # a block may live in its own file

This module holds the app-level blocks (AppConfig, IngressConfig) and reads them from YAML;
each model block is an app.llm_config.LLMConfig. Every block forbids unknown keys so that a
typo fails with the field's name instead of being silently ignored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from app.llm_config import LLMConfig, RayActorOptions, StrictBlock, describe_errors, sanitize_name

__all__ = ["AppConfig", "IngressConfig", "LLMConfig", "load_app_config", "sanitize_name"]

REPO_ROOT = Path(__file__).resolve().parents[1]


class IngressConfig(StrictBlock):
    """The OpenAI-compatible HTTP front (one FastAPI deployment for all models)."""

    api_key: str | None = Field(None, description="Required bearer token; prefer api_key_env.")
    api_key_env: str | None = Field(None, description="Name of an environment variable holding the key.")
    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(1024, ge=1)
    max_queued_requests: int = Field(-1, ge=-1)
    ray_actor_options: RayActorOptions = Field(default_factory=lambda: RayActorOptions(num_cpus=0))
    colocate: bool = Field(
        False, description="Serve HTTP from the model's own replicas, with no separate ingress deployment: one "
                           "process and one Serve stream fewer per token (benchmarks/RESULTS.md has the gain). One "
                           "model only, without lora_config or a request_router_config; the model's "
                           "deployment_config then sets replicas and limits (see app/colocated.py).")
    allow_runtime_lora_updating: bool = Field(
        False, description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; vLLM's "
                           "switch is VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, which servax honours too).")

    def runtime_lora_updating(self) -> bool:
        return self.allow_runtime_lora_updating or os.environ.get(
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")

    def resolved_api_key(self) -> str | None:
        """The key to require, or None for an open endpoint.

        Raises:
            ValueError: api_key_env names a variable that is not set.
        """
        if self.api_key is not None:
            return self.api_key
        if self.api_key_env is not None:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ValueError(f"ingress_config.api_key_env: environment variable {self.api_key_env} is not set")
            return key
        return None

    def serve_options(self) -> dict[str, Any]:
        actor = self.ray_actor_options.model_dump(exclude_none=True)
        if not actor.get("resources"):
            actor.pop("resources", None)
        return dict(
            num_replicas=self.num_replicas,
            max_ongoing_requests=self.max_ongoing_requests,
            max_queued_requests=self.max_queued_requests,
            ray_actor_options=actor,
        )


class AppConfig(StrictBlock):
    """All of `args`: the ingress block and one LLMConfig per model."""

    llm_configs: list[LLMConfig] = Field(min_length=1)
    ingress_config: IngressConfig = Field(default_factory=IngressConfig)
    ingress_deployment_config: dict[str, Any] | None = Field(
        None, description="Ray Serve LLM's name for the ingress' Serve options (num_replicas, "
                          "max_ongoing_requests, ray_actor_options, ...); merged into ingress_config.",
    )

    @model_validator(mode="after")
    def _ray_ingress_block(self) -> AppConfig:
        merged = dict(self.ingress_deployment_config or {})
        replicas = [b.experimental_configs.get("num_ingress_replicas") for b in self.llm_configs]
        replicas = [r for r in replicas if r]
        if replicas and "num_replicas" not in merged:
            merged["num_replicas"] = max(replicas)
        if merged:
            self.ingress_config = IngressConfig.model_validate({**self.ingress_config.model_dump(exclude_unset=True),
                                                               **merged})
        return self

    @model_validator(mode="after")
    def _colocation(self) -> AppConfig:
        """ingress_config.colocate: the model's replicas answer HTTP themselves, so there is one
        model, and nothing that needs the separate ingress to pick a replica per request."""
        if not self.ingress_config.colocate:
            return self
        why = None
        if len(self.llm_configs) != 1:
            why = f"it serves one model, not {len(self.llm_configs)} (routing by `model` needs the separate ingress)"
        elif self.llm_configs[0].lora_config is not None and self.llm_configs[0].lora_config.dynamic_lora_loading_path:
            why = "lora_config's adapters are routed to replicas by Serve's model multiplexing, from the ingress"
        elif self.llm_configs[0].deployment_config.request_router_config is not None:
            why = "a request_router_config picks replicas for the ingress' calls, which colocation removes"
        elif self.ingress_config.num_replicas != 1:
            why = "the model's deployment_config sets its replicas; ingress_config.num_replicas does not apply"
        if why is not None:
            raise ValueError(f"ingress_config.colocate: {why}; set colocate: false")
        return self

    @model_validator(mode="after")
    def _unique_models(self) -> AppConfig:
        seen: dict[str, str] = {}
        for block in self.llm_configs:
            for key in (block.model_id, block.deployment_name()):
                if key in seen:
                    clash = "" if seen[key] == block.model_id else f" (same deployment name as {seen[key]!r})"
                    raise ValueError(f"duplicate model_id {block.model_id!r} in llm_configs{clash}")
                seen[key] = block.model_id
        return self


def load_app_config(args: dict[str, Any] | str | os.PathLike, base_dir: Path | None = None) -> AppConfig:
    """Validate `args` (a dict, or a path to a YAML file) into an AppConfig.

    A YAML file may hold the args themselves or a whole Serve config (`applications:`), in
    which case the first application's args are used. An `llm_configs` entry that is a
    string is a path to a YAML file holding one model block, relative to the including
    file, the current directory, or the repository (tried in that order). `config_path`
    in args names a file whose args are the base that the other keys override.

    Raises:
        ValueError: with every problem and the path of the field it concerns.
    """
    if not isinstance(args, dict):
        path = _find(str(args), base_dir)
        return load_app_config(_read_args(path), base_dir=path.parent)
    args = dict(args)
    if "config_path" in args:
        path = _find(str(args.pop("config_path")), base_dir)
        args = {**_read_args(path), **args}
        base_dir = path.parent
    blocks = args.get("llm_configs")
    if isinstance(blocks, list):
        args["llm_configs"] = [_include(b, base_dir) if isinstance(b, str) else b for b in blocks]
    try:
        return AppConfig.model_validate(args)
    except ValidationError as e:
        raise ValueError("invalid servax config:\n" + describe_errors(e, prefix="args")) from None


def _read_args(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    if "applications" in data:
        apps = data["applications"]
        if not apps:
            raise ValueError(f"{path}: `applications` is empty")
        return dict(apps[0].get("args") or {})
    return data


def _include(ref: str, base_dir: Path | None) -> dict[str, Any]:
    path = _find(ref, base_dir)
    block = yaml.safe_load(path.read_text())
    if not isinstance(block, dict):
        raise ValueError(f"{path}: a model block file must hold one mapping (model_loading_config, ...)")
    return block


def _find(ref: str, base_dir: Path | None) -> Path:
    candidates = [Path(ref)] if Path(ref).is_absolute() else [
        *([base_dir / ref] if base_dir else []), Path.cwd() / ref, REPO_ROOT / ref, REPO_ROOT / "configs" / ref,
    ]
    for path in candidates:
        if path.is_file():
            return path
    raise ValueError(f"config file {ref!r} not found (tried: {', '.join(str(p) for p in candidates)})")


