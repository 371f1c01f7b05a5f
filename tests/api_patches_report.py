"""The API-patch report: what the patched vLLM OpenAI app does, gathered in one subprocess.

The whole series is applied to a pristine vLLM unpacked from the pinned wheel. One subprocess
(this file run as a script, with the patched tree first on sys.path and the CPU platform
selected) builds the real app with `build_app` and the CPU render state of a tiny synthesized
Qwen3.5 checkpoint (`init_render_app_state`: real tokenizer, real model registry, no engine),
serves it with uvicorn on a local port, sends raw HTTP requests at it, reads the stall
sentinel's knob from the patched vllm.envs, runs `vllm bench serve`'s request functions (patched
and pristine) against it, and writes one JSON report: `build_report` runs it and returns it
(conftest's session fixture `api_patches_report`, read by the test_api_patches*.py files).
Everything but `build_report` runs in that fresh interpreter:
`python tests/api_patches_report.py PATCHED_PARENT PRISTINE_VLLM CKPT REPORT`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from api_patches_app import (
    ALLOWED_ORIGIN,
    BODY_LIMIT,
    GUARDED_SPELLINGS,
    HEADER_TRICKS,
    KEEP_ALIVES_PER_GAP,
    KEY,
    KEYLESS_SPELLINGS,
    SERVED_MODELS,
    app_for,
    call,
    json_call,
    keyed,
    parse_serve_args,
    raw_exchange,
    read_stream,
    read_until_closed,
    recording_gaps_stream,
    serving_app,
    status_of,
)
from local_server import serving

ROOT = Path(__file__).resolve().parents[1]


def build_report(
    patched_vllm: Path, pristine_vllm_dir: Path, tiny_checkpoint: Path, report_dir: Path
) -> dict:
    """Run this file on the patched tree and return the report it wrote."""
    report_file = report_dir / "report.json"
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
    app = serving_app(checkpoint)
    with serving(recording_gaps_stream(app), log_level="critical") as port:
        report["routes"] = _route_matrix(app, port)
        report["spellings"] = {
            target: [call(port, "GET", target)[0], call(port, "GET", target, keyed())[0]]
            for target in (*GUARDED_SPELLINGS, *KEYLESS_SPELLINGS)
        }
        report["header_tricks"] = {
            name: call(port, "GET", "/v1/models", headers)[0]
            for name, headers in HEADER_TRICKS.items()
        }
        report["bearer_scheme_any_case"] = call(
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
                    "without_key": call(port, method, target, headers, body)[0],
                    "with_key": call(port, method, target, keyed(headers), body)[0],
                }
            )
    return rows


def _cors_checks(port: int) -> dict:
    preflight = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST"}
    allowed = call(port, "OPTIONS", "/v1/chat/completions", preflight)
    foreign = call(port, "OPTIONS", "/v1/chat/completions", {**preflight, "Origin": "https://x"})
    simple = call(port, "GET", "/v1/models", {"Origin": ALLOWED_ORIGIN})
    return {
        "preflight": [allowed[0], allowed[1].get("access-control-allow-origin")],
        "preflight_foreign_origin": foreign[0],
        "bare_options": call(port, "OPTIONS", "/v1/chat/completions")[0],
        "options_origin_only": call(
            port, "OPTIONS", "/v1/chat/completions", {"Origin": ALLOWED_ORIGIN}
        )[0],
        "options_method_only": call(
            port, "OPTIONS", "/v1/chat/completions", {"Access-Control-Request-Method": "POST"}
        )[0],
        "simple_request_without_key": simple[0],
    }


def _tokenize_body(size: int | None = None) -> bytes:
    """A valid /tokenize request, padded with JSON whitespace to exactly `size` bytes."""
    body = json.dumps({"model": SERVED_MODELS[0], "prompt": "Hello there"}).encode()
    return body if size is None else body + b" " * (size - len(body))


def _body_checks(port: int) -> dict:
    import select
    import socket

    json_headers = keyed({"Content-Type": "application/json"})
    results: dict = {}

    # Declared too large: the body is never sent, so any answer came from the headers alone.
    head = (
        "POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nOrigin: {ALLOWED_ORIGIN}\r\n"
        "Content-Length: 1000000000\r\nConnection: close\r\n\r\n"
    ).encode()
    answer = raw_exchange(port, head)
    results["declared"] = {
        "status": status_of(answer),
        "cors": f"access-control-allow-origin: {ALLOWED_ORIGIN}".encode() in answer.lower(),
        "body": json.loads(answer.split(b"\r\n\r\n", 1)[1]),
    }
    exact = _tokenize_body(BODY_LIMIT)
    results["at_limit"] = call(port, "POST", "/tokenize", json_headers, exact)[0]
    results["one_over_limit"] = call(port, "POST", "/tokenize", json_headers, exact + b" ")[0]
    small = _tokenize_body()
    chunked = iter([small[:10], small[10:20], small[20:]])
    results["chunked_small"] = call(port, "POST", "/tokenize", json_headers, chunked)[0]
    chunked = iter([small[:-1], b" " * BODY_LIMIT, small[-1:]])
    status, _, data = call(port, "POST", "/tokenize", json_headers, chunked)
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
        results["during_slow_upload"] = call(port, "POST", "/tokenize", json_headers, small)[0]
        results["slow_upload_unanswered_meanwhile"] = not select.select([slow], [], [], 0)[0]
        slow.sendall(piece * (BODY_LIMIT // 1024))
        results["slow_upload"] = status_of(read_until_closed(slow))
    results["after"] = call(port, "POST", "/tokenize", json_headers, small)[0]

    # Malformed JSON: stock vLLM 0.26.0 answers 400 (FastAPI alone would say 422).
    for target, body in (("/v1/chat/completions", b"{bad"), ("/tokenize", b"[1,")):
        status, _, data = call(port, "POST", target, json_headers, body)
        results[f"malformed{target}"] = [status, json.loads(data)]
    return results


def _model_checks(app, port: int) -> dict:
    from vllm.lora.request import LoRARequest

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    results = {
        "tokenize_unknown": json_call(port, "/tokenize", {"model": "nope", "prompt": "hi"}),
        "tokenize_known": json_call(port, "/tokenize", {"model": "qwen-b", "prompt": "hi"})[0],
        "chat_render_unknown": json_call(
            port, "/v1/chat/completions/render", {**chat, "model": "nope"}
        ),
        "completion_render_unknown": json_call(
            port, "/v1/completions/render", {"model": "nope", "prompt": "hi"}
        ),
    }
    registry = app.state.openai_serving_models
    registry.lora_requests["sql-lora"] = LoRARequest(
        lora_name="sql-lora", lora_int_id=1, lora_path="/adapters/sql"
    )
    results["with_lora"] = json_call(port, "/tokenize", {"model": "nope", "prompt": "hi"})
    del registry.lora_requests["sql-lora"]
    return results


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

    read = read_stream(port, "/hq-test/gaps", on_line=count)
    return {**read, "sent": app.state.hq_gaps_sent}


def _sse_checks(app, port: int) -> dict:
    import time

    results = {
        "gaps": _read_gaps(app, port),
        "split_event": read_stream(port, "/hq-test/split-event"),
        "version": call(port, "GET", "/version", keyed())[2].decode(),
    }
    app.state.hq_abandoned_closed = False
    # Read the first event and the first keep-alive, then hang up.
    results["abandoned"] = read_stream(port, "/hq-test/abandoned", stop_after=2)
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

    defaults = parse_serve_args("--model", "m")
    results["defaults"] = [defaults.sse_keep_alive_interval, defaults.max_request_body_bytes]
    for flag in ("--sse-keep-alive-interval", "--max-request-body-bytes"):
        try:
            validate_parsed_serve_args(parse_serve_args("--model", "m", flag, "-1"))
        except ValueError as error:
            results[f"negative{flag}"] = str(error)
    results["middleware"] = {
        name: [
            [m.cls.__name__, m.kwargs.get("max_bytes") or m.kwargs.get("interval")]
            for m in app_for(*argv).user_middleware
        ]
        for name, argv in {
            "defaults": [],
            "keep_alive_on": ["--sse-keep-alive-interval", "2.5"],
            "body_limit_off": ["--max-request-body-bytes", "0"],
        }.items()
    }
    return results


def _root_path_checks() -> dict:
    app = app_for("--api-key", KEY, "--root-path", "/api")
    with serving(app, log_level="critical") as port:
        return {
            target: call(port, "GET", target)[0]
            for target in ("/api/version", "/api/", "/version", "/api/v1/models", "/api", "/apiv1")
        }


def _env_key_checks() -> dict:
    os.environ["VLLM_API_KEY"] = "from-the-environment"
    try:
        app = app_for()
    finally:
        del os.environ["VLLM_API_KEY"]
    with serving(app, log_level="critical") as port:
        keyed = {"Authorization": "Bearer from-the-environment"}
        return {
            "metrics": call(port, "GET", "/metrics")[0],
            "metrics_keyed": call(port, "GET", "/metrics", keyed)[0],
            "version": call(port, "GET", "/version")[0],
        }


if __name__ == "__main__":
    Path(sys.argv[4]).write_text(json.dumps(_drive(*sys.argv[1:4])))
