"""`vllm serve` exits non-zero after its engine core died (engine/exit_status.py,
patches/engine-death-exit.patch), so systemd's Restart=on-failure brings the service back.

Each case runs the installed (patched) vLLM's serve subcommand in a fresh Python: its real
argument parsing, its real `terminate_if_errored` and its real single-server path, with only the
server run replaced, because an engine core cannot start without a GPU. The stand-in run asks
`terminate_if_errored` about an engine client that is dead (or healthy), as vLLM's request error
handlers and watchdog do. The GPU side, a SIGKILLed engine core under load, is
tests/test_faults_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hyperqwen.engine.exit_status import ENGINE_DIED_EXIT_CODE

SERVE = """
import sys, types
import uvicorn
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform

platforms._current_platform = CpuPlatform()  # vLLM's argument defaults ask for a device
import vllm.entrypoints.cli.serve as serve
from vllm.entrypoints.launcher import terminate_if_errored
from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

dead = sys.argv[1] == "dead"
server = uvicorn.Server(uvicorn.Config(app=None))
engine = types.SimpleNamespace(errored=dead, is_running=not dead)

async def run_server(args):
    terminate_if_errored(server, engine)
    print("should_exit", server.should_exit, flush=True)

serve.run_server = run_server
args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", sys.argv[2]])
serve.ServeSubcommand.cmd(args)
print("returned", flush=True)
"""


@pytest.mark.parametrize(
    ("engine", "code", "should_exit"),
    [("dead", ENGINE_DIED_EXIT_CODE, True), ("healthy", 0, False)],
)
def test_serve_exits_non_zero_only_after_its_engine_died(
    tiny_checkpoint, engine, code, should_exit
):
    result = subprocess.run(
        [sys.executable, "-c", SERVE, engine, str(tiny_checkpoint)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == code, result.stderr[-3000:]
    assert f"should_exit {should_exit}" in result.stdout
    assert ("returned" in result.stdout) == (engine == "healthy")
    if engine == "dead":
        assert "the engine core died; exiting with status 70" in result.stdout + result.stderr


def test_keep_alive_on_engine_death_keeps_vllms_behaviour(tiny_checkpoint):
    """VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1: vLLM keeps the server up, so nothing is recorded."""
    result = subprocess.run(
        [sys.executable, "-c", SERVE, "dead", str(tiny_checkpoint)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "should_exit False" in result.stdout
