"""Errors the registry raises while it finds and loads a model."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be resolved or loaded: missing path, no config, unsupported architecture."""
