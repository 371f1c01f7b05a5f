"""After a crash the server comes back: systemd restarts on failure, compose unless stopped, and
nothing between them and vLLM hides vLLM's exit: the launchers exec `hyperqwen serve`, which
execs vLLM, so vLLM is the service's process and its exit status is the service's.

The policies are read as their tools read them (docker-compose's own resolution of the compose
file, the unit's [Service] section); the exec chain is run, with stand-ins at its far end that
report their PID and exit with a status of their own.
"""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import process_group
import pytest
from test_container import SERVERS, compose_config

from hyperqwen.cli import VLLM_CLI_MODULE

ROOT = Path(__file__).resolve().parents[1]
INSTALLED_AT = Path("/opt/hyperqwen")  # where the units expect the checkout
CRASH_STATUS = 3  # what the stand-ins exit with: neither 0 nor an argparse error
MODES = {"single-user": "single", "batch": "batch"}  # launcher folder -> serve mode


def unit_service(folder: str) -> configparser.SectionProxy:
    (unit_file,) = (ROOT / folder).glob("hyperqwen-*.service")
    unit = configparser.ConfigParser(strict=False, interpolation=None)  # systemd's last wins
    unit.optionxform = str  # keys are case-sensitive
    unit.read(unit_file)
    return unit["Service"]


@pytest.mark.parametrize("folder", sorted(MODES))
def test_systemd_restarts_the_launcher_on_failure(folder):
    service = unit_service(folder)
    assert service["Restart"] == "on-failure"
    assert int(service["RestartSec"]) > 0
    # The unit runs this folder's launcher; Type=exec waits for its exec to succeed.
    assert service["Type"] == "exec"
    launcher = Path(service["ExecStart"])
    assert launcher == INSTALLED_AT / folder / "serve.sh"
    assert (ROOT / launcher.relative_to(INSTALLED_AT)).is_file()


@pytest.mark.parametrize("profile", SERVERS)
def test_compose_restarts_the_server_but_not_the_one_shot_prepare(tmp_path, profile):
    services = compose_config(tmp_path, profile)["services"]
    assert services[profile]["restart"] == "unless-stopped"
    # A prepare restarted after it succeeded would run forever; the server waits for it.
    assert "restart" not in services["prepare"]


def stand_in(path: Path, script: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    path.chmod(0o755)


@pytest.mark.parametrize("folder", sorted(MODES))
def test_the_launcher_becomes_hyperqwen_serve(tmp_path, folder):
    venv = tmp_path / "venv"
    stand_in(venv / "bin" / "hyperqwen", f'#!/bin/sh\necho "$$ $*"\nexit {CRASH_STATUS}\n')
    with process_group.started(
        ["bash", str(ROOT / folder / "serve.sh"), "--extra"],
        env={"PATH": os.environ["PATH"], "HYPERQWEN_VENV": str(venv)},
        stdout=subprocess.PIPE,
        text=True,
    ) as launcher:
        output, _ = launcher.communicate(timeout=60)
    assert output == f"{launcher.pid} serve {MODES[folder]} --extra\n"  # the same process
    assert launcher.returncode == CRASH_STATUS


def test_serve_becomes_vllm_whose_exit_status_is_the_services(tmp_path, tiny_checkpoint):
    """Up to the exec on this CPU machine: a stand-in nvidia-smi lists a GPU, a stand-in vLLM
    package (first on PYTHONPATH) takes the place of vLLM's CLI module."""
    stand_in(
        tmp_path / "bin" / "nvidia-smi",
        "#!/bin/sh\necho '0, NVIDIA H200, 9.0, 143771, 580.95.05, 700.00'\n",
    )
    package = tmp_path / "stand-in"
    *parents, module = VLLM_CLI_MODULE.split(".")
    for depth in range(len(parents)):
        stand_in(package.joinpath(*parents[: depth + 1], "__init__.py"), "")
    stand_in(
        package.joinpath(*parents, f"{module}.py"),
        f"import os, sys\nprint(os.getpid(), *sys.argv[1:3])\nsys.exit({CRASH_STATUS})\n",
    )
    env = {
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": f"{package}{os.pathsep}{ROOT / 'src'}",
        "HOME": str(tmp_path),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "MODEL": str(tiny_checkpoint),
    }
    with process_group.started(
        [sys.executable, "-m", "hyperqwen.cli", "serve", "single"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as serve:
        output, errors = serve.communicate(timeout=120)
    assert serve.returncode == CRASH_STATUS, errors
    assert output.splitlines()[-1] == f"{serve.pid} serve {tiny_checkpoint}"
