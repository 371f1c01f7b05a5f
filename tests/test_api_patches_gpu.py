"""The API patches on a real `vllm serve` with an engine: run on the GPU host with `pytest -m gpu`.

Which vLLM: if HYPERQWEN_PATCHED_VLLM is set, it names the PARENT folder of an already-patched
`vllm/` package (the whole series applied; checked before anything starts). Otherwise the test
copies the `vllm/` package this Python would import (from PYTHONPATH or site-packages, found
without importing it) to a temporary folder and applies the series there; the installed tree is
left alone. Either way the server runs with that parent first on PYTHONPATH.

The model is a tiny Qwen3.5-architecture checkpoint written by `hyperqwen.checkpoint`
(config, tokenizer and chat template only) and served with `--load-format dummy`. A small
--max-num-batched-tokens splits the ~30k-token prompt into about 30 prefill steps, so the
prefill takes long enough to need keep-alives even on a tiny model.

Checked: the keyless routes answer and the others want the key; SSE keep-alive comments arrive
while a ~30k-token prompt is in prefill; `vllm bench serve` completes against the server with
keep-alives on (completions and chat); the engine stall sentinel warns while the engine is
paused (/pause?mode=keep, a dev route) with a request in flight, and reports the recovery.
Without CUDA every test skips.
"""

from __future__ import annotations

import http.client
import json
import random
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from gpu_server import (
    TRITON_GDN,
    log_dir,
    patched_vllm_parent,
    require_gpu,
    running_server,
    with_vllm_first,
)
from local_server import free_port

pytestmark = pytest.mark.gpu

KEY = "sk-hyperqwen-gpu-test"
MODEL_NAME = "qwen-tiny"
KEEP_ALIVE_S = 0.02
STALL_THRESHOLD_S = 2.0
PROMPT_TOKENS = 30_000


@dataclass
class Server:
    port: int
    log: Path
    checkpoint: Path
    env: dict[str, str]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-6000:]


def _call(port: int, method: str, target: str, headers: dict | None = None, body=None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request(method, target, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _keyed(headers: dict | None = None) -> dict:
    return {**(headers or {}), "Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_gpu()
    from hyperqwen.checkpoint.geometry import PRESETS
    from hyperqwen.checkpoint.synthesize import synthesize

    patched_parent = patched_vllm_parent(tmp_path_factory)
    checkpoint = synthesize(
        tmp_path_factory.mktemp("tiny-qwen") / "checkpoint",
        PRESETS["tiny"],
        config_only=True,
        progress=False,
    ).directory
    env = {
        **with_vllm_first(patched_parent),
        "PYTHONUNBUFFERED": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # for /pause and /resume
        "VLLM_ENGINE_STALL_SENTINEL_S": str(STALL_THRESHOLD_S),
        "VLLM_API_KEY": "",
    }
    imported = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.strip()
    assert Path(imported).is_relative_to(patched_parent), f"the server would import {imported}"

    port = free_port()
    log = log_dir(tmp_path_factory.mktemp("gpu-server")) / "api-patches-server.log"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(checkpoint),
        "--served-model-name",
        MODEL_NAME,
        "--load-format",
        "dummy",
        "--language-model-only",
        "--enforce-eager",
        "--max-model-len",
        "32768",
        "--max-num-batched-tokens",
        "1024",
        "--gpu-memory-utilization",
        "0.5",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--sse-keep-alive-interval",
        str(KEEP_ALIVE_S),
        *shlex.split(TRITON_GDN),
    ]
    with running_server(command, f"http://127.0.0.1:{port}", log, env):
        yield Server(port=port, log=log, checkpoint=checkpoint, env=env)


def _stream_lines(port: int, payload: dict, on_line=None) -> list[tuple[float, str]]:
    """POST a streaming /v1/completions request; its non-blank lines with their arrival time
    in seconds since the response headers. `on_line(text)` sees each line as it comes."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        connection.request(
            "POST",
            "/v1/completions",
            body=json.dumps({**payload, "model": MODEL_NAME, "stream": True}),
            headers=_keyed({"Content-Type": "application/json"}),
        )
        response = connection.getresponse()
        assert response.status == 200, response.read()[-2000:]
        started = time.monotonic()
        lines = []
        while raw := response.readline():
            if text := raw.decode().strip():
                lines.append((time.monotonic() - started, text))
                if on_line is not None:
                    on_line(text)
        return lines
    finally:
        connection.close()


def _long_prompt() -> list[int]:
    """PROMPT_TOKENS ordinary token ids, different on every call so no prefix cache hits."""
    return [random.randrange(1000, 200_000) for _ in range(PROMPT_TOKENS)]


def test_keyless_routes_answer_and_the_rest_want_the_key(server):
    for target in ("/", "/health", "/ping", "/version"):
        assert _call(server.port, "GET", target)[0] == 200, target
    for method, target in (
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/load"),
        ("GET", "/docs"),
        ("GET", "/openapi.json"),
        ("GET", "/server_info"),
        ("POST", "/tokenize"),
        ("POST", "/v1/completions"),
        ("GET", "//v1/models"),
        ("GET", "/health/../v1/models"),
        ("GET", "/%761/models"),
    ):
        assert _call(server.port, method, target)[0] == 401, f"{method} {target}"
    status, body = _call(server.port, "GET", "/v1/models", _keyed())
    assert status == 200
    assert [card["id"] for card in json.loads(body)["data"]] == [MODEL_NAME]
    status, body = _call(server.port, "GET", "/metrics", _keyed())
    assert status == 200
    assert b"vllm:" in body


def test_unknown_model_404_names_the_served_model(server):
    status, body = _call(
        server.port,
        "POST",
        "/v1/completions",
        _keyed({"Content-Type": "application/json"}),
        json.dumps({"model": "qwen", "prompt": "hi", "max_tokens": 1}),
    )
    assert status == 404
    assert json.loads(body)["error"]["message"] == (
        f"The model `qwen` does not exist. Served models: `{MODEL_NAME}`."
    )


def test_keep_alive_comments_arrive_during_a_long_prefill(server):
    lines = _stream_lines(
        server.port,
        {
            "prompt": _long_prompt(),
            "max_tokens": 8,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    first_data = next(index for index, (_, text) in enumerate(lines) if text.startswith("data:"))
    prefill_s = lines[first_data][0]
    comments = [at for at, text in lines[:first_data] if text == ": keep-alive"]
    assert prefill_s >= 5 * KEEP_ALIVE_S, (
        f"the prefill took {prefill_s:.3f} s, too short to show keep-alives; lower "
        "--max-num-batched-tokens in this test"
    )
    # One comment per quiet interval, give or take scheduling delays.
    assert len(comments) >= prefill_s / KEEP_ALIVE_S / 3
    assert all(text == ": keep-alive" or text.startswith("data: ") for _, text in lines)
    data = [text.removeprefix("data: ") for _, text in lines if text.startswith("data: ")]
    assert data[-1] == "[DONE]"
    usage = json.loads(data[-2])["usage"]  # every data line before it parses as JSON too
    assert all(json.loads(item) for item in data[:-2])
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (PROMPT_TOKENS, 8)


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [("vllm", "/v1/completions"), ("openai-chat", "/v1/chat/completions")],
)
def test_vllm_bench_serve_completes_with_keep_alives_on(server, tmp_path, backend, endpoint):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "bench",
            "serve",
            "--backend",
            backend,
            "--endpoint",
            endpoint,
            "--base-url",
            f"http://127.0.0.1:{server.port}",
            "--model",
            str(server.checkpoint),
            "--served-model-name",
            MODEL_NAME,
            "--dataset-name",
            "random",
            "--random-input-len",
            "4096",
            "--random-output-len",
            "32",
            "--ignore-eos",
            "--num-prompts",
            "32",
            "--max-concurrency",
            "8",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "result.json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**server.env, "OPENAI_API_KEY": KEY},  # the bench's bearer token
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["failed"]) == (32, 0)
    assert result["total_output_tokens"] == 32 * 32


def test_stall_sentinel_warns_while_the_engine_is_paused(server):
    first_token = threading.Event()
    streamed: dict = {}

    def note_token(text: str) -> None:
        if text.startswith("data: "):
            first_token.set()

    def read_stream() -> None:
        streamed["lines"] = _stream_lines(
            server.port,
            {"prompt": "Count to ten thousand:", "max_tokens": 4000, "ignore_eos": True},
            on_line=note_token,
        )

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert first_token.wait(timeout=120), "the stream never produced a token"
    paused_at = time.monotonic()
    try:
        assert _call(server.port, "POST", "/pause?mode=keep", _keyed())[0] == 200
        deadline = paused_at + 4 * STALL_THRESHOLD_S + 10
        while "Engine stall: 1 request(s) in flight" not in server.log_text():
            assert time.monotonic() < deadline, (
                f"no stall warning while paused:\n{_tail(server.log)}"
            )
            time.sleep(0.2)
    finally:
        assert _call(server.port, "POST", "/resume", _keyed())[0] == 200
    deadline = time.monotonic() + 4 * STALL_THRESHOLD_S
    while "Engine stall over: the engine stepped again after" not in server.log_text():
        assert time.monotonic() < deadline, f"no recovery line after /resume:\n{_tail(server.log)}"
        time.sleep(0.2)
    assert f"(VLLM_ENGINE_STALL_SENTINEL_S={STALL_THRESHOLD_S:g})" in server.log_text()
    reader.join(timeout=300)
    lines = streamed["lines"]
    assert lines[-1][1] == "data: [DONE]"
    # The paused stream stayed alive with keep-alives while no token came.
    assert sum(text == ": keep-alive" for _, text in lines) >= STALL_THRESHOLD_S / KEEP_ALIVE_S / 3
