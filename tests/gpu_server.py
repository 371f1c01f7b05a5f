"""Start a real `hyperqwen serve` on the GPU host for `pytest -m gpu` tests, and talk to it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]
# The 27B-geometry server needs ~4 min cold; a tiny one ~1.5 min (torch.compile, CUDA graphs).
STARTUP_TIMEOUT_S = 600
# GDN prefill on sm90 defaults to FlashInfer (JIT via nvcc); the Triton path is what the
# users' Ampere/Ada cards run, so the tests use it on Hopper too.
TRITON_GDN = """--additional-config '{"gdn_prefill_backend":"triton"}'"""


def require_gpu() -> None:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs a CUDA GPU (nvidia-smi not found)")


def log_dir(tmp_path: Path) -> Path:
    """$HYPERQWEN_TEST_LOGS (e.g. the device tool's $OUT) keeps server logs; else tmp_path."""
    target = Path(os.environ.get("HYPERQWEN_TEST_LOGS", tmp_path))
    target.mkdir(parents=True, exist_ok=True)
    return target


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_server(
    command: list[str], base: str, log: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    """Run `command` in its own process group; yield `base` once /health is 200, then stop it."""
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise AssertionError(
                        f"server exited {process.returncode}; log: {log}\n"
                        + log.read_text()[-4000:]
                    )
                with contextlib.suppress(requests.ConnectionError):
                    if requests.get(f"{base}/health", timeout=5).status_code == 200:
                        break
                time.sleep(2)
            else:
                raise AssertionError(f"not healthy after {STARTUP_TIMEOUT_S} s; log: {log}")
            yield base
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def hyperqwen_server(mode: str, env: dict[str, str], log: Path):
    """`hyperqwen serve MODE` with these knobs (PORT among them) as a running_server."""
    base = f"http://127.0.0.1:{env.get('PORT', '18020')}"
    pythonpath = f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"
    full_env = {**os.environ, "PYTHONPATH": pythonpath, **env}
    command = [sys.executable, "-m", "hyperqwen.cli", "serve", mode]
    return running_server(command, base, log, full_env)


def chat(base: str, model: str, key: str | None = None, max_tokens: int = 16) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = requests.post(
        f"{base}/v1/chat/completions",
        json={
            "model": model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Say hello in five words."}],
        },
        headers=headers,
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()
