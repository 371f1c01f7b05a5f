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


def fake_nvcc(folder: Path, release: str) -> Path:
    """An nvcc that reports `release` (a system toolkit of another release cannot run here)."""
    folder.mkdir(parents=True, exist_ok=True)
    nvcc = folder / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    return nvcc


def test_used_only_without_a_usable_system_toolkit(venv_root, tmp_path, monkeypatch):
    bare = {"PATH": str(tmp_path), toolkit.SYSTEM_TOOLKIT_ENV: str(tmp_path / "no-cuda")}
    env, why = toolkit.toolkit_env(bare)
    assert env == {"CUDA_HOME": str(venv_root), "PATH": f"{venv_root / 'bin'}:{tmp_path}"}
    assert why == "no system toolkit"
    assert "the venv's" in check_toolkit(bare).detail
    assert toolkit.toolkit_env({**bare, "CUDA_HOME": "/opt/cuda"}) == ({}, "")
    ours = toolkit.nvcc_release(venv_root / "bin" / "nvcc")
    fake_nvcc(tmp_path, f"{ours[0]}.0")
    assert toolkit.toolkit_env(bare) == ({}, "")  # an nvcc of torch's release on PATH wins
    assert "nvcc on PATH" in check_toolkit(bare).detail
    # /usr/local/cuda (here: where HYPERQWEN_SYSTEM_CUDA points) counts like nvcc on PATH
    fake_nvcc(tmp_path / "cuda" / "bin", f"{ours[0]}.2")
    elsewhere = {
        "PATH": str(tmp_path / "empty"),
        toolkit.SYSTEM_TOOLKIT_ENV: str(tmp_path / "cuda"),
    }
    assert toolkit.toolkit_env(elsewhere) == ({}, "")


def test_a_system_toolkit_of_another_release_gives_way(venv_root, tmp_path):
    """A CUDA 12 nvcc cannot build kernels for this CUDA 13 torch: the venv's is used, and said
    why; a CUDA_HOME the user set is kept, and doctor warns."""
    fake_nvcc(tmp_path / "bin", "12.4")
    ours = toolkit.nvcc_release(venv_root / "bin" / "nvcc")
    on_path = {"PATH": str(tmp_path / "bin"), toolkit.SYSTEM_TOOLKIT_ENV: str(tmp_path / "none")}
    env, why = toolkit.toolkit_env(on_path)
    assert env["CUDA_HOME"] == str(venv_root)
    assert why == f"nvcc on PATH ({tmp_path / 'bin' / 'nvcc'}) is CUDA 12.4, this torch and the " \
        f"venv's toolkit CUDA {ours[0]}.{ours[1]}"  # fmt: skip
    assert "the venv's" in check_toolkit(on_path).detail
    explicit = {**on_path, "CUDA_HOME": str(tmp_path)}
    assert toolkit.toolkit_env(explicit) == ({}, "")
    check = check_toolkit(explicit)
    assert (
        check.status == "WARN" and "is CUDA 12.4" in check.detail and "unset CUDA_HOME" in check.fix
    )


def test_an_nvcc_that_does_not_run_has_no_release(tmp_path):
    broken = tmp_path / "nvcc"
    broken.write_text("not a program")
    assert toolkit.nvcc_release(broken) is None
    assert toolkit.nvcc_release(fake_nvcc(tmp_path / "ok", "13.1")) == (13, 1)
