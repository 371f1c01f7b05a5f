"""Faults on the real `hyperqwen serve` (issue 14): an engine crash mid-stream and a storm of
clients that vanish. Tiny synthetic model, dummy weights, with a key, on the GPU host.

- engine crash: SIGKILL to vLLM's engine-core process while streams are in flight. Every stream
  must end within CRASH_DEADLINE_S (an error event, a 5xx or a closed connection, never a hang)
  and the API process must exit non-zero on its own, so systemd's Restart=on-failure and
  compose's restart policy bring it back (tests/test_restart_policy.py checks those).
- disconnect storm: STORM streams opened and dropped after a random number of chunks; then
  /metrics must show no request running or waiting, and a chat must still be answered.

Run: `pytest -m gpu tests/test_faults_gpu.py`; logs under $HYPERQWEN_TEST_LOGS.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from gpu_server import chat, hyperqwen_server, log_dir, started_server
from test_serve_gpu import serve_env

from hyperqwen.engine.exit_status import ENGINE_DIED_EXIT_CODE

pytestmark = pytest.mark.gpu

KEY = "fault-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
CRASH_DEADLINE_S = 30
STREAMS = 8
STORM = 256


def serve(tiny_models_dir, port: int, log):
    """`hyperqwen serve batch` with a key; yields the server process once healthy."""
    env = serve_env(tiny_models_dir, PORT=str(port), GPU_UTIL="0.4", VLLM_API_KEY=KEY)
    return hyperqwen_server("batch", env, log, started_server)


def stream(base: str, max_tokens: int, stop_after: int | None = None) -> str:
    """One streamed completion: 'done', 'error: ...' (an error event or status), or 'dropped'
    (we closed it after stop_after chunks)."""
    body = {"model": "tiny", "prompt": "Count: 1, 2, 3,", "max_tokens": max_tokens,
            "min_tokens": max_tokens, "stream": True}  # fmt: skip
    try:
        with requests.post(
            f"{base}/v1/completions", json=body, headers=HEADERS, stream=True, timeout=60
        ) as response:
            if response.status_code != 200:
                return f"error: HTTP {response.status_code}"
            for count, line in enumerate(response.iter_lines()):
                if stop_after is not None and count >= stop_after:
                    return "dropped"
                if line.startswith(b"data: ") and b'"error"' in line:
                    return f"error: {line[:200]!r}"
                if line == b"data: [DONE]":
                    return "done"
            return "error: stream ended without [DONE]"
    except requests.RequestException as error:
        return f"error: {type(error).__name__}"


def engine_core_pids(api_pid: int, log) -> list[int]:
    """vLLM's engine-core processes among the API process's descendants: by their title where
    setproctitle is installed, else by the "(EngineCore pid=N)" prefix of their log lines (the GPU
    host's kit has no setproctitle, so titles there are plain python command lines)."""
    listing = subprocess.run(
        ["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True
    ).stdout
    logged = {int(pid) for pid in re.findall(r"\(EngineCore\S* pid=(\d+)\)", log.read_text())}
    children: dict[int, list[tuple[int, str]]] = {}
    for line in listing.splitlines():
        pid, ppid, args = line.split(None, 2)
        children.setdefault(int(ppid), []).append((int(pid), args))
    found, queue = [], [api_pid]
    while queue:
        for pid, args in children.get(queue.pop(), []):
            queue.append(pid)
            if "EngineCore" in args or pid in logged:
                found.append(pid)
    return found


def test_engine_crash_ends_every_stream_and_the_server_exits_non_zero(tiny_models_dir, tmp_path):
    log = log_dir(tmp_path) / "fault-engine-crash.log"
    base = "http://127.0.0.1:18041"
    with serve(tiny_models_dir, 18041, log) as process:
        engines = engine_core_pids(process.pid, log)
        assert engines, "no EngineCore process found under the API process"
        with ThreadPoolExecutor(STREAMS) as pool:
            futures = [pool.submit(stream, base, 3000) for _ in range(STREAMS)]
            time.sleep(3)  # streams are running
            killed_at = time.monotonic()
            for pid in engines:
                os.kill(pid, signal.SIGKILL)
            outcomes = [future.result(timeout=CRASH_DEADLINE_S + 30) for future in futures]
        ended_s = time.monotonic() - killed_at
        code = process.wait(timeout=CRASH_DEADLINE_S)
    summary = {"outcomes": outcomes, "streams_ended_s": round(ended_s, 1), "exit_code": code}
    (log_dir(tmp_path) / "fault-engine-crash.json").write_text(json.dumps(summary, indent=1))
    assert ended_s < CRASH_DEADLINE_S, summary
    assert all(outcome.startswith("error") for outcome in outcomes), summary
    assert code == ENGINE_DIED_EXIT_CODE, summary  # engine/exit_status.py


def test_a_disconnect_storm_leaves_nothing_running(tiny_models_dir, tmp_path):
    log = log_dir(tmp_path) / "fault-disconnect-storm.log"
    rng = random.Random(0)
    base = "http://127.0.0.1:18042"
    with serve(tiny_models_dir, 18042, log):
        cut_points = [rng.randint(0, 40) for _ in range(STORM)]
        lock, outcomes = threading.Lock(), []

        def one(stop_after: int) -> None:
            outcome = stream(base, 200, stop_after)
            with lock:
                outcomes.append(outcome)

        with ThreadPoolExecutor(64) as pool:
            list(pool.map(one, cut_points))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            metrics = requests.get(f"{base}/metrics", headers=HEADERS, timeout=10).text
            running = [
                float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
            ]
            if running and not any(running):
                break
            time.sleep(1)
        answer = chat(base, "tiny", key=KEY)
    summary = {
        "dropped": outcomes.count("dropped"),
        "done": outcomes.count("done"),
        "errors": [outcome for outcome in outcomes if outcome.startswith("error")],
        "left": running,
    }
    (log_dir(tmp_path) / "fault-disconnect-storm.json").write_text(json.dumps(summary, indent=1))
    assert len(outcomes) == STORM and not summary["errors"], summary
    assert running and not any(running), summary
    assert answer["usage"]["completion_tokens"] > 0
