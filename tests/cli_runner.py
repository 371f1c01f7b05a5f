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


def run_in_process(*args: str) -> int:
    """`hyperqwen ARGS` through the real parser in this process; the exit code."""
    from hyperqwen.cli import build_parser

    parsed = build_parser().parse_args(list(args))
    return parsed.func(parsed)
