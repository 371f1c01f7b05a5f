"""The venv's CUDA toolkit for JIT-compiled kernels (hyperqwen/toolkit.py): found, used only
where the system has none, and working (its nvcc runs)."""

from __future__ import annotations

import ctypes
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
        [str(venv_root / "bin" / "nvcc"), "--version"], capture_output=True, text=True, timeout=60
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
    bare = {
        "PATH": str(tmp_path),
        toolkit.SYSTEM_TOOLKIT_ENV: str(tmp_path / "no-cuda"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    env, why = toolkit.toolkit_env(bare)
    links = env.pop("LIBRARY_PATH")
    assert env == {"CUDA_HOME": str(venv_root), "PATH": f"{venv_root / 'bin'}:{tmp_path}"}
    assert why == "no system toolkit"
    assert Path(links).parent == tmp_path / "cache" / "hyperqwen" / "cuda-link"
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
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    assert toolkit.toolkit_env(elsewhere) == ({}, "")


def test_a_system_toolkit_of_another_release_gives_way(venv_root, tmp_path):
    """A CUDA 12 nvcc cannot build kernels for this CUDA 13 torch: the venv's is used, and said
    why; a CUDA_HOME the user set is kept, and doctor warns."""
    fake_nvcc(tmp_path / "bin", "12.4")
    ours = toolkit.nvcc_release(venv_root / "bin" / "nvcc")
    on_path = {
        "PATH": str(tmp_path / "bin"),
        toolkit.SYSTEM_TOOLKIT_ENV: str(tmp_path / "none"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),  # the link folder goes there, not to ~
    }
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


PROBE = """
#include <cuda_runtime.h>
extern "C" int runtime_version() { int v = 0; return cudaRuntimeGetVersion(&v) == 0 ? v : -1; }
"""


def link_probe(tmp_path: Path, root: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Build a shared library with the venv's nvcc the way FlashInfer's JIT links its kernels
    (-L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart)."""
    (tmp_path / "probe.cu").write_text(PROBE)
    return subprocess.run(
        [str(root / "bin" / "nvcc"), "-shared", "-Xcompiler", "-fPIC", str(tmp_path / "probe.cu"),
         f"-L{root}/lib64", f"-L{root}/lib64/stubs", "-lcudart", "-o", str(tmp_path / "probe.so")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def test_jit_links_find_the_venvs_cudart(venv_root, tmp_path):
    """The wheels hold libcudart.so.13 but no libcudart.so: `-lcudart` fails against the venv's
    toolkit alone, and links through serve's LIBRARY_PATH; the library built calls the venv's
    CUDA runtime (no GPU needed to ask its version)."""
    bare = {
        "PATH": str(tmp_path),
        toolkit.SYSTEM_TOOLKIT_ENV: str(tmp_path / "no-cuda"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    env, _ = toolkit.toolkit_env(bare)
    system_path = {"PATH": "/usr/bin:/bin"}
    unaided = link_probe(tmp_path, venv_root, system_path)
    assert unaided.returncode != 0 and "cannot find -lcudart" in unaided.stdout + unaided.stderr
    linked = link_probe(tmp_path, venv_root, {**system_path, "LIBRARY_PATH": env["LIBRARY_PATH"]})
    assert linked.returncode == 0, linked.stderr
    runtime = toolkit.link_names(venv_root, None)["libcudart.so"]
    ctypes.CDLL(str(runtime), mode=ctypes.RTLD_GLOBAL)  # as torch has loaded it when FlashInfer
    probe = ctypes.CDLL(str(tmp_path / "probe.so"))
    assert probe.runtime_version() // 1000 == toolkit.nvcc_release(venv_root / "bin" / "nvcc")[0]


def test_the_link_folder_is_made_once_and_whole(tmp_path):
    runtime = tmp_path / "toolkit" / "lib" / "libcudart.so.13"
    runtime.parent.mkdir(parents=True)
    runtime.write_bytes(b"not really a library")
    driver = tmp_path / "driver" / "libcuda.so.1"
    driver.parent.mkdir()
    driver.write_bytes(b"nor this")
    names = toolkit.link_names(tmp_path / "toolkit", driver)
    assert names == {"libcudart.so": runtime, "libcuda.so": driver}
    folder = toolkit.link_folder(names, tmp_path / "cache")
    assert {link.name: link.readlink() for link in folder.iterdir()} == names
    assert toolkit.link_folder(names, tmp_path / "cache") == folder
    assert list(folder.parent.iterdir()) == [folder]  # no staging folder left behind
    without_driver = toolkit.link_folder(toolkit.link_names(tmp_path / "toolkit", None),
                                         tmp_path / "cache")  # fmt: skip
    assert without_driver != folder and [p.name for p in without_driver.iterdir()] == [
        "libcudart.so"
    ]


def test_an_unwritable_cache_is_said_and_serving_goes_on(venv_root, tmp_path):
    (tmp_path / "a-file").write_text("")
    bare = {
        "PATH": str(tmp_path),
        toolkit.SYSTEM_TOOLKIT_ENV: str(tmp_path / "no-cuda"),
        "XDG_CACHE_HOME": str(tmp_path / "a-file"),
    }
    env, why = toolkit.toolkit_env(bare)
    assert env["CUDA_HOME"] == str(venv_root) and "LIBRARY_PATH" not in env
    assert why.startswith("no system toolkit; no link folder for -lcudart")
    assert "set XDG_CACHE_HOME to a writable folder" in why


def test_the_driver_library_comes_from_the_loaders_cache(tmp_path, monkeypatch):
    driver = tmp_path / "libcuda.so.1"
    driver.write_bytes(b"")
    ldconfig = tmp_path / "bin" / "ldconfig"
    ldconfig.parent.mkdir()
    ldconfig.write_text(
        "#!/bin/sh\necho '3 libs found in cache'\n"
        "echo '\tlibcuda.so.1 (libc6) => /nonexistent/lib32/libcuda.so.1'\n"
        f"echo '\tlibcuda.so.1 (libc6,x86-64) => {driver}'\n"
        "echo '\tlibcudart.so.13 (libc6,x86-64) => /elsewhere/libcudart.so.13'\n"
    )
    ldconfig.chmod(0o755)
    monkeypatch.setenv("PATH", str(ldconfig.parent))
    assert toolkit.driver_library() == driver
    ldconfig.write_text("#!/bin/sh\necho '0 libs found in cache'\n")  # a machine without a driver
    assert toolkit.driver_library() is None


# The headers JIT kernels need beyond nvcc's own (JIT_HEADERS): a toolkit without them is named,
# with the wheel that brings them, by serve and doctor before a first request fails (H200,
# 2026-12-02: FlashInfer's build stopped at curand_kernel.h where the toolkit's wheels sat in
# another site-packages than torch's nvidia-curand).


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
