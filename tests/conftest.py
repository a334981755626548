"""Shared fixtures. Keep this small and generic: every test file may lean on it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Tests import the top-level packages (runtime, registry, ...) from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session")
def servax_cache(tmp_path_factory) -> Path:
    """The servax cache for this test session: $SERVAX_CACHE if set, else a session tmp dir.

    It is exported as SERVAX_CACHE, so model IDs like `servax-tiny/llama` given to
    `registry.resolve/load` land in the same place.
    """
    root = os.environ.get("SERVAX_CACHE")
    if not root:
        root = str(tmp_path_factory.mktemp("servax_cache"))
        os.environ["SERVAX_CACHE"] = root
    return Path(root)


@pytest.fixture(scope="session")
def tiny_checkpoint(servax_cache):
    """Factory: tiny_checkpoint("llama") -> Path of the materialised `servax-tiny/llama` folder."""
    from registry.tiny import TINY_PREFIX, tiny_checkpoint_path

    def make(name: str) -> Path:
        return tiny_checkpoint_path(TINY_PREFIX + name)

    return make
