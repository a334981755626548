"""Model ID -> files on disk, Hugging Face config and architecture.

Sources, in order: a local folder; `servax-tiny/<name>` (generated deterministically, no
network); otherwise a Hugging Face hub repo ID (downloaded into the hub cache, or found
there when HF_HUB_OFFLINE is set).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from runtime.errors import ModelLoadError

HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
IMPLS = ("auto", "jax", "torchax")


@dataclasses.dataclass
class ResolvedModel:
    """A checkpoint found on disk.

    Attributes:
        model_id: what the user asked for.
        path: the folder holding config.json and the weights.
        hf_config: the transformers PretrainedConfig.
        architecture: config.architectures[0], e.g. "LlamaForCausalLM".
        impl: "jax" (a native models_jax model) or "torchax" (wrapped transformers model).
        trust_remote_code: whether the checkpoint's own modelling code may run (torchax path).
    """

    model_id: str
    path: Path
    hf_config: Any
    architecture: str
    impl: str
    trust_remote_code: bool = False


def resolve(
    model_id: str | os.PathLike, *, impl: str = "auto", revision: str | None = None,
    trust_remote_code: bool = False,
) -> ResolvedModel:
    """Find a model's files and decide which implementation serves it.

    impl: "auto" picks the native JAX model when the architecture has one, else torchax;
    "jax" insists on a native model; "torchax" forces the fallback.

    Raises:
        ModelLoadError: the path does not exist, has no config.json, the hub ID cannot be
            fetched, or impl="jax" names an architecture without a native model.
    """
    from registry.native import NATIVE_MODELS

    if impl not in IMPLS:
        raise ModelLoadError(f"impl must be one of {IMPLS}, got {impl!r}")
    model_id = str(model_id)
    path = _find_files(model_id, revision)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{model_id}: no config.json in {path}; is it a Hugging Face checkpoint folder?")
    import transformers

    try:
        hf_config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many kinds; the user needs the path and the cause
        raise ModelLoadError(f"{model_id}: cannot read {path / 'config.json'}: {e}") from e
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ModelLoadError(f"{model_id}: config.json names no architectures")
    architecture = architectures[0]
    native = architecture in NATIVE_MODELS
    if impl == "jax" and not native:
        raise ModelLoadError(
            f"{model_id}: architecture {architecture} has no native JAX model; "
            f"native: {', '.join(sorted(NATIVE_MODELS))}. Use impl='auto' or 'torchax'."
        )
    chosen = "jax" if impl == "jax" or (impl == "auto" and native) else "torchax"
    return ResolvedModel(model_id, path, hf_config, architecture, chosen, trust_remote_code)


def _find_files(model_id: str, revision: str | None) -> Path:
    from registry.tiny import TINY_PREFIX, TINY_CONFIGS, tiny_checkpoint_path

    local = Path(model_id).expanduser()
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
