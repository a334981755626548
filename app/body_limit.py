"""BodySizeLimit: the HTTP front's limit on request bodies (a 413 in OpenAI's error shape, or
Anthropic's on its Messages API)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.anthropic_reply import anthropic_error_body
from app.openai_responses import ErrorResponse

# Largest request body accepted: 16 MiB holds a max-length prompt of any model many times
# over; beyond it the ingress answers 413 before reading further.
MAX_REQUEST_BODY_BYTES = 16 * 2**20


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds {limit} bytes")


class BodySizeLimit:
    """ASGI middleware: a 413 OpenAI error for bodies over `limit` bytes, by Content-Length
    when the client sends one, else counted as the body streams in (nothing more is read)."""

    def __init__(self, app: Any, limit: int = MAX_REQUEST_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            error = ErrorResponse.make(413, f"request body exceeds {self.limit} bytes")
            anthropic = scope.get("path", "").startswith("/v1/messages")  # Anthropic's error shape there
            body = anthropic_error_body(error) if anthropic else error.model_dump()
            return await JSONResponse(body, status_code=413)(scope, receive, send)
        received = 0

        async def limited() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited, send)
