"""Errors the engine raises at its edge. The app maps each to an HTTP status."""

from __future__ import annotations

from collections.abc import Iterable


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


def check_token_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    """Refuse token ids outside [0, vocab_size): the error names them all (the first ten) and the bound.

    Raises:
        InvalidRequestError: some id is out of the vocabulary (.param is `param`).
    """
    bad = sorted({t for t in token_ids if t < 0 or t >= vocab_size})
    if bad:
        shown = bad if len(bad) <= 10 else [*bad[:10], "..."]
        raise InvalidRequestError(
            f"token id(s) {shown} in {param} are out of vocabulary: ids must be in [0, {vocab_size})", param=param)
