"""Compiled programs kept whole on disk, so that a warm start neither traces nor lowers.

JAX's persistent compilation cache (runtime/compilation.py) saves XLA's work, but its key
is the lowered program: a new process still traces and lowers every bucket to find it,
about half of a warm start on the demo model (7 of 14 s). This cache writes each compiled
program whole (a serialized executable, `jax.experimental.serialize_executable`) under a
key computed without tracing, from

- what the program computes: servax's own source (runtime/, models_jax/, registry/), the
  versions of jax, jaxlib, transformers and torch, XLA_FLAGS and the devices, the model's
  static description (implementation, config, the repr of its step functions), and the
  program's name and static arguments;
- what it is called with: the argument tree and every leaf's shape, dtype and sharding.

A change to any of them is another key, so a stale program is never loaded: it is compiled
again (from XLA's cache if its HLO did not change) and saved. An entry that fails to load
(a truncated file, a jaxlib that rejects it) is compiled as if absent.

An executable that XLA's persistent cache handed back cannot be saved again (JAX 0.10's
serializer drops its kernels: the copy fails to run with "Function ... not found"), so an
engine with this cache keeps XLA's cache off and compiles its programs itself; a program
that came from XLA's cache anyway (another engine of the process turned it on) is used but
not saved (`compile_fresh` tells which).

Single-process engines only: an executable of a mesh over several processes holds only
this process's part, and is not saved; those engines use XLA's cache.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import threading
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger("servax.engine")

_PACKAGES = ("runtime", "models_jax", "registry")
_ROOT = Path(__file__).resolve().parents[1]
# Bumped when the entry format changes.
_FORMAT = 1


_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_local = threading.local()


def _on_event(event: str, **_: object) -> None:
    if event == _HIT_EVENT:
        _local.hits = getattr(_local, "hits", 0) + 1


jax.monitoring.register_event_listener(_on_event)


def compile_fresh(lowered: Any) -> tuple[Any, bool]:
    """(lowered.compile(), whether XLA compiled it here rather than load it from its cache)."""
    before = getattr(_local, "hits", 0)
    compiled = lowered.compile()
    return compiled, getattr(_local, "hits", 0) == before


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """sha256 over servax's own program-defining source files (names and contents)."""
    h = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((_ROOT / package).rglob("*.py")):
            h.update(str(path.relative_to(_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _versions() -> str:
    import jaxlib

    found = [f"jax={jax.__version__}", f"jaxlib={jaxlib.__version__}"]
    for name in ("transformers", "torch", "torchax"):
        try:
            from importlib.metadata import version

            found.append(f"{name}={version(name)}")
        except Exception:  # not installed: nothing of it can be in a program
            found.append(f"{name}=-")
    return ",".join(found)


def _without_addresses(text: str) -> str:
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def model_description(model: Any) -> str:
    """The static side of a runtime.step.LoadedModel: what its step functions compute
    besides their arguments (config, implementation, the functions themselves)."""
    cfg = model.hf_config
    config = cfg.to_json_string(use_diff=False) if hasattr(cfg, "to_json_string") else repr(cfg)
    parts = [
        model.impl, model.model_id, config, str(getattr(cfg, "_attn_implementation", None)),
        repr(model.kv_spec), repr(model.stages), repr(model.step_fn), repr(sorted(model.lora_targets or {})),
    ]
    return _without_addresses("\n".join(parts))


def _describe_leaf(leaf: Any) -> str:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        sharding = getattr(leaf, "sharding", None)
        where = "host"
        if sharding is not None:
            where = f"{sharding!r}@{sorted(d.id for d in sharding.device_set)}"
        return f"{tuple(leaf.shape)}:{leaf.dtype}:{where}"
    return repr(leaf)


def describe_arguments(*trees: Any) -> str:
    """The calling side of a program: argument trees with each leaf's shape, dtype, sharding."""
    leaves, treedef = jax.tree.flatten(trees)
    return _without_addresses(str(treedef) + "\n" + "\n".join(_describe_leaf(x) for x in leaves))


class ProgramCache:
    """Serialized executables in `directory`, keyed as the module docstring describes.

    Args:
        directory: where entries live (created on first save).
        model: the runtime.step.LoadedModel whose programs these are.
    """

    def __init__(self, directory: str, model: Any):
        self.directory = Path(directory)
        devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
        self._base = "\n".join([
            f"format={_FORMAT}", _source_digest(), _versions(), os.environ.get("XLA_FLAGS", ""),
            repr(devices), f"x64={jax.config.jax_enable_x64}",
            f"precision={jax.config.jax_default_matmul_precision}", model_description(model),
        ])
        self.loaded = 0
        self.saved = 0

    @classmethod
    def for_engine(cls, compilation_cache_dir: str | None, model: Any, multi_process: bool) -> "ProgramCache | None":
        """The cache beside the persistent XLA cache, or None (that cache off, or a mesh
        over several processes)."""
        if not compilation_cache_dir or multi_process or jax.process_count() > 1:
            return None
        return cls(os.path.join(compilation_cache_dir, "servax-programs"), model)

    def key(self, name: str, *trees: Any, static: Any = None) -> str:
        """The entry name of program `name` called with `trees` (and static arguments)."""
        text = "\n".join([self._base, name, repr(static), describe_arguments(*trees)])
        return hashlib.sha256(text.encode()).hexdigest()

    def load(self, key: str) -> list | None:
        """The compiled programs saved under `key`, ready to call; None if there are none."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self.directory / f"{key}.pkl"
        if not path.exists():
            return None
        try:
            with open(path, "rb") as f:
                entries = pickle.load(f)
            programs = [deserialize_and_load(payload, in_tree, out_tree) for payload, in_tree, out_tree in entries]
        except Exception as e:  # unreadable: compile again and overwrite
            logger.warning("servax program cache: %s could not be loaded (%s); compiling it again", path.name, e)
            return None
        self.loaded += len(programs)
        return programs

    def save(self, key: str, programs: list) -> None:
        """Write compiled programs under `key` (atomically; a failure only logs). Only
        programs compiled in this process can be saved (see `compile_fresh`)."""
        from jax.experimental.serialize_executable import serialize

        path = self.directory / f"{key}.pkl"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            data = pickle.dumps([serialize(p) for p in programs])
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except Exception as e:
            logger.warning("servax program cache: could not save %s (%s); the next start compiles it again",
                           path.name, e)
            return
        self.saved += len(programs)
