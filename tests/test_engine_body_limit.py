"""RequestBodyLimitMiddleware (engine/body_limit.py) on a bare ASGI app, driven in memory.

The app below reads the whole body and answers 200 with its length; each case hands the
middleware a scope and a scripted list of body messages and records what the app received and
what went out. Its place in vLLM's app (inside CORS, following the flag) and the 413 through
vLLM's exception handler are tests/test_api_patches.py's and
tests/test_api_patches_requests.py's.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import HTTPException

from hyperqwen.engine.body_limit import RequestBodyLimitMiddleware

LIMIT = 100


class BodyReadingApp:
    """Reads every body message, then answers 200 with the number of bytes it got."""

    def __init__(self) -> None:
        self.scopes: list[dict] = []
        self.received = 0

    async def __call__(self, scope, receive, send) -> None:
        self.scopes.append(scope)
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            self.received += len(message.get("body", b""))
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(self.received).encode()})


def _exchange(pieces: list[bytes], content_length: int | None = None, scope_type="http"):
    """(the app, the messages sent back, how many body messages were read) for one request."""
    app = BodyReadingApp()
    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    scope = {"type": scope_type, "method": "POST", "path": "/tokenize", "headers": headers}
    body = [
        {"type": "http.request", "body": piece, "more_body": i < len(pieces) - 1}
        for i, piece in enumerate(pieces)
    ]
    read = 0
    sent: list[dict] = []

    async def receive():
        nonlocal read
        read += 1
        return body[read - 1]

    async def send(message):
        sent.append(message)

    asyncio.run(RequestBodyLimitMiddleware(app, max_bytes=LIMIT)(scope, receive, send))
    return app, sent, read


def _answer(sent: list[dict]) -> tuple[int, dict[bytes, bytes], bytes]:
    start, body = sent
    return start["status"], dict(start["headers"]), body["body"]


def test_a_declared_oversized_body_is_answered_413_without_reading_it():
    app, sent, read = _exchange([b"x" * (LIMIT + 1)], content_length=LIMIT + 1)
    status, headers, body = _answer(sent)
    assert status == 413
    assert headers[b"content-type"] == b"application/json"
    assert json.loads(body) == {
        "error": {
            "message": f"Request body larger than {LIMIT} bytes, the server's limit; "
            "raise it with --max-request-body-bytes.",
            "type": "Request Entity Too Large",
            "param": None,
            "code": 413,
        }
    }
    assert read == 0  # the body was never read
    assert app.scopes == []  # nor did the request reach the app


@pytest.mark.parametrize("content_length", [LIMIT, None])
def test_a_body_at_the_limit_reaches_the_app_whole(content_length):
    pieces = [b"x" * 40, b"x" * 40, b"x" * 20]
    app, sent, read = _exchange(pieces, content_length=content_length)
    assert _answer(sent)[::2] == (200, b"100")
    assert (app.received, read) == (100, 3)


def test_a_counted_body_is_refused_on_the_message_that_passes_the_limit():
    pieces = [b"x" * 60, b"x" * 41, b"x" * 10]
    with pytest.raises(HTTPException) as refused:
        _exchange(pieces)
    assert refused.value.status_code == 413
    assert "--max-request-body-bytes" in refused.value.detail


def test_the_counted_refusal_comes_before_the_rest_is_read():
    app = BodyReadingApp()
    reads = []

    async def receive():
        reads.append(len(reads))
        return {"type": "http.request", "body": b"x" * 60, "more_body": True}

    async def send(message):
        raise AssertionError(f"nothing may be sent: {message}")

    scope = {"type": "http", "headers": []}
    with pytest.raises(HTTPException):
        asyncio.run(RequestBodyLimitMiddleware(app, max_bytes=LIMIT)(scope, receive, send))
    assert reads == [0, 1]  # 60 bytes pass, 120 are refused: no third read


@pytest.mark.parametrize("declared", ["", "12abc", "-5"])
def test_a_content_length_that_is_no_number_is_counted_instead(declared):
    app = BodyReadingApp()
    scope = {"type": "http", "headers": [(b"content-length", declared.encode())]}
    messages = iter([{"type": "http.request", "body": b"x" * (LIMIT + 1)}])
    sent: list[dict] = []

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    with pytest.raises(HTTPException):
        asyncio.run(RequestBodyLimitMiddleware(app, max_bytes=LIMIT)(scope, receive, send))
    assert sent == []


@pytest.mark.parametrize("scope_type", ["websocket", "lifespan"])
def test_other_scopes_pass_through_untouched(scope_type):
    app, sent, read = _exchange([b"x" * (LIMIT + 1)], LIMIT + 1, scope_type=scope_type)
    assert [scope["type"] for scope in app.scopes] == [scope_type]
    assert (sent, read) == ([], 0)
