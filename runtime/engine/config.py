"""EngineConfig: the one typed configuration of the engine.

`app.LLM(model=..., **settings)` and a YAML model block's `engine_kwargs` are both this
object, with vLLM's names where vLLM has one; the settings only the OpenAI routes read
(tool_call_parser, enable_auto_tool_choice) are app.serving_config.ServingConfig, taken out
of the same keywords before this object is built.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from runtime.engine.speculative import SpeculativeConfig

ModelImpl = Literal["auto", "jax", "torchax"]

# vLLM engine arguments that cannot mean anything in servax: why, and what to use instead.
NOT_APPLICABLE = {
    "pipeline_parallel_size": "pipeline parallelism is not implemented; use tensor_parallel_size, "
                              "and Serve replicas to scale out",
    "max_seq_len_to_capture": "servax precompiles every (tokens, sequences) bucket up to "
                              "max_num_batched_tokens / max_num_seqs; lower those to compile fewer programs",
    "cuda_graph_sizes": "there are no CUDA graphs: every bucket up to max_num_batched_tokens is precompiled",
    "swap_space": "preempted sequences are recomputed, never swapped to host memory",
    "cpu_offload_gb": "weights are not offloaded; use a smaller dtype or tensor_parallel_size",
    "device": "JAX picks the platform (CPU, GPU or TPU); set JAX_PLATFORMS to choose",
    "load_format": "servax reads safetensors folders and GGUF files by what they are; drop load_format",
}
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
    max_num_seqs: int = Field(64, gt=0, description="Most sequences in one step (each power of two from 8 up to it "
                              "is a compiled sequence bucket).")
    max_num_batched_tokens: int = Field(512, gt=0, description="Token budget of one step.")
    block_size: int = Field(16, gt=0, description="Tokens per KV-cache block.")
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    async_scheduling: bool | None = Field(
        None, description="Schedule and dispatch the next step while the current one runs, its input ids "
                          "taken on the device (vLLM's --async-scheduling). None: where the engine supports it "
                          "(one process, a layered step); steps with speculation, grammars, penalties or "
                          "pooling run synchronously.")
    kv_cache_memory_bytes: int | None = Field(None, gt=0, description="KV-cache budget in bytes.")
    kv_cache_memory_fraction: float = Field(
        0.5, gt=0, le=1, description="Share of free device memory for the KV cache when no byte budget is given "
                                     "(on CPU: of the host's available memory, at most 4 GiB a device and twice "
                                     "what max_num_seqs full-length sequences need)."
    )
    num_kv_blocks: int | None = Field(None, gt=0, description="Exact KV block count (overrides budgets).")
    tensor_parallel_size: int = Field(
        1, gt=0, description="Devices the weights and KV cache are split over; more than one process has "
                             "makes a multi-process engine (runtime/engine/distributed.py).")
    enable_expert_parallel: bool = Field(
        False, description="Mixture-of-experts models: whole experts per device of the model axis (expert "
                           "parallelism) instead of every expert's features split over it.")
    distributed_executor_backend: Literal["ray", "uni"] | None = Field(
        None, description="ray: a mesh larger than one process runs over Ray actors joined by jax.distributed "
                          "(the default when it is larger); uni: one process only (vLLM's names).")
    distributed_timeout_s: float = Field(
        60.0, gt=0, description="Multi-process engine: time for the processes to join, longest a step may take "
                                "before the engine reports unhealthy; JAX's heartbeat timeout is 3x this.")
    data_parallel_size: int = Field(
        1, gt=0,
        description="Reserved: only 1 today. Scale out with Serve replicas (deployment_config.num_replicas).",
    )
    compilation_cache_dir: str | None = Field(
        None, description="Persistent XLA cache; default ~/.cache/servax/xla, '' disables it."
    )
    max_queue_size: int = Field(
        1024, gt=0, description="Requests waiting beyond this (past free running slots) are refused with 429.")
    seed: int = 0
    max_logprobs: int = Field(20, ge=-1, description="Most logprobs / prompt_logprobs a request may ask for; "
                              "-1: the whole vocabulary (as vLLM).")
    show_progress: bool = True
    # vLLM's engine arguments, with their meanings where they have one on JAX.
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1,
        description="Share of device memory for the whole engine (weights + KV cache); on CPU a share of "
                    "host memory. The KV cache gets what the weights leave (capped at what max_num_seqs "
                    "full-length sequences need, twice over). Default: kv_cache_memory_fraction of free memory.",
    )
    enforce_eager: bool = Field(
        False, description="Skip precompiling the buckets (debugging): programs compile on first use."
    )
    compile_in_background: bool = Field(
        False, description="Be ready once the largest bucket's programs are compiled and compile the others on a "
                           "background thread while serving; until each is ready, steps run padded to a larger "
                           "bucket that is (a server's faster start, at some speed in its first seconds). False: "
                           "every bucket is compiled before the engine is ready.",
    )
    attention_backend: Literal["auto", "xla", "pallas", "cpu"] = Field(
        "auto", description="Paged attention implementation: xla (pure JAX, every platform), pallas (servax's "
                            "Pallas kernel: TPU; on CPU it runs in Pallas interpret mode, slow, for tests), cpu "
                            "(servax's C++ kernel for XLA:CPU, built on first use with the machine's C++ compiler; "
                            "float32 caches), or auto (pallas on TPU, cpu on CPU where the kernel builds, xla "
                            "elsewhere).",
    )
    mla_prefill: Literal["auto", "absorbed", "expanded"] = Field(
        "auto", description="Multi-head latent attention (DeepSeek-V2/V3): how the tokens after a step's decodes "
                            "(prefills) attend. absorbed: queries multiplied into the latent space, as decodes always "
                            "are; expanded: the latent context expanded into per-head keys and values as it is read "
                            "(the cache keeps the latent either way); auto: the cheaper for the step, from the number "
                            "of prefill tokens (models_jax/deepseek.py). Other models ignore it.",
    )
    layered: bool = Field(
        True, validation_alias=AliasChoices("layered", "layerwise"), description="Step models a few decoder layers per call (one compiled layer program of up to "
                          "6 layers, weights read in place; runtime/ops/layered.py). False: one program per step with a "
                          "scan over stacked layer weights (XLA:CPU then copies each layer's weights per step).",
    )
    generation_config: str = Field(
        "auto", description="auto: the model's generation_config.json sets sampling defaults for fields a "
                            "request leaves unset (vLLM's default); vllm: no model defaults; or a folder "
                            "holding a generation_config.json.",
    )
    # LoRA adapters (vLLM's names; runtime/ops/lora.py).
    enable_lora: bool = Field(False, description="Serve LoRA adapters (native JAX models) beside the base model.")
    max_loras: int = Field(1, gt=0, description="Adapters resident at once, so the most in one step.")
    max_lora_rank: int = Field(16, gt=0, description="Highest adapter rank accepted (the slots' rank).")
    max_cpu_loras: int | None = Field(None, gt=0, description="Adapters kept read in host memory (>= max_loras).")
    kv_cache_dtype: str = Field(
        "auto", description="auto: the model's dtype; float32, bfloat16 or float16: K/V stored in that dtype "
                            "whatever the model's; int8 or fp8 (e4m3): stored quantized with a float32 scale per "
                            "token and head, ~4x the tokens of float32 per byte.")
    quantization: str | None = Field(
        None, description="None (weights in `dtype`; quantized GGUF tensors dequantized), int8: symmetric "
                          "per-output-channel int8 weights, or gguf: a GGUF file's Q8_0 tensors kept as int8 "
                          "and its Q4_0 / Q4_1 / Q4_K tensors as 4-bit values (native models), each with their "
                          "scale per 32 inputs (other types dequantized). On CPU the C++ matmul multiplies them as "
                          "stored; elsewhere they are dequantized inside the step (runtime/ops/quantization.py).")
    int8_activations: bool | None = Field(
        None, description="Products on int8 and 4-bit weights (quantization int8 / gguf, CPU kernels) with each "
                          "step's activations quantized to int8 per 32 inputs: integer dot products, as llama.cpp "
                          "computes: several times faster per matrix at decode batch sizes, about even on "
                          "prefills. None: on where those kernels run; False: activations stay float (the "
                          "products of the stored weights exactly, as transformers computes them dequantized).")
    speculative_config: SpeculativeConfig | None = Field(
        None, description='n-gram speculative decoding, vLLM\'s dict: {"method": "ngram", "num_speculative_tokens": '
                          'k, "prompt_lookup_max": n, "prompt_lookup_min": m} (runtime/engine/speculative.py).')
    tokenizer_mode: Literal["auto", "hf", "slow"] = "auto"
    skip_tokenizer_init: bool = Field(False, description="Load no tokenizer: prompts must be token ids.")
    hf_overrides: dict[str, Any] | None = Field(None, description="Config attributes to override.")
    runner: Literal["auto", "generate", "pooling"] = Field(
        "auto", description="generate: text generation only; pooling: embeddings / scores as well (prefill-only "
                            "requests beside generation ones; the step also returns pooled hidden states). auto: "
                            "pooling for embedding / classification architectures or a convert setting (vLLM's).")
    convert: Literal["auto", "none", "embed", "classify"] = Field(
        "auto", description="The pooling task of a pooling runner: embed (vectors) or classify (scores; with "
                            "hf_overrides classifier_from_token). auto: classify where the config names classifier "
                            "tokens or a ...ForSequenceClassification architecture, else embed.")
    pooler_config: dict[str, Any] | None = Field(
        None, description='How a pooling model pools (vLLM\'s): {"pooling_type": "LAST" | "MEAN" | "CLS", '
                          '"use_activation" (or "normalize"): true}; default LAST, normalized.')
    served_model_name: str | list[str] | None = Field(
        None, description="The name in responses and metrics (the first one, if a list); default the model."
    )
    disable_log_stats: bool = Field(False, description="Accepted for vLLM scripts; servax logs no periodic stats.")

    @model_validator(mode="before")
    @classmethod
    def _vllm_args_that_do_not_apply(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in data:
                if name in NOT_APPLICABLE:
                    raise ValueError(f"{name}: {NOT_APPLICABLE[name]}")
        return data

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

    @field_validator("distributed_executor_backend", mode="before")
    @classmethod
    def _known_backend(cls, v: Any) -> Any:
        if v in ("mp", "external_launcher"):
            raise ValueError(
                f"distributed_executor_backend={v!r} is not supported: servax starts the further processes of a "
                "multi-process engine as Ray actors ('ray'); 'uni' keeps it in one process"
            )
        return v

    @field_validator("pooler_config")
    @classmethod
    def _pooler_config_known(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        from runtime.engine.pooling import PoolerConfig

        PoolerConfig.of(v)  # raises ValueError naming the bad key or pooling type
        return v

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv_cache_dtype_known(cls, v: str) -> str:
        if v not in ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3"):
            raise ValueError(
                f"kv_cache_dtype={v!r} is not supported; use auto (the model's dtype), float32, bfloat16, float16, "
                "or int8 or fp8 (fp8_e4m3): quantized with a scale per token and head"
            )
        return v

    @field_validator("quantization")
    @classmethod
    def _known_quantization(cls, v: str | None) -> str | None:
        if v is not None and v not in ("int8", "gguf"):
            raise ValueError(
                f"quantization={v!r} is not supported yet; supported: int8 (per-output-channel int8 weights), "
                "gguf (a GGUF file's Q8_0 and 4-bit tensors kept as stored), or None for weights in `dtype`"
            )
        return v

    @field_validator("generation_config")
    @classmethod
    def _generation_config_source(cls, v: str) -> str:
        if v not in ("auto", "vllm") and not os.path.isfile(os.path.join(os.path.expanduser(v), "generation_config.json")):
            raise ValueError(
                f"generation_config must be 'auto', 'vllm' or a folder holding generation_config.json, got {v!r}"
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
