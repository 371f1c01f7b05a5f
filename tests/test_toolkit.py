"""The venv's CUDA toolkit for JIT-compiled kernels (hyperqwen/toolkit.py): found, used only
where the system has none, and working (its nvcc runs)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hyperqwen import toolkit
from hyperqwen.doctor import check_toolkit


@pytest.fixture
def venv_root() -> Path:
    root = toolkit.venv_toolkit()
    if root is None:
        pytest.skip("this venv has no nvidia/cu13 toolkit (install.sh installs one)")
    return root


def test_the_venv_toolkit_compiles(venv_root, tmp_path):
    shown = subprocess.run(
        [str(venv_root / "bin" / "nvcc"), "--version"], capture_output=True, text=True
    )
    assert shown.returncode == 0 and "release 13." in shown.stdout
    assert (venv_root / "include" / "cuda_runtime.h").is_file()


def test_used_only_without_a_system_toolkit(venv_root, tmp_path, monkeypatch):
    bare = {"PATH": str(tmp_path)}  # no nvcc on it
    monkeypatch.setattr(toolkit, "SYSTEM_TOOLKIT", tmp_path / "no-cuda")
    env = toolkit.toolkit_env(bare)
    assert env == {"CUDA_HOME": str(venv_root), "PATH": f"{venv_root / 'bin'}:{tmp_path}"}
    assert "the venv's" in check_toolkit(bare).detail
    assert toolkit.toolkit_env({**bare, "CUDA_HOME": "/opt/cuda"}) == {}
    (tmp_path / "nvcc").write_text("#!/bin/sh\n")
    (tmp_path / "nvcc").chmod(0o755)
    assert toolkit.toolkit_env(bare) == {}  # an nvcc on PATH wins
    assert "nvcc on PATH" in check_toolkit(bare).detail
