"""Start a real `hyperqwen serve` on the GPU host for `pytest -m gpu` tests, and talk to it."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from hyperqwen.bench import server_process
from hyperqwen.patches.series import load_series
from hyperqwen.patches.tree import (
    PatchState,
    apply_series,
    check_series,
    default_vllm_dir,
    series_status,
)
from hyperqwen.vllm_plugin import entry_point_installed

ROOT = Path(__file__).resolve().parents[1]
# The 27B-geometry server needs ~4 min cold; a tiny one ~1.5 min (torch.compile, CUDA graphs).
STARTUP_TIMEOUT_S = 600
# GDN prefill on sm90 defaults to FlashInfer (JIT via nvcc); the Triton path is what the
# users' Ampere/Ada cards run, so the tests use it on Hopper too.
TRITON_GDN = """--additional-config '{"gdn_prefill_backend":"triton"}'"""
COMMAND_TIMEOUT_S = 600  # one CLI run beside a started server (a bench pass, a conversion)


def require_gpu() -> None:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs a CUDA GPU (nvidia-smi not found)")


def log_dir(tmp_path: Path) -> Path:
    """$HYPERQWEN_TEST_LOGS (e.g. the device tool's $OUT) keeps server logs; else tmp_path."""
    target = Path(os.environ.get("HYPERQWEN_TEST_LOGS", tmp_path))
    target.mkdir(parents=True, exist_ok=True)
    return target


PATCHED_VLLM_ENV = "HYPERQWEN_PATCHED_VLLM"
STOCK_VLLM_ENV = "HYPERQWEN_STOCK_VLLM"


def patched_vllm_parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The parent folder of a patched `vllm/`: $HYPERQWEN_PATCHED_VLLM (checked), else a copy of
    the `vllm/` this Python would import, with the series applied (the original stays as is)."""
    if configured := os.environ.get(PATCHED_VLLM_ENV):
        vllm_dir = Path(configured) / "vllm"
        applied, summary = series_status(vllm_dir, ROOT / "patches")
        if not applied:
            pytest.fail(
                f"{PATCHED_VLLM_ENV}={configured}: {summary}. Apply the series there "
                f"(hyperqwen patches apply {vllm_dir}) or unset {PATCHED_VLLM_ENV} to let the "
                "test patch a copy of the importable vLLM"
            )
        return Path(configured)
    target = tmp_path_factory.mktemp("gpu-patched") / "vllm"
    shutil.copytree(default_vllm_dir(), target, symlinks=True)
    apply_series(load_series(ROOT / "patches"), target)
    return target.parent


def stock_vllm_parent() -> Path:
    """The parent folder of a pristine `vllm/`: $HYPERQWEN_STOCK_VLLM, else the importable one,
    which must then have none of the series applied."""
    parent = Path(os.environ.get(STOCK_VLLM_ENV, default_vllm_dir().parent))
    checks = check_series(load_series(ROOT / "patches"), parent / "vllm")
    if any(check.state != PatchState.MISSING for check in checks):
        pytest.fail(f"{parent / 'vllm'} is not stock vLLM; set {STOCK_VLLM_ENV} to a pristine copy")
    return parent


def write_plugin_metadata(folder: Path) -> Path:
    """`folder`, holding hyperqwen's distribution metadata with pyproject.toml's entry points
    as pip writes it: what vLLM's plugin loader looks the package up by."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = folder / f"hyperqwen-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: hyperqwen\n"
                                   f"Version: {project['version']}\n")  # fmt: skip
    sections = [
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items())
        for group, entries in project["entry-points"].items()
    ]
    (info / "entry_points.txt").write_text("\n".join(sections))
    return folder


@functools.cache
def plugin_metadata_path() -> str | None:
    """Where this Python imports hyperqwen from a source folder only (the GPU kit's host puts
    src/ on PYTHONPATH), a folder of its entry-point metadata, so that vLLM loads the plugin
    (`hyperqwen serve` refuses KV=kvarn without it); None where the package is installed."""
    if entry_point_installed():
        return None
    return str(write_plugin_metadata(Path(tempfile.mkdtemp(prefix="hyperqwen-plugin-"))))


def with_vllm_first(parent: Path) -> dict[str, str]:
    """This environment with `parent` (holding a vllm/ package) first on PYTHONPATH, and the
    plugin's entry point where the package is not installed."""
    folders = [str(parent), plugin_metadata_path(), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, folders))}


@contextlib.contextmanager
def running_server(
    command: list[str], base: str, log: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    """Run `command` in its own process group; yield `base` once /health is 200, then stop it."""
    with started_server(command, base, log, env):
        yield base


@contextlib.contextmanager
def started_server(
    command: list[str], base: str, log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """running_server, yielding the server process (for tests that kill parts of it)."""
    with server_process.running_server(command, env, log, base, STARTUP_TIMEOUT_S) as server:
        yield server.process


def hyperqwen_server(mode: str, env: dict[str, str], log: Path, server=None):
    """`hyperqwen serve MODE` with these knobs (PORT among them) as a running_server (or as
    `server`, e.g. started_server)."""
    base = f"http://127.0.0.1:{env.get('PORT', '18020')}"
    command = [sys.executable, "-m", "hyperqwen.cli", "serve", mode]
    return (server or running_server)(command, base, log, serve_env(env))


def serve_env(env: dict[str, str]) -> dict[str, str]:
    """This process's environment with these knobs, for `hyperqwen serve`: serve emits the
    series' own flags, so a host that keeps stock vLLM first on its path (the GPU kit) puts the
    patched copy it names in front."""
    parts = [str(ROOT / "src"), os.environ.get(PATCHED_VLLM_ENV), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, parts)), **env}


def complete(base: str, prompt: str, timeout: float = 300, **extra) -> dict:
    """The first choice of a greedy /v1/completions answer of the model served as "tiny"."""
    response = requests.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "temperature": 0, **extra},
        timeout=timeout,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def top2_margins(choice: dict) -> list[float]:
    """Each generated step's gap between its top two log-probabilities (asked with logprobs=2);
    0.0 where one entry came back: both candidates decode alike, a tie for all we know."""
    margins = []
    for top in choice["logprobs"]["top_logprobs"]:
        ranked = sorted(top.values(), reverse=True)
        margins.append(ranked[0] - ranked[1] if len(ranked) > 1 else 0.0)
    return margins


def agreeing_prefix(reference: dict, candidate: dict, near_tie: float) -> tuple[int, bool]:
    """(tokens equal before the first difference of the two "greedy_ids", whether that difference
    is at a near tie: the reference's top-2 margin there below `near_tie`)."""
    for index, (want, got) in enumerate(
        zip(reference["greedy_ids"], candidate["greedy_ids"], strict=True)
    ):
        if want != got:
            return index, reference["margins"][index] < near_tie
    return len(reference["greedy_ids"]), True


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


def run_logged(command: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> str:
    """Run `command` (in `cwd`: one without a stray .env or api_key.txt, where that matters);
    its output goes to `log`. Returns stdout; a non-zero exit fails the test with the end of
    the output."""
    done = subprocess.run(
        command,
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, (
        f"{shlex.join(command)} exited {done.returncode}; log {log}:\n{done.stderr[-4000:]}"
    )
    return done.stdout


def bench_serve(
    base: str,
    model: str,
    tokenizer: Path,
    env: dict[str, str],
    result: Path,
    *,
    concurrency: int,
    prompts: int,
    input_len: int = 128,
    output_len: int = 128,
    extra: tuple[str, ...] = (),
) -> dict:
    """`vllm bench serve` (random token prompts, EOS ignored, plus `extra` flags) against `base`;
    its result JSON. Its output goes to RESULT.log. `concurrency` warm-up requests go first,
    unmeasured: a server's first requests of a batch shape compile Triton kernels, which would be
    counted against whichever side runs first."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "vllm", "--base-url", base, "--model", model, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--ignore-eos", "--num-prompts", str(prompts),
        "--max-concurrency", str(concurrency), "--num-warmups", str(concurrency),
        "--seed", "0", "--save-result",
        "--result-dir", str(result.parent), "--result-filename", result.name, *extra,
    ]  # fmt: skip
    run_logged(command, env, result.with_suffix(".log"))
    return json.loads(result.read_text())
