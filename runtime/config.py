"""EngineConfig: the one typed configuration of the engine.

`runtime.LLM(model=..., **settings)` and a YAML model block's `engine_kwargs` are both
this object, with vLLM's names where vLLM has one.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ModelImpl = Literal["auto", "jax", "torchax"]
DType = Literal["float32", "bfloat16", "float16", "auto"]


class EngineConfig(BaseModel):
    """Settings of one engine (one model, one mesh).

    Unknown keys are rejected so that a typo in YAML fails loudly instead of being ignored.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Hugging Face hub ID, local checkpoint folder, or servax-tiny/<name>.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    tokenizer: str | None = Field(None, description="Tokenizer source if not the model's own.")
    model_impl: ModelImpl = Field("auto", description="auto: native JAX if registered, else torchax.")
    dtype: DType = Field("float32", description="Weight and activation dtype; auto takes the checkpoint's.")
    trust_remote_code: bool = False
    max_model_len: int | None = Field(None, gt=0, description="Context limit; default the model's.")
    max_num_seqs: int = Field(32, gt=0, description="Most sequences in one step.")
    max_num_batched_tokens: int = Field(512, gt=0, description="Token budget of one step.")
    block_size: int = Field(16, gt=0, description="Tokens per KV-cache block.")
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory_bytes: int | None = Field(None, gt=0, description="KV-cache budget in bytes.")
    kv_cache_memory_fraction: float = Field(
        0.5, gt=0, le=1, description="Share of free device memory for the KV cache when no byte budget is given."
    )
    num_kv_blocks: int | None = Field(None, gt=0, description="Exact KV block count (overrides budgets).")
    tensor_parallel_size: int = Field(1, gt=0)
    data_parallel_size: int = Field(
        1, gt=0,
        description="Reserved: only 1 today. Scale out with Serve replicas (deployment_config.num_replicas).",
    )
    compilation_cache_dir: str | None = Field(
        None, description="Persistent XLA cache; default ~/.cache/servax/xla, '' disables it."
    )
    max_queue_size: int = Field(1024, gt=0, description="Waiting requests beyond this are refused.")
    seed: int = 0
    max_logprobs: int = Field(20, ge=0)
    show_progress: bool = True

    @model_validator(mode="before")
    @classmethod
    def _impl_is_model_impl(cls, data: Any) -> Any:
        """`impl` was this setting's name before vLLM's `model_impl`; accepted for one release."""
        if isinstance(data, dict) and "impl" in data:
            data = dict(data)
            impl = data.pop("impl")
            if "model_impl" in data and data["model_impl"] != impl:
                raise ValueError(f"impl ({impl!r}) contradicts model_impl ({data['model_impl']!r}); set model_impl only")
            data["model_impl"] = impl
            warnings.warn("the engine setting `impl` is deprecated; use `model_impl` (vLLM's name)",
                          FutureWarning, stacklevel=2)
        return data

    @field_validator("block_size")
    @classmethod
    def _block_size_power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two, got {v}")
        return v

    @field_validator("data_parallel_size")
    @classmethod
    def _no_data_parallel_yet(cls, v: int) -> int:
        if v != 1:
            raise ValueError(
                f"data_parallel_size={v} is not supported yet (only 1); for data parallelism run more "
                "Serve replicas (deployment_config.num_replicas or autoscaling_config)"
            )
        return v

    @model_validator(mode="after")
    def _check_budget(self) -> "EngineConfig":
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so that every running sequence can decode in one step"
            )
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                    f"({self.max_num_batched_tokens} < {self.max_model_len})"
                )
        return self
