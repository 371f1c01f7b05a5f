"""Run the real `hyperqwen` CLI: in a subprocess with a clean environment, or in this process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def hyperqwen(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """Only PATH, PYTHONPATH and what the test sets reach the child: no stray knobs. Its HOME
    is `cwd` (unless the test sets one), so nothing it writes under ~ lands outside the test's
    folder."""
    base = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT / "src"), "HOME": str(cwd)}
    return subprocess.run(
        [sys.executable, "-m", "hyperqwen.cli", *args],
        env={**base, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def path_with_nvidia_smi(folder: Path, csv_line: str) -> str:
    """A PATH whose `nvidia-smi` is a stand-in answering one card's CSV line (gpu.list_gpus
    reads it), so `hyperqwen serve` sees that card; the rest of PATH is the system's."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{csv_line}'\n")
    smi.chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


def run_in_process(*args: str) -> int:
    """`hyperqwen ARGS` through the real parser in this process; the exit code."""
    from hyperqwen.cli import build_parser

    parsed = build_parser().parse_args(list(args))
    return parsed.func(parsed)
