"""How the OpenAI ingress answers a failure: its error bodies, statuses and exception handlers.

`APIError` is what a route raises to answer with an error; `json_error` is the error's JSON
response (OpenAI's shape, or Anthropic's for the Messages API); `server_error` maps what a
handle call raised (the engine's own errors, Serve's full queue, a dead replica) to its
status; `add_error_handlers` makes FastAPI answer APIError, request validation errors
(each as `param: what is wrong (got value)`) and HTTP errors in those shapes.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.anthropic_reply import anthropic_error_body
from app.openai_responses import ErrorResponse, error_response

logger = logging.getLogger("ray.serve")
ANTHROPIC_PREFIX = "/v1/messages"


class APIError(Exception):
    """Raised inside a route to answer with an OpenAI error body."""

    def __init__(self, response: ErrorResponse):
        super().__init__(response.error.message)
        self.response = response


def json_error(err: ErrorResponse, anthropic: bool = False) -> JSONResponse:
    """The error's JSON response, in OpenAI's shape or (for the Messages API) Anthropic's."""
    # 429 and 503 are worth retrying: say when (clients such as openai's honour Retry-After).
    headers = {"Retry-After": "1"} if err.status_code in (429, 503) else None
    body = anthropic_error_body(err) if anthropic else err.model_dump()
    return JSONResponse(body, status_code=err.status_code, headers=headers)


def is_anthropic(request: Request) -> bool:
    """The request is to Anthropic's Messages API: its errors take Anthropic's shape."""
    return request.url.path.startswith(ANTHROPIC_PREFIX)


def unwrap(exc: BaseException) -> BaseException:
    """The original exception behind a Ray task error (RayTaskError keeps it as `.cause`)."""
    return getattr(exc, "cause", None) or exc


def server_error(exc: BaseException) -> ErrorResponse:
    """The error a failed handle call answers with: the engine's own error, 429 for Serve's full
    queue, 503 for a replica that died under the request, else 500 (logged)."""
    cause = unwrap(exc)
    err = error_response(cause)
    if err is not None:
        return err
    if isinstance(cause, BackPressureError):  # Serve's queue for the model (max_queued_requests) is full
        return ErrorResponse.make(429, f"the model's request queue is full: {cause.message} Retry later.",
                                  type="rate_limit_error", code="rate_limit_exceeded")
    if isinstance(cause, (RayActorError, ActorUnavailableError)):  # the replica died under the request
        logger.warning("servax: a model replica died under a request: %s", cause)
        return ErrorResponse.make(503, "the model replica serving this request died; retry (Serve is "
                                  "replacing it)", type="server_error", code="replica_unavailable")
    logger.exception("servax: request failed", exc_info=exc)
    return ErrorResponse.make(500, f"internal error: {type(cause).__name__}: {cause}", type="server_error")


# pydantic names union members and validators in an error's location (`prompt.str`,
# `prompt.list[int]`, `function-after[...]`); the client's parameter is the rest.
_NOT_A_FIELD = re.compile(r"^(str|int|float|bool|none|dict|list|function-\w+)(\[.*\])?$")


def _param_of(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body" and not _NOT_A_FIELD.match(str(p))]
    return ".".join(parts) or None


def _error_text(error: dict[str, Any]) -> str:
    """One validation error as `param: what is wrong (got value)`; the value only when it is a
    scalar, and cut short (the bound is in pydantic's message: "less than or equal to ...")."""
    param = getattr((error.get("ctx") or {}).get("error"), "param", None) or _param_of(tuple(error.get("loc", ())))
    text = f"{param or 'body'}: {error.get('msg', '').removeprefix('Value error, ')}"
    value = error.get("input")
    if isinstance(value, (int, float, str)) and not isinstance(value, bool) and error.get("type") != "missing":
        try:
            shown = repr(value)
        except ValueError:  # an int past Python's digit limit for str()
            shown = f"an integer of more than {sys.get_int_max_str_digits()} digits"
        text += f" (got {shown[:80] + '...' if len(shown) > 80 else shown})"
    return text


def add_error_handlers(api: FastAPI) -> None:
    """Answer APIError, request validation errors and HTTP errors (404, 405, ...) as JSON errors
    in OpenAI's shape, or Anthropic's under ANTHROPIC_PREFIX."""

    @api.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return json_error(exc.response, is_anthropic(request))

    @api.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        anthropic = is_anthropic(request)
        if first.get("type") == "json_invalid":
            return json_error(ErrorResponse.make(400, f"request body is not valid JSON: {first.get('msg')}"),
                              anthropic)
        cause = (first.get("ctx") or {}).get("error")  # a validator's InvalidRequestError names its field
        param = getattr(cause, "param", None) or _param_of(tuple(first.get("loc", ())))
        if param is None and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
            return json_error(ErrorResponse.make(400, "request body must be a JSON object"), anthropic)
        return json_error(ErrorResponse.make(400, "; ".join(_error_text(e) for e in errors), param=param), anthropic)

    @api.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return json_error(ErrorResponse.make(exc.status_code, str(exc.detail), type=kind), is_anthropic(request))
