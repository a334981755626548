"""What the registry knows about a model besides its weights, once, for both model paths.

`ResolvedModel` is the checkpoint registry.resolve found (files, config, architecture,
implementation). The dtype table, the tokenizer (the checkpoint's own or another source), the
end-of-sequence ids and the context length. `registry.load` reads them into a
`ModelInfo`, which the native and the torchax loaders put on the LoadedModel unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from registry.errors import ModelLoadError

logger = logging.getLogger("servax.registry")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Where configs keep the context length, in order (GPT-2 and a few others use other names).
_MAX_LENGTH_ATTRS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
DEFAULT_MAX_MODEL_LEN = 2048


@dataclasses.dataclass
class ResolvedModel:
    """A checkpoint found on disk.

    Attributes:
        model_id: what the user asked for.
        path: the folder holding config.json and the weights.
        hf_config: the transformers PretrainedConfig; for a native model possibly its attributes as an
            earlier start recorded them (registry.hf_cache.ConfigRecord).
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


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """The LoadedModel fields that do not depend on the implementation (same names)."""

    model_id: str
    hf_config: Any
    tokenizer: Any  # a transformers tokenizer, or None: the model then serves token ids only
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    generation_config: dict[str, Any] = dataclasses.field(default_factory=dict)


def read_model_info(
    resolved: Any, *, tokenizer: str | os.PathLike | None = None, revision: str | None = None,
    tokenizer_mode: str = "auto", skip_tokenizer_init: bool = False,
) -> ModelInfo:
    """Read a resolved model's tokenizer, EOS ids, context length and sampling defaults.

    Args:
        resolved: a ResolvedModel (or any object with .model_id, .path, .hf_config and
            optionally .trust_remote_code).
        tokenizer: another tokenizer source (folder or hub ID) than the checkpoint's own;
            loaded at `revision`.
        tokenizer_mode: "auto" / "hf" (the fast tokenizer when there is one) or "slow".
        skip_tokenizer_init: load no tokenizer (the model then serves token ids only).

    Raises:
        ModelLoadError: `tokenizer` was given and cannot be loaded (the checkpoint's own
            tokenizer may be missing: the model then has none).
    """
    return ModelInfo(
        model_id=str(resolved.model_id),
        hf_config=resolved.hf_config,
        tokenizer=None if skip_tokenizer_init else read_tokenizer(
            resolved, tokenizer=tokenizer, revision=revision, tokenizer_mode=tokenizer_mode),
        max_model_len=max_model_len(resolved.hf_config),
        eos_token_ids=eos_token_ids(Path(resolved.path), resolved.hf_config),
        generation_config=sampling_defaults(Path(resolved.path)),
    )


def read_tokenizer(resolved: Any, *, tokenizer: str | os.PathLike | None = None, revision: str | None = None,
                   tokenizer_mode: str = "auto") -> Any:
    """The tokenizer of a resolved model (read_model_info's arguments): its own, or `tokenizer`;
    None (with a warning) when the model has no usable one.

    Raises:
        ModelLoadError: `tokenizer` was given and cannot be loaded.
    """
    trust = bool(getattr(resolved, "trust_remote_code", False))
    use_fast = tokenizer_mode != "slow"
    if tokenizer is not None:
        return load_tokenizer(tokenizer, trust_remote_code=trust, revision=revision, required=True,
                              use_fast=use_fast)
    tok = load_tokenizer(resolved.path, trust_remote_code=trust, use_fast=use_fast)
    if tok is None:
        logger.warning("%s: no usable tokenizer; serving token ids only", resolved.model_id)
    return tok


# generation_config.json keys that set sampling defaults -> SamplingParams' names (vLLM's list).
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(folder: Path) -> dict[str, Any]:
    """The sampling defaults a checkpoint's generation_config.json sets, under SamplingParams' names.

    vLLM applies these with `generation_config="auto"` (its default) to requests that do
    not set the field themselves. A missing or unreadable file gives no defaults.
    """
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("%s: unreadable (%s); no sampling defaults taken from it", path, e)
        return {}
    return {ours: config[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if config.get(theirs) is not None}


def jax_dtype(dtype: Any, hf_config: Any = None) -> Any:
    """The jnp dtype for a name ("float32", "bfloat16", "float16"), "auto" (the config's
    own dtype, float32 if it names none) or any dtype-like (jnp.bfloat16, ...).

    Raises:
        ModelLoadError: a dtype servax does not load models in.
    """
    if isinstance(dtype, str) and dtype == "auto":
        dtype = str(getattr(hf_config, "dtype", None) or "float32").removeprefix("torch.")
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)} or auto")
    return DTYPES[name]


def load_tokenizer(
    source: str | os.PathLike, *, trust_remote_code: bool = False, revision: str | None = None,
    required: bool = False, use_fast: bool = True,
) -> Any:
    """A transformers tokenizer from a folder or hub ID; None when there is none, unless required.

    Custom tokenizer code runs only with trust_remote_code. A local folder's tokenizer is
    built with the class AutoTokenizer chose for it at an earlier start, when recorded
    (registry.hf_cache), which spares AutoTokenizer's import of torch.

    Raises:
        ModelLoadError: `required` and it cannot be loaded.
    """
    from registry import hf_cache

    try:
        recorded = None if trust_remote_code or revision is not None else hf_cache.recorded_tokenizer_class(source)
        if recorded is not None:  # what AutoTokenizer chose before, built the way it builds it (no torch import)
            return recorded.from_pretrained(str(source), _from_auto=True)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(source), trust_remote_code=trust_remote_code,
                                                  revision=revision, use_fast=use_fast)
        if not trust_remote_code and revision is None:
            hf_cache.record_tokenizer_class(source, tokenizer)
        return tokenizer
    except (OSError, ValueError, TypeError, ImportError) as e:  # no tokenizer files, or unreadable ones
        if required:
            raise ModelLoadError(f"tokenizer {source}: cannot be loaded: {type(e).__name__}: {e}") from e
        logger.debug("no tokenizer in %s: %s", source, e)
        return None


def eos_token_ids(path: Path, hf_config: Any) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json in `path` first, then the config's eos_token_id."""
    eos = None
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def max_model_len(hf_config: Any) -> int:
    """The context length the config declares (max_position_embeddings or its other names)."""
    for attr in _MAX_LENGTH_ATTRS:
        value = getattr(hf_config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    logger.warning("the config names no context length (%s); assuming %d",
                   ", ".join(_MAX_LENGTH_ATTRS), DEFAULT_MAX_MODEL_LEN)
    return DEFAULT_MAX_MODEL_LEN
