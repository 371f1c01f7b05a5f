"""The facts that make two benchmark runs comparable, printed above the ROW lines.

The six a field report asks for: GPU, power limit, driver, OS/container, commit and setup
(mode, effective knobs, vLLM version, patch series). Hardware facts come from nvidia-smi on
the machine running the benchmark (normally the server's own); a fact that cannot be read is
"not measured (why)", never guessed.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from hyperqwen.bench.client import BenchClient, BenchError
from hyperqwen.gpu import NoGpu, list_gpus
from hyperqwen.launch import effective_config_lines
from hyperqwen.settings import LoadedSettings

REPO_ROOT = Path(__file__).resolve().parents[3]
HEADER_PREFIX = "# "


def gpu_facts() -> dict[str, str]:
    """GPU names, driver and power limit, one entry per fact (all GPUs, comma separated)."""
    try:
        gpus = list_gpus()
    except NoGpu as reason:
        missing = f"not measured ({reason})"
        return {"gpu": missing, "driver": missing, "power_limit": missing}
    return {
        "gpu": ", ".join(f"{gpu.name} ({gpu.sm}, {gpu.memory_gib:.0f} GiB)" for gpu in gpus),
        "driver": ", ".join(sorted({gpu.driver for gpu in gpus})),
        "power_limit": ", ".join(gpu.power_limit for gpu in gpus),
    }


def os_fact(environ: dict[str, str]) -> str:
    where = "container" if environ.get("HYPERQWEN_IN_CONTAINER") == "1" else "host"
    return f"{platform.platform()} ({where}), Python {platform.python_version()}"


def git_commit() -> str:
    """`git describe --always --dirty` of the checkout this package runs from."""
    if not (REPO_ROOT / ".git").exists():
        return "not measured (not run from a git checkout)"
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except OSError as reason:
        return f"not measured ({reason})"
    return done.stdout.strip() or f"not measured (git: {done.stderr.strip()})"


def patch_fact() -> str:
    """Whether this interpreter's vLLM carries the whole patch series."""
    try:
        from hyperqwen.patches.series import PatchSeriesError
        from hyperqwen.patches.tree import series_status
    except ImportError as reason:
        return f"not measured ({reason})"
    try:
        applied, summary = series_status()
    except PatchSeriesError as reason:
        return f"not measured ({reason})"
    return f"{'applied' if applied else 'NOT applied'}: {summary}"


def server_version(client: BenchClient) -> str:
    try:
        return str(client.get_json("/version").get("version", "not reported"))
    except BenchError as reason:
        return f"not measured ({reason})"


def collect_header(
    client: BenchClient,
    loaded: LoadedSettings,
    api_key: str | None,
    workload_facts: dict[str, str],
) -> dict[str, object]:
    """Every fact, in print order; `settings` is a list of knob lines."""
    return {
        **gpu_facts(),
        "os": os_fact(dict(os.environ)),
        "vllm": server_version(client),
        "patches": patch_fact(),
        "commit": git_commit(),
        "server": client.base_url,
        **workload_facts,
        "settings": [line.strip() for line in effective_config_lines(loaded, api_key)],
    }


def format_header(header: dict[str, object]) -> list[str]:
    lines = []
    for key, value in header.items():
        if isinstance(value, list):
            lines.append(f"{HEADER_PREFIX}{key}:")
            lines += [f"{HEADER_PREFIX}  {item}" for item in value]
        else:
            lines.append(f"{HEADER_PREFIX}{key}: {value}")
    return lines
