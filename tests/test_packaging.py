"""A regular (non-editable) install carries what the code needs outside the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import process_group
from cli_runner import ROOT

# A checkout's local state, never part of a build (.gitignore and .dockerignore list it too).
LOCAL_STATE = {".git", ".venv", "build", "dist", "models", "bench-results", ".gpu-kit", ".whl",
               ".pytest_cache", ".ruff_cache"}  # fmt: skip


def _not_sources(folder: str, names: list[str]) -> list[str]:
    top = Path(folder) == ROOT
    return [
        name
        for name in names
        if (top and name in LOCAL_STATE) or name == "__pycache__" or name.endswith(".egg-info")
    ]


def test_wheel_carries_the_patch_series(tmp_path):
    # Built from a copy: setuptools writes build/ and an .egg-info beside what it builds.
    source = shutil.copytree(ROOT, tmp_path / "source", ignore=_not_sources, symlinks=True)
    process_group.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), source],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("hyperqwen-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = "hyperqwen-0.1.0.data/data/share/hyperqwen/patches/"
    series = (ROOT / "patches" / "series").read_text().split()
    listed = [name for name in series if name.endswith(".patch")]
    assert f"{data}series" in names
    assert {f"{data}{name}" for name in listed} <= names
    assert "hyperqwen/cli.py" in names


def test_python_dash_m_hyperqwen_is_the_hyperqwen_command():
    shown = subprocess.run(
        [sys.executable, "-m", "hyperqwen", "settings", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: hyperqwen settings")
    wrong = subprocess.run(
        [sys.executable, "-m", "hyperqwen", "no-such-command"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert wrong.returncode == 2 and "invalid choice" in wrong.stderr  # the exit code gets out
