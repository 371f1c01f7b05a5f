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

HYPERQWEN_SYSTEM_CUDA names where the system toolkit is looked for instead of /usr/local/cuda
(the GPU tests point it at nothing to run the venv's toolkit on a host that has one).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SYSTEM_TOOLKIT = Path("/usr/local/cuda")
SYSTEM_TOOLKIT_ENV = "HYPERQWEN_SYSTEM_CUDA"
VENV_TOOLKIT = "cu13"  # nvidia/cu13, the CUDA 13 wheels torch 2.11 + cu130 brings


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


def toolkit_env(environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """(CUDA_HOME and PATH to add for the venv's toolkit, why); nothing where it is not used."""
    choice = choose_toolkit(environ)
    why = choice.venv_reason
    if why is None:
        return {}, ""
    path = environ.get("PATH", os.defpath)
    root = choice.venv
    return {"CUDA_HOME": str(root), "PATH": f"{root / 'bin'}{os.pathsep}{path}"}, why
