"""The CUDA toolkit that vLLM's just-in-time compilers need: the venv's, where the system has none
or one of another CUDA major release.

On Ampere and Ada cards, parts of vLLM compile kernels at first use: FlashInfer attention for an
fp8 KV cache (batch mode's default) looks for nvcc through CUDA_HOME, PATH, then /usr/local/cuda.
The container is built on a CUDA runtime image without a toolkit, but the venv carries one (the
nvidia-cuda-nvcc wheel: site-packages/nvidia/cu13 with bin/nvcc, include/, lib/), of the CUDA
release torch was built for. `hyperqwen serve` points CUDA_HOME and PATH at it where nvcc on PATH
and /usr/local/cuda give no toolkit, or one of another major release (a bare-metal box with a
CUDA 12 toolkit cannot build kernels for a CUDA 13 torch). A CUDA_HOME the user set is theirs:
it is kept, and `hyperqwen doctor` warns when its release differs.

The wheels are not laid out like a toolkit for the linker: lib/ holds libcudart.so.13 but no
libcudart.so, and there is no lib64/stubs/libcuda.so, so FlashInfer's `-lcudart -lcuda` failed
("cannot find -lcudart", H200, 2026-12-01). Where the venv's toolkit is used, serve also makes a
link folder in the cache (libcudart.so -> the venv's libcudart.so.N, libcuda.so -> the driver's
libcuda.so.1) and puts it on LIBRARY_PATH, which gcc searches for every -l of a link that nvcc
or a build script runs.

The nvcc wheel brings CUDA's own headers but not every library's: FlashInfer's kernels include
cutlass utilities that include curand_kernel.h, which comes with the nvidia-curand wheel (a torch
dependency, so a venv made by install.sh has it in the same nvidia/cu13/include). Where that folder
lacks it (H200, 2026-12-01: a toolkit installed apart from torch's wheels), the build stops at the
first request; serve and doctor say which header and which package before that.

HYPERQWEN_SYSTEM_CUDA names where the system toolkit is looked for instead of /usr/local/cuda
(the GPU tests point it at nothing to run the venv's toolkit on a host that has one).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SYSTEM_TOOLKIT = Path("/usr/local/cuda")
SYSTEM_TOOLKIT_ENV = "HYPERQWEN_SYSTEM_CUDA"
VENV_TOOLKIT = "cu13"  # nvidia/cu13, the CUDA 13 wheels torch 2.11 + cu130 brings
# Headers JIT-compiled kernels include that the nvcc wheel does not bring -> the wheel that does.
JIT_HEADERS = {"curand_kernel.h": "nvidia-curand"}


@dataclass(frozen=True)
class SystemToolkit:
    where: str  # how it is found, as the log and doctor say it
    nvcc: Path
    explicit: bool  # the user's CUDA_HOME


def venv_toolkit() -> Path | None:
    """site-packages/nvidia/cu13 where it holds bin/nvcc, else None."""
    spec = importlib.util.find_spec("nvidia")
    for location in (spec.submodule_search_locations or []) if spec else []:
        root = Path(location) / VENV_TOOLKIT
        if (root / "bin" / "nvcc").is_file():
            return root
    return None


def missing_headers(root: Path) -> str | None:
    """What a toolkit at `root` lacks for JIT kernels and how to get it, or None."""
    missing = {
        header: wheel
        for header, wheel in JIT_HEADERS.items()
        if not (root / "include" / header).is_file()
    }
    if not missing:
        return None
    headers = ", ".join(missing)
    wheels = " ".join(sorted(set(missing.values())))
    return (
        f"{root / 'include'} has no {headers}: kernels compiled at first use (FlashInfer "
        f"attention) will not build; install it into this venv: pip install {wheels}"
    )


def nvcc_release(nvcc: Path) -> tuple[int, int] | None:
    """(major, minor) that `nvcc --version` reports, or None where it does not run."""
    try:
        shown = subprocess.run(
            [str(nvcc), "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", shown)
    return (int(found[1]), int(found[2])) if found else None


def system_toolkit(environ: Mapping[str, str]) -> SystemToolkit | None:
    """Where the JIT compilers would find a toolkit without help, or None."""
    if home := environ.get("CUDA_HOME"):
        return SystemToolkit(f"CUDA_HOME={home}", Path(home) / "bin" / "nvcc", explicit=True)
    if nvcc := shutil.which("nvcc", path=environ.get("PATH", os.defpath)):
        return SystemToolkit(f"nvcc on PATH ({nvcc})", Path(nvcc), explicit=False)
    root = Path(environ.get(SYSTEM_TOOLKIT_ENV) or SYSTEM_TOOLKIT)
    if (root / "bin" / "nvcc").is_file():
        return SystemToolkit(str(root), root / "bin" / "nvcc", explicit=False)
    return None


def release_mismatch(system: SystemToolkit, venv_root: Path) -> str | None:
    """Why the system toolkit cannot build for this torch, or None: another major release."""
    theirs, ours = nvcc_release(system.nvcc), nvcc_release(venv_root / "bin" / "nvcc")
    if theirs is None or ours is None or theirs[0] == ours[0]:
        return None
    return (
        f"{system.where} is CUDA {theirs[0]}.{theirs[1]}, this torch and the venv's toolkit "
        f"CUDA {ours[0]}.{ours[1]}"
    )


@dataclass(frozen=True)
class ToolkitChoice:
    """The toolkits there are and which one JIT kernels get; `hyperqwen serve` acts on it,
    `hyperqwen doctor` reports it."""

    system: SystemToolkit | None
    venv: Path | None

    @functools.cached_property
    def mismatch(self) -> str | None:
        """Why the system toolkit cannot build for this torch (runs both nvcc), or None."""
        return release_mismatch(self.system, self.venv) if self.system and self.venv else None

    @property
    def venv_reason(self) -> str | None:
        """Why the venv's toolkit is used, or None where it is not: a usable system one, the
        user's CUDA_HOME, or no venv toolkit."""
        if self.venv is None:
            return None
        if self.system is None:
            return "no system toolkit"
        return None if self.system.explicit else self.mismatch


def choose_toolkit(environ: Mapping[str, str]) -> ToolkitChoice:
    return ToolkitChoice(system_toolkit(environ), venv_toolkit())


def driver_library() -> Path | None:
    """The driver's libcuda.so.1 (64-bit) as the dynamic loader's cache lists it, or None."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"  # a user's PATH may lack sbin
    try:
        listed = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for flags, where in re.findall(r"^\s*libcuda\.so\.1 \(([^)]*)\) => (\S+)$", listed, re.M):
        if "64" in flags and Path(where).is_file():
            return Path(where)
    return None


def link_names(root: Path, driver: Path | None) -> dict[str, Path]:
    """The files `-lcudart` and `-lcuda` look for, and the libraries they stand for."""
    names = {}
    if runtime := sorted(root.glob("lib/libcudart.so.[0-9]*")):
        names["libcudart.so"] = runtime[0]  # the soname, libcudart.so.13, sorts first
    if driver is not None:
        names["libcuda.so"] = driver
    return names


def link_folder(names: Mapping[str, Path], cache: Path) -> Path:
    """A folder of symlinks `names` under cache/cuda-link, made whole or not at all: named by
    what it links, built in a staging folder beside it and renamed into place (a second serve
    racing to make it finds it made)."""
    listing = "\n".join(f"{name} {target}" for name, target in sorted(names.items()))
    folder = cache / "cuda-link" / hashlib.sha256(listing.encode()).hexdigest()[:16]
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder.parent))
    for name, target in names.items():
        (staging / name).symlink_to(target)
    try:
        staging.rename(folder)
    except OSError:
        shutil.rmtree(staging)
        if not folder.is_dir():
            raise
    return folder


def cache_dir(environ: Mapping[str, str]) -> Path:
    """$XDG_CACHE_HOME/hyperqwen, else ~/.cache/hyperqwen (the image sets XDG_CACHE_HOME on the
    /cache volume)."""
    base = environ.get("XDG_CACHE_HOME") or str(
        Path(environ.get("HOME", "~")).expanduser() / ".cache"
    )
    return Path(base) / "hyperqwen"


def toolkit_env(environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """(CUDA_HOME, PATH and LIBRARY_PATH to add for the venv's toolkit, why); nothing where it
    is not used. Makes the link folder (link_folder) in the cache where it is missing; where the
    cache cannot be written, says so in `why` and adds no LIBRARY_PATH."""
    choice = choose_toolkit(environ)
    why = choice.venv_reason
    if why is None:
        return {}, ""
    path = environ.get("PATH", os.defpath)
    root = choice.venv
    if lacking := missing_headers(root):
        why = f"{why}; {lacking}"
    env = {"CUDA_HOME": str(root), "PATH": f"{root / 'bin'}{os.pathsep}{path}"}
    try:
        folder = link_folder(link_names(root, driver_library()), cache_dir(environ))
    except OSError as error:
        return env, (
            f"{why}; no link folder for -lcudart ({error}): kernels linked at first use may "
            "fail; set XDG_CACHE_HOME to a writable folder"
        )
    searched = environ.get("LIBRARY_PATH")
    env["LIBRARY_PATH"] = f"{folder}{os.pathsep}{searched}" if searched else str(folder)
    return env, why
