"""The typed configuration of one model behind the endpoint: a `llm_configs` entry.

    - model_loading_config: {model_id: tiny-llama, model_source: servax-tiny/llama}
      engine_kwargs: {model_impl: jax, dtype: float32, max_model_len: 512, tool_call_parser: hermes}
      deployment_config: {num_replicas: 1, ray_actor_options: {num_cpus: 1}}

A block follows the shape of Ray Serve LLM's `LLMConfig`. `engine_kwargs` holds vLLM's
engine arguments: `runtime.engine.config.EngineConfig` without `model` (that comes from
`model_source`), plus the OpenAI routes' settings (`app.serving_config.ServingConfig`:
tool_call_parser, enable_auto_tool_choice), which `LLMConfig.serving_config` takes out.
Every block forbids unknown keys so that a typo fails with the field's name instead of
being silently ignored. The app-level config (ingress, the list of models, YAML files) is
app.config.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from app.serving_config import ServingConfig, split_engine_kwargs
from runtime.engine.config import EngineConfig, ModelImpl

# Ray Serve LLM's default stream batching interval (its RAYLLM_MODEL_RESPONSE_BATCH_TIMEOUT_MS).
DEFAULT_STREAM_BATCHING_MS = 50.0


class StrictBlock(BaseModel):
    """A config block that refuses unknown keys (a typo fails with its name)."""

    model_config = ConfigDict(extra="forbid")


class ModelLoadingConfig(StrictBlock):
    """Which model to load and the name clients use for it."""

    model_id: str = Field(min_length=1, description="Name clients send as `model`; also names the deployment.")
    model_source: str | None = Field(
        None, description="Hub ID, local folder or servax-tiny/<name>; default: model_id."
    )

    tokenizer_source: str | None = Field(None, description="Tokenizer source if not the model's own (Ray's name).")

    @property
    def source(self) -> str:
        return self.model_source or self.model_id


class RayActorOptions(StrictBlock):
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


class DeploymentConfig(StrictBlock):
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


class LoraConfig(StrictBlock):
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


class LoRAModule(StrictBlock):
    """A statically served adapter (vLLM's --lora-modules entry): requests name it as `model`."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1, description="PEFT adapter folder (or hub id, when online).")
    base_model_name: str | None = None


class LLMConfig(StrictBlock):
    """One model behind the endpoint (the shape of Ray Serve LLM's LLMConfig)."""

    model_loading_config: ModelLoadingConfig
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="runtime.engine.config.EngineConfig fields except `model`, and "
                                          "app.serving_config.ServingConfig's (tool_call_parser, ...)."
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
        default_factory=dict, description="Ray Serve LLM's: num_ingress_replicas, and stream_batching_interval_ms "
                                          "(milliseconds a stream's chunks are gathered into one body write; "
                                          "Ray Serve LLM's 50 when left out, 0: each chunk as it comes).",
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
        interval = v.get("stream_batching_interval_ms")
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, (int, float))
                                     or not 0 <= interval < float("inf")):
            raise ValueError(f"experimental_configs.stream_batching_interval_ms={interval!r}: a number of "
                             "milliseconds >= 0 (0 sends each streamed chunk as it comes)")
        return v

    def stream_batching_s(self) -> float:
        """Seconds the ingress gathers this model's streamed chunks into one body write (app.sse)."""
        interval = self.experimental_configs.get("stream_batching_interval_ms")
        return (DEFAULT_STREAM_BATCHING_MS if interval is None else float(interval)) / 1000

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
            engine_kwargs, _ = split_engine_kwargs(kwargs)
            EngineConfig(model="_", **engine_kwargs)
        except ValidationError as e:
            raise ValueError("; ".join(line.strip() for line in describe_errors(e, "engine_kwargs").splitlines())) from None
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

    def serving_config(self) -> ServingConfig:
        """The OpenAI routes' settings written among engine_kwargs (tool_call_parser, ...)."""
        return split_engine_kwargs(self.engine_kwargs)[1]

    def engine_config(self) -> EngineConfig:
        """The engine's configuration: engine_kwargs (less the serving settings) + model_source
        (+ the model_impl shortcut)."""
        kwargs, _ = split_engine_kwargs(self.engine_kwargs)
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


def sanitize_name(model_id: str) -> str:
    """A Serve-safe deployment name from a model id: `Qwen/Qwen2.5-0.5B` -> `Qwen--Qwen2.5-0.5B`."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", model_id.replace("/", "--"))


def describe_errors(error: ValidationError, prefix: str) -> str:
    lines = []
    for err in error.errors():
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling)"
        lines.append(f"  {loc}: {msg}" + (f" (got {err['input']!r})" if err["type"] != "extra_forbidden"
                                            and not isinstance(err.get("input"), dict) else ""))
    return "\n".join(lines)

