"""A synthesized tiny checkpoint is served by plain `vllm serve` from its files and answers.

Run on the GPU host: `pytest -m gpu tests/test_synth_gpu.py`. The server log is kept in
$HYPERQWEN_TEST_LOGS when set (else the test's tmp dir).
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize

pytestmark = pytest.mark.gpu

STARTUP_TIMEOUT_S = 540


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model_dir: Path, log: Path):
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--language-model-only",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        # a tiny model needs little memory; the rest of the GPU stays free for other servers
        "--gpu-memory-utilization",
        "0.2",
        # GDN prefill on Hopper defaults to FlashInfer (JIT-compiled); Triton is what the
        # users' Ampere/Ada cards run.
        "--additional-config",
        json.dumps({"gdn_prefill_backend": "triton"}),
    ]
    base = f"http://127.0.0.1:{port}"
    with log.open("w") as sink:
        server = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while True:
                if server.poll() is not None:
                    pytest.fail(
                        f"vllm serve exited {server.returncode}:\n{log.read_text()[-6000:]}"
                    )
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s; log: {log}")
                with contextlib.suppress(requests.ConnectionError):
                    if requests.get(f"{base}/health", timeout=5).status_code == 200:
                        break
                time.sleep(2)
            yield base
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def test_vllm_serves_the_tiny_checkpoint_from_files(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model_dir = tmp_path / "tiny"
    synthesize(model_dir, PRESETS["tiny"], progress=False)
    log = Path(os.environ.get("HYPERQWEN_TEST_LOGS", tmp_path)) / "synth_gpu_vllm.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with vllm_server(model_dir, log) as base:
        response = requests.post(
            f"{base}/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Say something."},
                ],
                "max_tokens": 16,
                "min_tokens": 16,
                "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False},
            },
            timeout=120,
        )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 16
    assert body["usage"]["prompt_tokens"] > 10
    content = body["choices"][0]["message"]["content"]
    assert isinstance(content, str) and content.strip()
