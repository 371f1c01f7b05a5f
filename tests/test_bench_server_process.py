"""A server process's lifetime (bench/server_process.py) with real processes: one that never
gets healthy and one that exits first fail with their log, and nothing of either is left.
The healthy path runs in every `bench ab` test (test_bench_ab_runs.py)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from hyperqwen.bench.server_process import (
    ServerStartError,
    all_running,
    free_port,
    running_server,
    weight_gib,
)


def processes_with(token: str) -> list[str]:
    """The pids of the processes whose command line holds `token`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if token.encode() in (proc / "cmdline").read_bytes():
                found.append(proc.name)
        except OSError:  # it ended meanwhile
            continue
    return found


def test_a_server_that_never_answers_is_stopped_with_its_group(tmp_path) -> None:
    # it forks a child, as vLLM starts engine-core workers; the token marks both
    token = f"never-healthy-{uuid.uuid4()}"
    script = f"import os, time; os.fork(); time.sleep(600)  # {token}"
    log, base = tmp_path / "server.log", f"http://127.0.0.1:{free_port()}"
    server = running_server([sys.executable, "-c", script], None, log, base, 0.5, "--wait")
    with pytest.raises(ServerStartError) as refused, server:
        pytest.fail("a server that never listens was taken for healthy")
    assert str(refused.value) == f"not healthy after 0.5 s (--wait); log: {log}"
    assert processes_with(token) == []


def test_a_server_that_exits_first_fails_with_the_end_of_its_log(tmp_path) -> None:
    command = [sys.executable, "-c", "print('Model loading took 13.50 GiB'); raise SystemExit(3)"]
    server = running_server(command, None, tmp_path / "server.log", "http://127.0.0.1:1", 60)
    exited = "exited with 3 before it was healthy"
    with pytest.raises(ServerStartError, match=exited) as refused, server:
        pytest.fail("an exited server was taken for healthy")
    assert str(refused.value).endswith("Model loading took 13.50 GiB\n")
    assert weight_gib((tmp_path / "server.log").read_text()) == 13.5


def healthy_server(port: int, token: str) -> list[str]:
    """A stand-in for `vllm serve`: answers 200 on every path once it listens (it sleeps first,
    so servers started together overlap their waits)."""
    script = (
        "import http.server, time\n"
        "class Health(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *args):\n"
        "        pass\n"
        "time.sleep(0.5)\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), Health).serve_forever()  # {token}"
    )
    return [sys.executable, "-c", script]


def test_servers_started_together_are_all_up_then_all_stopped(tmp_path) -> None:
    token = f"together-{uuid.uuid4()}"
    ports = [free_port(), free_port()]
    servers = [
        running_server(
            healthy_server(port, token),
            None,
            tmp_path / f"{port}.log",
            f"http://127.0.0.1:{port}",
            60,
        )
        for port in ports
    ]
    with all_running(servers) as running:
        assert [server.process.poll() for server in running] == [None, None]
        assert len(processes_with(token)) == 2
    assert processes_with(token) == []


def test_one_server_failing_to_start_stops_the_others_and_raises_its_error(tmp_path) -> None:
    token = f"beside-a-failure-{uuid.uuid4()}"
    port = free_port()
    servers = [
        running_server(
            healthy_server(port, token), None, tmp_path / "up.log", f"http://127.0.0.1:{port}", 60
        ),
        running_server(
            [sys.executable, "-c", "raise SystemExit(5)"],
            None,
            tmp_path / "down.log",
            "http://127.0.0.1:1",
            60,
        ),
    ]
    with pytest.raises(ServerStartError, match="exited with 5"), all_running(servers):
        pytest.fail("a failed start was taken for all servers up")
    assert processes_with(token) == []


def test_keep_going_yields_a_failed_start_in_its_place_beside_the_running(tmp_path) -> None:
    token = f"keep-going-{uuid.uuid4()}"
    port = free_port()
    servers = [
        running_server([sys.executable, "-c", "raise SystemExit(5)"], None,
                       tmp_path / "down.log", "http://127.0.0.1:1", 60),
        running_server(healthy_server(port, token), None, tmp_path / "up.log",
                       f"http://127.0.0.1:{port}", 60),
    ]  # fmt: skip
    with all_running(servers, keep_going=True) as running:
        failed, up = running
        assert isinstance(failed, ServerStartError) and "exited with 5" in str(failed)
        assert up.process.poll() is None and len(processes_with(token)) == 1
    assert processes_with(token) == []
