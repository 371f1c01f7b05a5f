"""After a crash the server comes back: systemd restarts on failure, compose unless stopped, and
the launchers exec `hyperqwen serve`, which execs vLLM, so vLLM's exit code is the service's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mode", ["single-user", "batch"])
def test_systemd_units_restart_on_failure_and_launchers_exec(mode):
    unit = next((ROOT / mode).glob("hyperqwen-*.service")).read_text()
    assert re.search(r"^Restart=on-failure$", unit, re.MULTILINE)
    assert re.search(r"^RestartSec=\d+$", unit, re.MULTILINE)
    launcher = (ROOT / mode / "serve.sh").read_text()
    assert re.search(r"^exec .*hyperqwen\" serve ", launcher, re.MULTILINE)


def test_compose_servers_restart_unless_stopped():
    compose = (ROOT / "docker-compose.yml").read_text()
    assert "restart: unless-stopped" in compose


def test_serve_execs_vllm_so_its_exit_code_is_the_services():
    source = (ROOT / "src" / "hyperqwen" / "cli.py").read_text()
    serve = source[source.index("def cmd_serve") : source.index("def cmd_doctor")]
    assert "os.execve(sys.executable, command" in serve
