"""Start a real `hyperqwen serve` on the GPU host for `pytest -m gpu` tests, and talk to it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
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


@contextlib.contextmanager
def hyperqwen_server(mode: str, env: dict[str, str], log: Path) -> Iterator[str]:
    """`hyperqwen serve MODE` in its own process group; yields the base URL once /health is 200."""
    port = env.get("PORT", "18020")
    base = f"http://127.0.0.1:{port}"
    full_env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}",
        **env,
    }
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "hyperqwen.cli", "serve", mode],
            env=full_env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
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
