"""What transformers made of a checkpoint's config and tokenizer, remembered between starts.

transformers 5 imports torch (2-3 s on a small CPU) with its first config class, and
`AutoTokenizer` reads the config to choose a tokenizer class. A native (models_jax) model
needs neither torch nor the config class: only the config's attribute values and which
tokenizer class to build. So the first load of a checkpoint reads both through
transformers as before and records

    config:    config.to_dict() (every attribute, defaults and normalisations applied)
    tokenizer: the import path of the class AutoTokenizer chose

under $SERVAX_CACHE/hf/ (default ~/.cache/servax/hf), keyed by the bytes of config.json,
tokenizer_config.json, the names and sizes of the folder's other files and the
transformers version. Later starts of a native model read the record instead and import
no torch. The torchax path and checkpoints with remote code always use transformers
itself (the first builds the transformers model from the real config; the second runs
the checkpoint's own classes). A record that cannot be read or written is ignored: the
cache only ever saves time.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger("servax.registry")

RECORD_VERSION = 1
_KEY_FILES = ("config.json", "tokenizer_config.json")


class ConfigRecord:
    """A transformers config's attributes as `to_dict()` gave them, read back from the record.

    Stands in for the PretrainedConfig on the native path: attributes read the same
    (`getattr(config, "head_dim", None)`, `config.rope_parameters`, ...), may be set
    (hf_overrides), and `to_dict()` returns them all.
    """

    def __init__(self, values: dict[str, Any]):
        self.__dict__.update(values)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"ConfigRecord({json.dumps(self.__dict__, sort_keys=True, default=str)})"


def cache_dir() -> Path:
    from registry.tiny import cache_root

    return cache_root() / "hf"


def transformers_version() -> str | None:
    """The installed transformers version, read without importing transformers."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def _key(folder: Path, kind: str) -> str | None:
    """The record name for `folder` (None: not a local folder, or unreadable)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    digest = hashlib.sha256(f"{RECORD_VERSION}|{kind}|{transformers_version()}".encode())
    try:
        for name in _KEY_FILES:
            path = folder / name
            digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"-") + b"\0")
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.name not in _KEY_FILES and entry.is_file():
                digest.update(f"{entry.name}:{entry.stat().st_size}\0".encode())
    except OSError:
        return None
    return f"{kind}-{digest.hexdigest()[:32]}"


def _read(key: str | None) -> dict | None:
    if key is None:
        return None
    try:
        return json.loads((cache_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


def _write(key: str | None, record: dict) -> None:
    if key is None:
        return
    try:
        directory = cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, directory / f"{key}.json")  # atomic: concurrent starts never read half a record
    except (OSError, TypeError, ValueError) as e:
        logger.debug("not recording %s: %s", key, e)


def recorded_config(folder: Path) -> ConfigRecord | None:
    """The config recorded for this checkpoint folder by an earlier start, or None."""
    record = _read(_key(folder, "config"))
    return None if record is None else ConfigRecord(record)


def record_config(folder: Path, config: Any) -> None:
    """Remember a transformers config read from `folder` (its to_dict())."""
    try:
        values = json.loads(json.dumps(config.to_dict()))  # JSON-clean, as save_pretrained writes it
    except (TypeError, ValueError) as e:
        logger.debug("config of %s not recorded: %s", folder, e)
        return
    _write(_key(folder, "config"), values)


def recorded_tokenizer_class(folder: str | os.PathLike) -> type | None:
    """The tokenizer class AutoTokenizer chose for this folder at an earlier start, or None."""
    record = _read(_key(Path(folder), "tokenizer"))
    if record is None:
        return None
    try:
        return getattr(importlib.import_module(record["module"]), record["name"])
    except (ImportError, AttributeError, KeyError) as e:
        logger.debug("recorded tokenizer class of %s unusable: %s", folder, e)
        return None


def record_tokenizer_class(folder: str | os.PathLike, tokenizer: Any) -> None:
    """Remember which class AutoTokenizer built for `folder` (transformers' own classes only)."""
    cls = type(tokenizer)
    if not cls.__module__.startswith("transformers."):
        return  # remote code: AutoTokenizer must fetch and trust it each time
    _write(_key(Path(folder), "tokenizer"), {"module": cls.__module__, "name": cls.__qualname__})
