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

Each model block follows the shape of Ray Serve LLM's `LLMConfig`; `engine_kwargs` is
`runtime.engine.config.EngineConfig` without `model` (that comes from `model_source`). Every
block forbids unknown keys so that a typo fails with the field's name instead of being
silently ignored.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

import warnings

from runtime.engine.config import EngineConfig, ModelImpl

REPO_ROOT = Path(__file__).resolve().parents[1]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelLoadingConfig(_Strict):
    """Which model to load and the name clients use for it."""

    model_id: str = Field(min_length=1, description="Name clients send as `model`; also names the deployment.")
    model_source: str | None = Field(
        None, description="Hub ID, local folder or servax-tiny/<name>; default: model_id."
    )

    tokenizer_source: str | None = Field(None, description="Tokenizer source if not the model's own (Ray's name).")

    @property
    def source(self) -> str:
        return self.model_source or self.model_id


class RayActorOptions(_Strict):
    """The subset of Ray actor options that make sense for a model replica."""

    num_cpus: float | None = Field(None, ge=0)
    num_gpus: float | None = Field(None, ge=0)
    memory: float | None = Field(None, ge=0, description="Bytes of memory to reserve.")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom resources, e.g. {TPU: 4}.")
    runtime_env: dict[str, Any] | None = None
    accelerator_type: str | None = None


class AutoscalingConfig(BaseModel):
    """Serve autoscaling, by ongoing requests per replica.

    The common keys are typed here; any other key of Serve's own AutoscalingConfig
    (look_back_period_s, smoothing factors, ...) passes through and Serve validates it.
    """

    model_config = ConfigDict(extra="allow")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(16, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        if self.model_extra:
            from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig

            known = set(ServeAutoscalingConfig.__fields__)
            unknown = sorted(set(self.model_extra) - known)
            if unknown:
                raise ValueError(f"unknown autoscaling key(s) {', '.join(unknown)}; Serve knows {', '.join(sorted(known))}")
        return self


class DeploymentConfig(_Strict):
    """Serve options of one model's LLMServer deployment."""

    num_replicas: int | None = Field(None, ge=1, description="Fixed replica count (default 1).")
    autoscaling_config: AutoscalingConfig | None = None
    # An engine batches itself, so a replica takes many requests at once; Serve's default
    # of 5 would serialise a continuous-batching engine.
    max_ongoing_requests: int = Field(256, ge=1)
    max_queued_requests: int = Field(-1, ge=-1, description="-1: unbounded Serve queue.")
    ray_actor_options: RayActorOptions = Field(default_factory=RayActorOptions)
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0)
    graceful_shutdown_wait_loop_s: float | None = Field(None, ge=0)
    logging_config: dict[str, Any] | None = None
    request_router_config: dict[str, Any] | None = None
    placement_group_bundles: list[dict[str, float]] | None = Field(
        None, description="Serve's placement group for the replica (the first bundle holds the replica itself)."
    )
    placement_group_strategy: str | None = None

    @model_validator(mode="after")
    def _replicas_xor_autoscaling(self) -> DeploymentConfig:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        return self

    def serve_options(self) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options(...)`."""
        opts = self.model_dump(exclude_none=True, exclude={"ray_actor_options", "autoscaling_config"})
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = self.autoscaling_config.model_dump(exclude_none=True)
        elif self.num_replicas is None:
            opts["num_replicas"] = 1
        actor = self.ray_actor_options.model_dump(exclude_none=True)
        if not actor.get("resources"):
            actor.pop("resources", None)
        opts["ray_actor_options"] = actor
        return opts


class LoraConfig(_Strict):
    """Ray Serve LLM's lora_config: adapters loaded on demand, per replica, by model id
    "<model_id>:<adapter>" from `dynamic_lora_loading_path/<adapter>` (Serve model multiplexing
    routes a request to a replica that has its adapter)."""

    dynamic_lora_loading_path: str | None = Field(
        None, description="Folder holding one PEFT adapter folder per adapter name (local path or file:// URI).")
    max_num_adapters_per_replica: int = Field(16, gt=0, description="Adapters one replica keeps loaded (LRU).")
    download_timeout_s: float | None = Field(None, gt=0, description="Accepted for Ray Serve LLM YAML.")
    max_download_tries: int = Field(3, gt=0, description="Accepted for Ray Serve LLM YAML.")

    @field_validator("dynamic_lora_loading_path")
    @classmethod
    def _local(cls, v: str | None) -> str | None:
        if v is not None and re.match(r"^(s3|gs|abfss|azure)://", v):
            raise ValueError(f"{v}: servax reads adapters from a local (or mounted) folder; cloud storage "
                             "URIs are not supported: sync the adapters to a local path")
        return v.removeprefix("file://") if v else v

    def adapter_path(self, adapter: str) -> str:
        if self.dynamic_lora_loading_path is None:
            raise ValueError("lora_config.dynamic_lora_loading_path is not set")
        return os.path.join(os.path.expanduser(self.dynamic_lora_loading_path), adapter)


class LoRAModule(_Strict):
    """A statically served adapter (vLLM's --lora-modules entry): requests name it as `model`."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1, description="PEFT adapter folder (or hub id, when online).")
    base_model_name: str | None = None


class LLMConfig(_Strict):
    """One model behind the endpoint (the shape of Ray Serve LLM's LLMConfig)."""

    model_loading_config: ModelLoadingConfig
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="runtime.engine.config.EngineConfig fields except `model`."
    )
    deployment_config: DeploymentConfig = Field(default_factory=DeploymentConfig)
    model_impl: ModelImpl | None = Field(None, description="Shortcut for engine_kwargs.model_impl.")
    # Ray Serve LLM's LLMConfig keys, so its YAML runs unchanged.
    llm_engine: str = Field("servax", description="Ray Serve LLM names its engine here; servax serves with its own.")
    accelerator_type: str | None = Field(None, description="Ray accelerator type for the replica (e.g. TPU-V6E, H100).")
    runtime_env: dict[str, Any] | None = Field(None, description="Ray runtime_env of the replica.")
    placement_group_config: dict[str, Any] | None = Field(
        None, description="{bundles: [...]} or {bundle_per_worker: {...}}, and an optional strategy (Ray's shape)."
    )
    lora_config: LoraConfig | None = None
    lora_modules: list[LoRAModule] = Field(
        default_factory=list, description="Adapters served by name from startup (vLLM's --lora-modules).")
    log_engine_metrics: bool = Field(True, description="Export the replica's metrics through Ray.")
    experimental_configs: dict[str, Any] = Field(
        default_factory=dict, description="Ray Serve LLM's: num_ingress_replicas is honoured.",
    )

    @field_validator("llm_engine")
    @classmethod
    def _engine_is_servax(cls, v: str) -> str:
        if v.lower() not in ("servax", "vllm"):
            raise ValueError(f"llm_engine {v!r}: servax serves every model with its own JAX engine; "
                             "leave llm_engine out (or 'vLLM', as Ray Serve LLM YAML has it)")
        return v

    @model_validator(mode="after")
    def _lora_needs_enable_lora(self) -> LLMConfig:
        if (self.lora_config is not None or self.lora_modules) and self.engine_kwargs.get("enable_lora") is False:
            raise ValueError("lora_config / lora_modules need engine_kwargs.enable_lora (leave it out: it is implied)")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names) or self.model_id in names:
            raise ValueError(f"lora_modules names must be unique and differ from the model_id: {names}")
        return self

    @field_validator("experimental_configs")
    @classmethod
    def _known_experimental(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(v) - {"num_ingress_replicas", "stream_batching_interval_ms"})
        if unknown:
            raise ValueError(f"unknown experimental_configs key(s) {', '.join(unknown)}; "
                             "known: num_ingress_replicas, stream_batching_interval_ms")
        return v

    @field_validator("placement_group_config")
    @classmethod
    def _placement_group_shape(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            unknown = sorted(set(v) - {"bundles", "bundle_per_worker", "strategy"})
            if unknown or ("bundles" in v) == ("bundle_per_worker" in v):
                raise ValueError("placement_group_config takes `bundles: [{CPU: 1}, ...]` or "
                                 "`bundle_per_worker: {CPU: 1}`, and an optional `strategy`")
        return v

    @model_validator(mode="before")
    @classmethod
    def _impl_is_model_impl(cls, data: Any) -> Any:
        if isinstance(data, dict) and "impl" in data and "model_impl" not in data:
            data = {**data, "model_impl": data["impl"]}
            del data["impl"]
            warnings.warn("the model block setting `impl` is deprecated; use `model_impl`", FutureWarning, stacklevel=2)
        return data

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs_valid(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        if "model" in kwargs:
            raise ValueError("`model` is not an engine_kwargs field: set model_loading_config.model_source")
        if "served_model_name" in kwargs:
            raise ValueError("served_model_name: the served name is model_loading_config.model_id")
        # Validate now (with a placeholder model) so YAML errors name engine_kwargs' field.
        try:
            EngineConfig(model="_", **kwargs)
        except ValidationError as e:
            raise ValueError("; ".join(line.strip() for line in _describe(e, "engine_kwargs").splitlines())) from None
        return kwargs

    @model_validator(mode="after")
    def _impl_agrees(self) -> LLMConfig:
        inner = self.engine_kwargs.get("model_impl", self.engine_kwargs.get("impl", self.model_impl))
        if self.model_impl is not None and inner != self.model_impl:
            raise ValueError(f"model_impl ({self.model_impl!r}) contradicts engine_kwargs.model_impl ({inner!r})")
        return self

    @property
    def model_id(self) -> str:
        return self.model_loading_config.model_id

    def engine_config(self) -> EngineConfig:
        """The engine's configuration: engine_kwargs + model_source (+ the model_impl shortcut)."""
        kwargs = dict(self.engine_kwargs)
        if self.model_loading_config.tokenizer_source and "tokenizer" not in kwargs:
            kwargs["tokenizer"] = self.model_loading_config.tokenizer_source
        kwargs.setdefault("served_model_name", self.model_id)
        if self.lora_config is not None or self.lora_modules:
            kwargs.setdefault("enable_lora", True)
            if self.lora_config is not None:
                kwargs.setdefault("max_cpu_loras", self.lora_config.max_num_adapters_per_replica)
        if self.model_impl is not None:
            kwargs.pop("impl", None)
            kwargs["model_impl"] = self.model_impl
        return EngineConfig(model=self.model_loading_config.source, **kwargs)

    def deployment_name(self) -> str:
        return "LLMServer:" + sanitize_name(self.model_id)

    def serve_options(self) -> dict[str, Any]:
        """`Deployment.options(...)` of this model's LLMServer: deployment_config plus the
        Ray Serve LLM keys that place the replica (accelerator_type, runtime_env, placement group)."""
        opts = self.deployment_config.serve_options()
        actor = opts["ray_actor_options"]
        if self.accelerator_type is not None:
            actor["accelerator_type"] = self.accelerator_type
        if self.runtime_env is not None:
            actor["runtime_env"] = {**self.runtime_env, **actor.get("runtime_env", {})}
        pg = self.placement_group_config
        if pg is not None:
            opts["placement_group_bundles"] = pg.get("bundles") or [pg["bundle_per_worker"]]
            if "strategy" in pg:
                opts["placement_group_strategy"] = pg["strategy"]
        return opts


class IngressConfig(_Strict):
    """The OpenAI-compatible HTTP front (one FastAPI deployment for all models)."""

    api_key: str | None = Field(None, description="Required bearer token; prefer api_key_env.")
    api_key_env: str | None = Field(None, description="Name of an environment variable holding the key.")
    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(1024, ge=1)
    max_queued_requests: int = Field(-1, ge=-1)
    ray_actor_options: RayActorOptions = Field(default_factory=lambda: RayActorOptions(num_cpus=0))
    colocate: bool = Field(
        False, description="Serve HTTP from the model's own replicas, with no separate ingress deployment: one "
                           "process and one Serve stream fewer per token (+6-11% output tokens/s at 32 streams "
                           "on 2 cores). One model only, without lora_config or a request_router_config; the model's "
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


class AppConfig(_Strict):
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


def sanitize_name(model_id: str) -> str:
    """A Serve-safe deployment name from a model id: `Qwen/Qwen2.5-0.5B` -> `Qwen--Qwen2.5-0.5B`."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", model_id.replace("/", "--"))


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
        raise ValueError("invalid servax config:\n" + _describe(e, prefix="args")) from None


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


def _describe(error: ValidationError, prefix: str) -> str:
    lines = []
    for err in error.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling)"
        lines.append(f"  {loc}: {msg}" + (f" (got {err['input']!r})" if err["type"] != "extra_forbidden"
                                            and not isinstance(err.get("input"), dict) else ""))
    return "\n".join(lines)

