"""The headers JIT kernels need beyond nvcc's own (hyperqwen/toolkit.py JIT_HEADERS): a toolkit
without them is named, with the wheel that brings them, by serve and by doctor, before a first
request fails (H200, 2026-12-02: FlashInfer's build stopped at curand_kernel.h where the
toolkit's wheels sat in another site-packages than torch's nvidia-curand)."""

from __future__ import annotations

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


def test_the_venv_install_sh_makes_has_every_header(venv_root):
    assert toolkit.missing_headers(venv_root) is None


@pytest.fixture
def split_toolkit(venv_root, tmp_path, monkeypatch) -> Path:
    """The GPU kit's layout: a site-packages first on sys.path whose nvidia/cu13 has nvcc and
    CUDA's headers but not nvidia-curand's."""
    root = tmp_path / "site" / "nvidia" / toolkit.VENV_TOOLKIT
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").symlink_to(venv_root / "bin" / "nvcc")
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").symlink_to(venv_root / "include" / "cuda_runtime.h")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert toolkit.venv_toolkit() == root
    return root


def no_system_toolkit(tmp_path: Path) -> dict[str, str]:
    return {
        "PATH": str(tmp_path / "no-bin"),
        toolkit.SYSTEM_TOOLKIT_ENV: str(tmp_path / "no-cuda"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }


def test_serve_says_which_header_is_missing_and_which_wheel_brings_it(split_toolkit, tmp_path):
    env, why = toolkit.toolkit_env(no_system_toolkit(tmp_path))
    assert env["CUDA_HOME"] == str(split_toolkit)
    assert why.startswith("no system toolkit; ")
    assert f"{split_toolkit / 'include'} has no curand_kernel.h" in why
    assert why.endswith("pip install nvidia-curand")


def test_doctor_warns_with_the_fix(split_toolkit, tmp_path):
    check = check_toolkit(no_system_toolkit(tmp_path))
    assert check.status == "WARN"
    assert str(split_toolkit) in check.detail
    assert "curand_kernel.h" in check.fix and "pip install nvidia-curand" in check.fix


def test_doctor_is_content_where_the_headers_are_there(venv_root, tmp_path):
    check = check_toolkit(no_system_toolkit(tmp_path))
    assert check.status == "OK", check.line()
    assert str(venv_root) in check.detail
