"""The API server's request body limit: a body over `--max-request-body-bytes` answers 413.

patches/request-body-limit.patch registers the flag with vLLM's parser and adds this middleware
to vLLM's app just before CORSMiddleware, so it runs inside CORS (a 413 carries CORS headers),
a place vLLM's `--middleware` (outermost) cannot put it. It answers before any route parses the
body, so one oversized request can neither exhaust the API process's memory nor hold up others.

It imports only what vLLM's API server itself runs on (Starlette, FastAPI).
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import HTTPException
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

TOO_LARGE = HTTPStatus.REQUEST_ENTITY_TOO_LARGE


class RequestBodyLimitMiddleware:
    """Pure ASGI middleware that answers 413 to a request body larger than `max_bytes`.

    A Content-Length over the limit is answered at once, without reading the body. Otherwise
    the bytes the route receives are counted and HTTPException(413) is raised as soon as they
    pass the limit (chunked uploads): FastAPI re-raises it from body parsing and vLLM's
    http_exception_handler answers it, in the same OpenAI error shape as the answer here.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.message = (
            f"Request body larger than {max_bytes} bytes, the server's limit; "
            "raise it with --max-request-body-bytes."
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            # The shape vLLM's http_exception_handler gives the counted path's HTTPException.
            error = {"message": self.message, "type": TOO_LARGE.phrase, "param": None}
            response = JSONResponse({"error": {**error, "code": TOO_LARGE.value}}, TOO_LARGE)
            await response(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(TOO_LARGE, self.message)
            return message

        await self.app(scope, counting_receive, send)
