"""Errors the engine raises at its edge. The app maps each to an HTTP status."""

from __future__ import annotations


class ServaxError(Exception):
    """Base of servax's own errors."""


class InvalidRequestError(ServaxError, ValueError):
    """A request the engine cannot accept as given (HTTP 400).

    Attributes:
        param: the name of the offending parameter, when there is one.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus requested tokens) does not fit the model's context (HTTP 400)."""


class EngineOverloadedError(ServaxError):
    """The waiting queue is full; retry later (HTTP 429)."""


class EngineDeadError(ServaxError):
    """The engine loop has stopped; the replica must be replaced (HTTP 503)."""
