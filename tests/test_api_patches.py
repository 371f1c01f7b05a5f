"""The API and robustness patches of the series, on the real vLLM OpenAI app (CPU).

Covered: api-key-deny-by-default, unknown-model-404, request-body-limit, bench-sse-comments,
sse-keep-alive and engine-stall-sentinel, plus malformed JSON, which vLLM 0.26.0 already
answers with 400 (no patch needed; checked here).

The whole series is applied to a pristine vLLM unpacked from the pinned wheel. One subprocess
(this file run as a script, with the patched tree first on sys.path and the CPU platform
selected) builds the real app with `build_app` and the CPU render state of a tiny synthesized
Qwen3.5 checkpoint (`init_render_app_state`: real tokenizer, real model registry, no engine),
serves it with uvicorn on a local port, sends raw HTTP requests at it, reads the stall
sentinel's knob from the patched vllm.envs, runs `vllm bench serve`'s request functions (patched
and pristine) against it, and writes one JSON report. The tests below assert on that report case
by case. The patches' own classes are tested in their modules' files:
tests/test_engine_body_limit.py and tests/test_engine_stall_sentinel.py.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from local_server import serving

from hyperqwen.settings import PINNED_VLLM

ROOT = Path(__file__).resolve().parents[1]
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
# Everything below up to the pytest section runs in a fresh interpreter that imports vLLM from
# the patched tree: `python tests/test_api_patches.py PATCHED_PARENT PRISTINE_VLLM CKPT REPORT`.


def _drive(patched_parent: str, pristine_vllm: str, checkpoint: str) -> dict:
    sys.path.insert(0, patched_parent)
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    import vllm

    report: dict = {"vllm_file": vllm.__file__}
    # First: vLLM loads help texts only if "--help" was in sys.argv when it first imported
    # vllm.engine.arg_utils, as in a real `vllm serve --help` process.
    report["cli"] = _cli_checks()
    report["sentinel"] = _sentinel_checks()
    app = _serving_app(checkpoint)
    with serving(_recording_gaps_stream(app), log_level="critical") as port:
        report["routes"] = _route_matrix(app, port)
        report["spellings"] = {
            target: [_call(port, "GET", target)[0], _call(port, "GET", target, _keyed())[0]]
            for target in (*GUARDED_SPELLINGS, *KEYLESS_SPELLINGS)
        }
        report["header_tricks"] = {
            name: _call(port, "GET", "/v1/models", headers)[0]
            for name, headers in HEADER_TRICKS.items()
        }
        report["bearer_scheme_any_case"] = _call(
            port, "GET", "/v1/models", {"Authorization": f"bEaReR {KEY}"}
        )[0]
        report["cors"] = _cors_checks(port)
        report["body"] = _body_checks(port)
        report["models"] = _model_checks(app, port)
        report["sse"] = _sse_checks(app, port)
        report["bench"] = _bench_checks(port, pristine_vllm)
    report["root_path"] = _root_path_checks()
    report["env_key"] = _env_key_checks()
    return report


def _parse_serve_args(*argv: str):
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser()).parse_args(list(argv))


def _model_args(checkpoint: str) -> list[str]:
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


def _serving_app(checkpoint: str):
    """The real app with `vllm serve`'s middleware and the CPU render state (no engine), plus
    test routes that stream the way the engine-backed routes do."""
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.api_server import build_app, init_render_app_state

    args = _parse_serve_args(
        *_model_args(checkpoint),
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


def _recording_gaps_stream(app):
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


def _keyed(headers: dict | None = None) -> dict:
    return {**(headers or {}), "Authorization": f"Bearer {KEY}"}


def _call(port: int, method: str, target: str, headers: dict | None = None, body=None):
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


def _json_call(port: int, target: str, payload: dict) -> tuple[int, dict]:
    status, _, data = _call(
        port, "POST", target, _keyed({"Content-Type": "application/json"}), json.dumps(payload)
    )
    return status, json.loads(data)


def _route_matrix(app, port: int) -> list[dict]:
    """Every registered route, every method, with and without the key."""
    from starlette.routing import Mount, Route

    rows = []
    for route in app.routes:
        if route.path.startswith("/hq-test/"):
            continue
        if isinstance(route, Mount):
            cases = [(route.path + "/", "GET")]
        elif isinstance(route, Route):  # APIRoute is a Route
            target = re.sub(r"\{[^}]*\}", "x", route.path)
            cases = [(target, method) for method in sorted(route.methods or ())]
        else:  # e.g. a WebSocketRoute: the test fails and asks for coverage
            rows.append({"path": route.path, "kind": type(route).__name__})
            continue
        for target, method in cases:
            body = b"{}" if method in ("POST", "PUT", "PATCH") else None
            headers = {"Content-Type": "application/json"} if body else {}
            rows.append(
                {
                    "path": route.path,
                    "kind": type(route).__name__,
                    "method": method,
                    "without_key": _call(port, method, target, headers, body)[0],
                    "with_key": _call(port, method, target, _keyed(headers), body)[0],
                }
            )
    return rows


def _cors_checks(port: int) -> dict:
    preflight = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST"}
    allowed = _call(port, "OPTIONS", "/v1/chat/completions", preflight)
    foreign = _call(port, "OPTIONS", "/v1/chat/completions", {**preflight, "Origin": "https://x"})
    simple = _call(port, "GET", "/v1/models", {"Origin": ALLOWED_ORIGIN})
    return {
        "preflight": [allowed[0], allowed[1].get("access-control-allow-origin")],
        "preflight_foreign_origin": foreign[0],
        "bare_options": _call(port, "OPTIONS", "/v1/chat/completions")[0],
        "options_origin_only": _call(
            port, "OPTIONS", "/v1/chat/completions", {"Origin": ALLOWED_ORIGIN}
        )[0],
        "options_method_only": _call(
            port, "OPTIONS", "/v1/chat/completions", {"Access-Control-Request-Method": "POST"}
        )[0],
        "simple_request_without_key": simple[0],
    }


def _read_until_closed(connection) -> bytes:
    received = b""
    while data := connection.recv(65536):
        received += data
    return received


def _raw_exchange(port: int, head: bytes) -> bytes:
    """Send a raw request head (asking for Connection: close) and nothing else; return
    everything the server sent until it closed."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(head)
        return _read_until_closed(connection)


def _status_of(raw_response: bytes) -> int:
    return int(raw_response.split(b" ", 2)[1])


def _tokenize_body(size: int | None = None) -> bytes:
    """A valid /tokenize request, padded with JSON whitespace to exactly `size` bytes."""
    body = json.dumps({"model": SERVED_MODELS[0], "prompt": "Hello there"}).encode()
    return body if size is None else body + b" " * (size - len(body))


def _body_checks(port: int) -> dict:
    import select
    import socket

    json_headers = _keyed({"Content-Type": "application/json"})
    results: dict = {}

    # Declared too large: the body is never sent, so any answer came from the headers alone.
    head = (
        "POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nOrigin: {ALLOWED_ORIGIN}\r\n"
        "Content-Length: 1000000000\r\nConnection: close\r\n\r\n"
    ).encode()
    answer = _raw_exchange(port, head)
    results["declared"] = {
        "status": _status_of(answer),
        "cors": f"access-control-allow-origin: {ALLOWED_ORIGIN}".encode() in answer.lower(),
        "body": json.loads(answer.split(b"\r\n\r\n", 1)[1]),
    }
    exact = _tokenize_body(BODY_LIMIT)
    results["at_limit"] = _call(port, "POST", "/tokenize", json_headers, exact)[0]
    results["one_over_limit"] = _call(port, "POST", "/tokenize", json_headers, exact + b" ")[0]
    small = _tokenize_body()
    chunked = iter([small[:10], small[10:20], small[20:]])
    results["chunked_small"] = _call(port, "POST", "/tokenize", json_headers, chunked)[0]
    chunked = iter([small[:-1], b" " * BODY_LIMIT, small[-1:]])
    status, _, data = _call(port, "POST", "/tokenize", json_headers, chunked)
    results["chunked_over"] = [status, json.loads(data)]

    # A chunked upload stalled mid-body does not hold up anyone else; once it goes over the
    # limit it is refused. Exactly enough 1 KiB pieces to pass the limit are sent, so none
    # arrives after the answer (the server would reset the connection, losing the 413).
    slow_head = (
        "POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    piece = b"%x\r\n%s\r\n" % (1024, b" " * 1024)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as slow:
        slow.sendall(slow_head + piece)  # then silence, while another request is served
        results["during_slow_upload"] = _call(port, "POST", "/tokenize", json_headers, small)[0]
        results["slow_upload_unanswered_meanwhile"] = not select.select([slow], [], [], 0)[0]
        slow.sendall(piece * (BODY_LIMIT // 1024))
        results["slow_upload"] = _status_of(_read_until_closed(slow))
    results["after"] = _call(port, "POST", "/tokenize", json_headers, small)[0]

    # Malformed JSON: stock vLLM 0.26.0 answers 400 (FastAPI alone would say 422).
    for target, body in (("/v1/chat/completions", b"{bad"), ("/tokenize", b"[1,")):
        status, _, data = _call(port, "POST", target, json_headers, body)
        results[f"malformed{target}"] = [status, json.loads(data)]
    return results


def _model_checks(app, port: int) -> dict:
    from vllm.lora.request import LoRARequest

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    results = {
        "tokenize_unknown": _json_call(port, "/tokenize", {"model": "nope", "prompt": "hi"}),
        "tokenize_known": _json_call(port, "/tokenize", {"model": "qwen-b", "prompt": "hi"})[0],
        "chat_render_unknown": _json_call(
            port, "/v1/chat/completions/render", {**chat, "model": "nope"}
        ),
        "completion_render_unknown": _json_call(
            port, "/v1/completions/render", {"model": "nope", "prompt": "hi"}
        ),
    }
    registry = app.state.openai_serving_models
    registry.lora_requests["sql-lora"] = LoRARequest(
        lora_name="sql-lora", lora_int_id=1, lora_path="/adapters/sql"
    )
    results["with_lora"] = _json_call(port, "/tokenize", {"model": "nope", "prompt": "hi"})
    del registry.lora_requests["sql-lora"]
    return results


def _read_stream(port: int, target: str, stop_after: int | None = None, on_line=None) -> dict:
    """Non-blank lines of an event stream, each passed to `on_line` as it arrives."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", target, headers=_keyed())
    response = connection.getresponse()
    lines = []
    while (stop_after is None or len(lines) < stop_after) and (raw := response.readline()):
        if raw.strip():
            lines.append(raw.decode().rstrip("\n"))
            if on_line:
                on_line(lines[-1])
    connection.close()
    return {"status": response.status, "type": response.getheader("content-type"), "lines": lines}


def _read_gaps(app, port: int) -> dict:
    """/hq-test/gaps, ending each quiet gap once KEEP_ALIVES_PER_GAP keep-alives came in it."""
    import threading

    app.state.hq_gap_releases = [threading.Event(), threading.Event()]
    waiting = iter(app.state.hq_gap_releases)
    in_this_gap = 0

    def count(line: str) -> None:
        nonlocal in_this_gap
        in_this_gap = in_this_gap + 1 if line == ": keep-alive" else 0
        if in_this_gap == KEEP_ALIVES_PER_GAP:
            next(waiting).set()

    read = _read_stream(port, "/hq-test/gaps", on_line=count)
    return {**read, "sent": app.state.hq_gaps_sent}


def _sse_checks(app, port: int) -> dict:
    import time

    results = {
        "gaps": _read_gaps(app, port),
        "split_event": _read_stream(port, "/hq-test/split-event"),
        "version": _call(port, "GET", "/version", _keyed())[2].decode(),
    }
    app.state.hq_abandoned_closed = False
    # Read the first event and the first keep-alive, then hang up.
    results["abandoned"] = _read_stream(port, "/hq-test/abandoned", stop_after=2)
    deadline = time.monotonic() + 30
    while not app.state.hq_abandoned_closed and time.monotonic() < deadline:
        time.sleep(0.02)
    results["abandoned_generator_closed"] = app.state.hq_abandoned_closed
    return results


def _bench_checks(port: int, pristine_vllm: str) -> dict:
    """`vllm bench serve`'s request functions against streams that carry keep-alives."""
    import asyncio
    import importlib.util

    import aiohttp
    from vllm.benchmarks.lib import endpoint_request_func as patched

    spec = importlib.util.spec_from_file_location(
        "pristine_endpoint_request_func",
        Path(pristine_vllm) / "benchmarks" / "lib" / "endpoint_request_func.py",
    )
    pristine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pristine)
    os.environ["OPENAI_API_KEY"] = KEY  # the bench sends it as the bearer token

    async def run(module, function: str, endpoint: str) -> dict:
        request = module.RequestFuncInput(
            prompt="hi",
            api_url=f"http://127.0.0.1:{port}/hq-test{endpoint}",
            prompt_len=1,
            output_len=3,
            model=SERVED_MODELS[0],
        )
        async with aiohttp.ClientSession() as session:
            output = await getattr(module, function)(request, session)
        return {
            "success": output.success,
            "text": output.generated_text,
            "ttft": output.ttft,
            "itl": output.itl,
            "output_tokens": output.output_tokens,
            "error": output.error[-300:],
        }

    cases = {
        "completions": ("async_request_openai_completions", "/v1/completions"),
        "chat": ("async_request_openai_chat_completions", "/v1/chat/completions"),
    }
    return {
        f"{tree}_{name}": asyncio.run(run(module, function, endpoint))
        for tree, module in (("patched", patched), ("pristine", pristine))
        for name, (function, endpoint) in cases.items()
    }


def _sentinel_checks() -> dict:
    from vllm import envs

    results: dict = {"default": envs.VLLM_ENGINE_STALL_SENTINEL_S}
    os.environ["VLLM_ENGINE_STALL_SENTINEL_S"] = "7.5"
    results["from_env"] = envs.VLLM_ENGINE_STALL_SENTINEL_S
    results["in_compile_factors"] = "VLLM_ENGINE_STALL_SENTINEL_S" in envs.compile_factors()
    results["registered"] = "VLLM_ENGINE_STALL_SENTINEL_S" in dir(envs)
    envs.validate_environ(hard_fail=True)  # raises on an unregistered VLLM_* variable
    del os.environ["VLLM_ENGINE_STALL_SENTINEL_S"]
    return results


def _serve_help(topic: str) -> str:
    """What `vllm serve --help=TOPIC` prints."""
    import contextlib
    import io

    from vllm.entrypoints.cli.main import main

    printed = io.StringIO()
    argv, sys.argv = sys.argv, ["vllm", "serve", f"--help={topic}"]
    try:
        with contextlib.redirect_stdout(printed), contextlib.suppress(SystemExit):
            main()
    finally:
        sys.argv = argv
    return " ".join(printed.getvalue().split())


def _cli_checks() -> dict:
    results: dict = {
        "help": {
            topic: _serve_help(topic)
            for topic in (
                "Frontend",
                "sse-keep-alive-interval",
                "max-request-body-bytes",
                "api-key",
            )
        }
    }
    # Imported after the help runs: it imports vllm.engine.arg_utils (see _drive).
    from vllm.entrypoints.openai.cli_args import validate_parsed_serve_args

    defaults = _parse_serve_args("--model", "m")
    results["defaults"] = [defaults.sse_keep_alive_interval, defaults.max_request_body_bytes]
    for flag in ("--sse-keep-alive-interval", "--max-request-body-bytes"):
        try:
            validate_parsed_serve_args(_parse_serve_args("--model", "m", flag, "-1"))
        except ValueError as error:
            results[f"negative{flag}"] = str(error)
    results["middleware"] = {
        name: [
            [m.cls.__name__, m.kwargs.get("max_bytes") or m.kwargs.get("interval")]
            for m in _app_for(*argv).user_middleware
        ]
        for name, argv in {
            "defaults": [],
            "keep_alive_on": ["--sse-keep-alive-interval", "2.5"],
            "body_limit_off": ["--max-request-body-bytes", "0"],
        }.items()
    }
    return results


def _app_for(*argv: str):
    from vllm.entrypoints.openai.api_server import build_app

    return build_app(_parse_serve_args("--model", "m", *argv), ("generate",), None)


def _root_path_checks() -> dict:
    app = _app_for("--api-key", KEY, "--root-path", "/api")
    with serving(app, log_level="critical") as port:
        return {
            target: _call(port, "GET", target)[0]
            for target in ("/api/version", "/api/", "/version", "/api/v1/models", "/api", "/apiv1")
        }


def _env_key_checks() -> dict:
    os.environ["VLLM_API_KEY"] = "from-the-environment"
    try:
        app = _app_for()
    finally:
        del os.environ["VLLM_API_KEY"]
    with serving(app, log_level="critical") as port:
        keyed = {"Authorization": "Bearer from-the-environment"}
        return {
            "metrics": _call(port, "GET", "/metrics")[0],
            "metrics_keyed": _call(port, "GET", "/metrics", keyed)[0],
            "version": _call(port, "GET", "/version")[0],
        }


# --- pytest -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report(
    patched_vllm: Path, pristine_vllm_dir: Path, tiny_checkpoint: Path, tmp_path_factory
) -> dict:
    report_file = tmp_path_factory.mktemp("api-report") / "report.json"
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # register the dev routes too: they must be guarded
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_API_KEY": "",
        "PYTHONPATH": str(ROOT / "src"),  # for hyperqwen.settings; vllm comes from argv[1]
    }
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            str(patched_vllm.parent),
            str(pristine_vllm_dir),
            str(tiny_checkpoint),
            str(report_file),
        ],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: on a loaded 2-core machine the report takes minutes
        env=env,
        cwd=patched_vllm.parent,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(report_file.read_text())


def test_vllm_came_from_the_patched_tree(report, patched_vllm):
    assert Path(report["vllm_file"]).is_relative_to(patched_vllm)


def test_every_route_needs_the_key_except_the_keyless_allowlist(report):
    rows = report["routes"]
    paths = {row["path"] for row in rows}
    # The matrix really covers the routes the brief names, the dev routes and the mount.
    for expected in (
        *KEYLESS_PATHS,
        "/metrics",
        "/tokenize",
        "/detokenize",
        "/docs",
        "/openapi.json",
        "/redoc",
        "/invocations",
        "/load",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses/{response_id}",
        "/inference/v1/generate",
        "/server_info",
        "/pause",
        "/collective_rpc",
    ):
        assert expected in paths, f"{expected} is not registered; the matrix missed it"
    assert {row["kind"] for row in rows} <= {"Route", "APIRoute", "Mount"}, (
        "a route of a new kind (WebSocket?) appeared: extend _route_matrix to cover it"
    )
    wrong = []
    for row in rows:
        if row["path"] in KEYLESS_PATHS:
            if row["without_key"] == 401:
                wrong.append(f"{row['method']} {row['path']} is keyless but answered 401")
        elif row["without_key"] != 401 or row["with_key"] == 401:
            wrong.append(
                f"{row['method']} {row['path']}: {row['without_key']} without the key, "
                f"{row['with_key']} with it (want 401, then anything else)"
            )
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("target", GUARDED_SPELLINGS)
def test_path_tricks_do_not_reach_a_route_without_the_key(report, target):
    without_key, with_key = report["spellings"][target]
    assert without_key == 401
    assert with_key != 401  # it is the key, not the route, that made the difference


@pytest.mark.parametrize("target", KEYLESS_SPELLINGS)
def test_a_query_string_on_a_keyless_path_stays_keyless(report, target):
    assert report["spellings"][target][0] != 401


@pytest.mark.parametrize("trick", sorted(HEADER_TRICKS))
def test_headers_do_not_stand_in_for_the_key(report, trick):
    assert report["header_tricks"][trick] == 401


def test_the_bearer_scheme_is_case_insensitive_as_before(report):
    assert report["bearer_scheme_any_case"] == 200


def test_cors_preflight_passes_without_the_key_and_nothing_else_does(report):
    cors = report["cors"]
    assert cors["preflight"] == [200, ALLOWED_ORIGIN]
    assert cors["preflight_foreign_origin"] == 400  # CORSMiddleware refuses it, auth did not
    assert cors["bare_options"] == 401
    assert cors["options_origin_only"] == 401
    assert cors["options_method_only"] == 401
    assert cors["simple_request_without_key"] == 401


def test_root_path_keyless_paths_are_exact_below_the_root(report):
    assert report["root_path"] == {
        "/api/version": 200,
        "/api/": 200,
        "/version": 200,  # the router also serves it without the prefix
        "/api/v1/models": 401,
        "/api": 401,
        "/apiv1": 401,
    }


def test_vllm_api_key_from_the_environment_guards_metrics_too(report):
    assert report["env_key"] == {"metrics": 401, "metrics_keyed": 200, "version": 200}


def test_an_announced_oversized_body_is_refused_before_it_is_sent(report):
    declared = report["body"]["declared"]
    assert declared["status"] == 413  # answered though not one byte of the body was sent
    assert declared["cors"]  # answered inside CORSMiddleware
    error = declared["body"]["error"]
    assert error["code"] == 413
    assert f"larger than {BODY_LIMIT} bytes" in error["message"]
    assert "--max-request-body-bytes" in error["message"]


def test_the_limit_is_exact_and_counts_chunked_bodies(report):
    body = report["body"]
    assert body["at_limit"] == 200
    assert body["one_over_limit"] == 413
    assert body["chunked_small"] == 200
    status, answer = body["chunked_over"]
    assert status == 413
    assert answer["error"]["code"] == 413  # same JSON shape as the Content-Length path
    assert "--max-request-body-bytes" in answer["error"]["message"]


def test_both_ways_of_refusing_answer_the_same_json(report):
    # engine/body_limit.py writes the Content-Length answer itself; vLLM's exception handler
    # writes the counted one: a change to either shows here.
    body = report["body"]
    assert body["declared"]["body"] == body["chunked_over"][1]


def test_an_oversized_upload_does_not_disturb_other_requests(report):
    body = report["body"]
    assert body["during_slow_upload"] == 200
    assert body["slow_upload_unanswered_meanwhile"]  # served while the upload hung mid-body
    assert body["slow_upload"] == 413
    assert body["after"] == 200


@pytest.mark.parametrize("target", ["/v1/chat/completions", "/tokenize"])
def test_malformed_json_answers_400_with_a_message_already_in_stock_vllm(report, target):
    status, answer = report["body"][f"malformed{target}"]
    assert status == 400
    assert answer["error"]["code"] == 400
    assert "JSON decode error" in answer["error"]["message"]


@pytest.mark.parametrize(
    "case", ["tokenize_unknown", "chat_render_unknown", "completion_render_unknown"]
)
def test_unknown_model_answers_404_naming_the_served_models(report, case):
    status, answer = report["models"][case]
    assert status == 404
    assert answer["error"]["type"] == "NotFoundError"
    assert answer["error"]["param"] == "model"
    assert answer["error"]["message"] == (
        "The model `nope` does not exist. Served models: `qwen-a`, `qwen-b`."
    )


def test_known_models_still_work_and_lora_adapters_are_listed(report):
    assert report["models"]["tokenize_known"] == 200
    status, answer = report["models"]["with_lora"]
    assert status == 404
    assert answer["error"]["message"].endswith("Served models: `qwen-a`, `qwen-b`, `sql-lora`.")


def _without_keep_alives(lines: list[str]) -> list[str]:
    """The stream's lines with each run of keep-alive comments collapsed to one ':'."""
    collapsed: list[str] = []
    for line in lines:
        text = ":" if line == ": keep-alive" else line
        if not (text == ":" and collapsed and collapsed[-1] == ":"):
            collapsed.append(text)
    return collapsed


def test_keep_alive_comments_fill_the_quiet_gaps_of_a_stream(report):
    gaps = report["sse"]["gaps"]
    assert gaps["status"] == 200
    assert gaps["type"].startswith("text/event-stream")
    # Comments in both quiet gaps, none between the back-to-back events 2 and 3.
    assert _without_keep_alives(gaps["lines"]) == [
        "data: 1",
        ":",
        "data: 2",
        "data: 3",
        ":",
        "data: [DONE]",
    ]
    # Each gap lasted until the reader had its keep-alives: they came without a deadline.
    first_gap = gaps["lines"][1 : gaps["lines"].index("data: 2")]
    second_gap = gaps["lines"][gaps["lines"].index("data: 3") + 1 : -1]
    assert len(first_gap) >= KEEP_ALIVES_PER_GAP and len(second_gap) >= KEEP_ALIVES_PER_GAP
    # The server's send times (its event loop's clock): a comment only after a whole interval
    # of silence, never sooner, however late the loop ran.
    sent = gaps["sent"]
    assert [body for _, body in sent] == [line + "\n\n" for line in gaps["lines"]]
    for (before, _), (at, body) in itertools.pairwise(sent):
        if body == ": keep-alive\n\n":
            assert at - before >= KEEP_ALIVE_S, (before, at)


def test_keep_alive_never_splits_an_event(report):
    lines = report["sse"]["split_event"]["lines"]
    assert lines == ['data: {"part": 1}', "data: [DONE]"]


def test_other_responses_are_untouched_by_keep_alive(report):
    assert json.loads(report["sse"]["version"]) == {"version": PINNED_VLLM}


def test_a_client_hanging_up_still_ends_the_stream(report):
    abandoned = report["sse"]["abandoned"]
    assert abandoned["lines"] == ["data: 1", ": keep-alive"]
    assert report["sse"]["abandoned_generator_closed"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_vllm_bench_serve_parses_streams_with_keep_alives(report, endpoint):
    output = report["bench"][f"patched_{endpoint}"]
    assert output["success"], output["error"]
    assert output["text"] == "abc"
    assert output["output_tokens"] == 3
    assert output["ttft"] >= 0.25  # the first token, not the first keep-alive, stops the clock
    assert len(output["itl"]) == 2


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stock_vllm_bench_serve_garbles_streams_with_keep_alives(report, endpoint):
    """Why bench-sse-comments.patch exists: pristine 0.26.0 glues a lone keep-alive to the
    events after it, losing tokens (and with them TTFT and ITL) or the whole request."""
    output = report["bench"][f"pristine_{endpoint}"]
    assert output["text"] != "abc"
    assert len(output["itl"]) != 2


def test_sentinel_knob_is_registered_and_kept_out_of_the_compile_key(report):
    sentinel = report["sentinel"]
    assert sentinel["default"] == 120.0
    assert sentinel["from_env"] == 7.5
    assert sentinel["registered"]
    assert not sentinel["in_compile_factors"]


def test_serve_help_teaches_the_new_flags_and_defaults_are_safe(report):
    cli = report["cli"]
    frontend = cli["help"]["Frontend"]
    assert "--sse-keep-alive-interval SSE_KEEP_ALIVE_INTERVAL" in frontend
    assert "--max-request-body-bytes MAX_REQUEST_BODY_BYTES" in frontend
    keep_alive = cli["help"]["sse-keep-alive-interval"]
    # (argparse wraps at hyphens, so the phrases checked here have none)
    assert "which SSE clients ignore" in keep_alive
    assert "0 turns it off" in keep_alive
    assert "(default: 0.0)" in keep_alive
    body_limit = cli["help"]["max-request-body-bytes"]
    assert "answers 413 before any parsing" in body_limit
    assert "(default: 33554432)" in body_limit
    api_key = cli["help"]["api-key"]
    assert "on every route except the liveness probes `/`, `/health`, `/ping` and" in api_key
    assert "any route added later need the key too" in api_key
    assert cli["defaults"] == [0.0, 32 * 1024 * 1024]
    for flag in ("--sse-keep-alive-interval", "--max-request-body-bytes"):
        assert f"{flag} must be >= 0" in cli[f"negative{flag}"]


def test_middleware_follows_the_flags(report):
    middleware = report["cli"]["middleware"]
    names = {case: [name for name, _ in stack] for case, stack in middleware.items()}
    assert ["RequestBodyLimitMiddleware", 32 * 1024 * 1024] in middleware["defaults"]
    assert "SSEKeepAliveMiddleware" not in names["defaults"]  # off unless asked for
    assert ["SSEKeepAliveMiddleware", 2.5] in middleware["keep_alive_on"]
    assert "RequestBodyLimitMiddleware" not in names["body_limit_off"]
    # Both sit inside CORSMiddleware (added before it, so later in the stack).
    order = names["keep_alive_on"]
    assert order.index("CORSMiddleware") < order.index("SSEKeepAliveMiddleware")
    assert order.index("CORSMiddleware") < order.index("RequestBodyLimitMiddleware")


if __name__ == "__main__":
    Path(sys.argv[4]).write_text(json.dumps(_drive(*sys.argv[1:4])))
