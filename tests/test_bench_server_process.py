"""A server process's lifetime (bench/server_process.py) with real processes: one that never
gets healthy and one that exits first fail with their log, and nothing of either is left.
The healthy path runs in every `bench ab` test (test_bench_ab_runs.py)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from hyperqwen.bench.server_process import ServerStartError, free_port, running_server, weight_gib


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
