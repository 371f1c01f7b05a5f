"""The patched vLLM OpenAI app the API-patch tests drive, and raw HTTP against it.

Imported only inside the subprocess tests/api_patches_report.py runs (vLLM comes from the
patched tree there) and, for the constants, by the test_api_patches*.py files.
"""

from __future__ import annotations

import json

KEY = "sk-hyperqwen-test"
SERVED_MODELS = ("qwen-a", "qwen-b")
BODY_LIMIT = 4096
KEEP_ALIVE_S = 0.05
KEEP_ALIVES_PER_GAP = 2
GAP_LIMIT_S = 30.0
"""A quiet gap of the test stream ends when the reader has seen KEEP_ALIVES_PER_GAP keep-alives
in it, or after this long (then the test fails on the count)."""
ALLOWED_ORIGIN = "https://ui.example"
KEYLESS_PATHS = ("/", "/health", "/ping", "/version")
# Spellings that must not reach a keyless route without the key: the router either sends them
# to a guarded handler or to none, and the middleware must deny them either way.
GUARDED_SPELLINGS = (
    "//v1/models",
    "/./v1/models",
    "/v1/../v1/models",
    "/%761/models",
    "/v1%2Fmodels",
    "/V1/models",
    "/v1/models/",
    "/health/../v1/models",
    "/health/%2e%2e/v1/models",
    "/health/",
    "/health/.",
    "//health",
    "/./health",
    "/HEALTH",
    "/%68ealth",
    "/health%2F",
    "/v1/models?x=/health",
    "/v1/models#/health",
    "/metrics/",
    "/metrics?x=/health",
    "/tokenize?next=/ping",
    "http://127.0.0.1/health/../v1/models",
)
# A query string on a keyless path changes nothing: it is still that keyless route.
KEYLESS_SPELLINGS = ("/health?x=/v1", "/ping?next=/v1/models", "/version?x=1", "/?a=/v1")
# Headers a proxy-aware app might trust; the middleware must not.
HEADER_TRICKS = {
    "host": {"Host": "127.0.0.1/health"},
    "x-original-url": {"X-Original-URL": "/health"},
    "x-forwarded-prefix": {"X-Forwarded-Prefix": "/health"},
    "x-forwarded-path": {"X-Forwarded-Path": "/health"},
    "wrong-key": {"Authorization": "Bearer not-the-key"},
    "basic-scheme": {"Authorization": f"Basic {KEY}"},
    "key-without-scheme": {"Authorization": KEY},
    "key-in-other-header": {"X-API-Key": KEY},
}
# --- runs in the subprocess -------------------------------------------------------------------


def parse_serve_args(*argv: str):
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser()).parse_args(list(argv))


def model_args(checkpoint: str) -> list[str]:
    return [
        "--model",
        checkpoint,
        "--served-model-name",
        *SERVED_MODELS,
        "--language-model-only",
        "--load-format",
        "dummy",
        "--max-model-len",
        "2048",
    ]


def serving_app(checkpoint: str):
    """The real app with `vllm serve`'s middleware and the CPU render state (no engine), plus
    test routes that stream the way the engine-backed routes do."""
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.api_server import build_app, init_render_app_state

    args = parse_serve_args(
        *model_args(checkpoint),
        "--api-key",
        KEY,
        "--allowed-origins",
        json.dumps([ALLOWED_ORIGIN]),
        "--sse-keep-alive-interval",
        str(KEEP_ALIVE_S),
        "--max-request-body-bytes",
        str(BODY_LIMIT),
    )
    vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    app = build_app(args, ("generate",), vllm_config.model_config)
    _add_streaming_test_routes(app)
    asyncio.run(init_render_app_state(vllm_config, app.state, args))
    return app


def recording_gaps_stream(app):
    """`app` wrapped outside every middleware: the body messages of /hq-test/gaps, each with
    the event loop's time (the clock the keep-alive middleware paces by) as it left the app,
    go to app.state.hq_gaps_sent."""
    import asyncio

    app.state.hq_gaps_sent = []

    async def recorded(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/hq-test/gaps":
            return await app(scope, receive, send)

        async def recording_send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                at = asyncio.get_running_loop().time()
                app.state.hq_gaps_sent.append([at, message["body"].decode()])
            await send(message)

        return await app(scope, receive, recording_send)

    return recorded


def _add_streaming_test_routes(app) -> None:
    import asyncio

    from fastapi.responses import StreamingResponse

    async def quiet_until(release) -> None:
        """Stay silent until the reader sets `release` (a threading.Event), GAP_LIMIT_S at
        most."""
        deadline = asyncio.get_running_loop().time() + GAP_LIMIT_S
        while not release.is_set() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    def event_stream(*parts):
        """Yield each str part; a float part is a pause of that many seconds."""

        async def generate():
            for part in parts:
                if isinstance(part, float):
                    await asyncio.sleep(part)
                else:
                    yield part

        return StreamingResponse(generate(), media_type="text/event-stream")

    def chunk(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    # Two quiet gaps, each until the reader has seen keep-alives in it; none between 2 and 3.
    @app.get("/hq-test/gaps")
    async def gaps():
        first_gap, second_gap = app.state.hq_gap_releases

        async def generate():
            yield "data: 1\n\n"
            await quiet_until(first_gap)
            yield "data: 2\n\n"
            yield "data: 3\n\n"
            await quiet_until(second_gap)
            yield "data: [DONE]\n\n"

        return StreamingResponse(generate(), media_type="text/event-stream")

    @app.get("/hq-test/split-event")
    async def split_event():
        return event_stream('data: {"part": ', 0.3, "1}\n\n", "data: [DONE]\n\n")

    @app.get("/hq-test/abandoned")
    async def abandoned():
        async def generate():
            try:
                yield "data: 1\n\n"
                await asyncio.sleep(3600)  # only the client hanging up ends it
                yield "data: never\n\n"
            finally:
                app.state.hq_abandoned_closed = True

        return StreamingResponse(generate(), media_type="text/event-stream")

    # Like the engine-backed routes: silent "prefill", then tokens, usage, [DONE].
    @app.post("/hq-test/v1/completions")
    async def completions():
        tokens = [chunk({"choices": [{"index": 0, "text": t}]}) for t in "abc"]
        usage = chunk({"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 1}})
        return event_stream(0.3, tokens[0], 0.12, *tokens[1:], usage, "data: [DONE]\n\n")

    @app.post("/hq-test/v1/chat/completions")
    async def chat_completions():
        tokens = [chunk({"choices": [{"index": 0, "delta": {"content": t}}]}) for t in "abc"]
        usage = chunk({"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 1}})
        return event_stream(0.3, tokens[0], 0.12, *tokens[1:], usage, "data: [DONE]\n\n")


def keyed(headers: dict | None = None) -> dict:
    return {**(headers or {}), "Authorization": f"Bearer {KEY}"}


def call(port: int, method: str, target: str, headers: dict | None = None, body=None):
    """(status, lower-cased headers, body) of one request sent exactly as given: http.client
    does not normalize the target, so dot segments and %-escapes reach the server."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, target, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data
    finally:
        connection.close()


def json_call(port: int, target: str, payload: dict) -> tuple[int, dict]:
    status, _, data = call(
        port, "POST", target, keyed({"Content-Type": "application/json"}), json.dumps(payload)
    )
    return status, json.loads(data)


def read_until_closed(connection) -> bytes:
    received = b""
    while data := connection.recv(65536):
        received += data
    return received


def raw_exchange(port: int, head: bytes) -> bytes:
    """Send a raw request head (asking for Connection: close) and nothing else; return
    everything the server sent until it closed."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(head)
        return read_until_closed(connection)


def status_of(raw_response: bytes) -> int:
    return int(raw_response.split(b" ", 2)[1])


def read_stream(port: int, target: str, stop_after: int | None = None, on_line=None) -> dict:
    """Non-blank lines of an event stream, each passed to `on_line` as it arrives."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", target, headers=keyed())
    response = connection.getresponse()
    lines = []
    while (stop_after is None or len(lines) < stop_after) and (raw := response.readline()):
        if raw.strip():
            lines.append(raw.decode().rstrip("\n"))
            if on_line:
                on_line(lines[-1])
    connection.close()
    return {"status": response.status, "type": response.getheader("content-type"), "lines": lines}


def app_for(*argv: str):
    from vllm.entrypoints.openai.api_server import build_app

    return build_app(parse_serve_args("--model", "m", *argv), ("generate",), None)
