"""The CUDA toolkit that vLLM's just-in-time compilers need: the venv's, where the system has none.

On Ampere and Ada cards, parts of vLLM compile kernels at first use: FlashInfer attention for an
fp8 KV cache (batch mode's default) looks for nvcc through CUDA_HOME or PATH. The container is
built on a CUDA runtime image without a toolkit, but the venv carries one (the nvidia-cuda-nvcc
wheel: site-packages/nvidia/cu13 with bin/nvcc, include/, lib/). Where neither CUDA_HOME, nvcc on
PATH nor /usr/local/cuda gives a toolkit, `hyperqwen serve` points CUDA_HOME and PATH at it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

SYSTEM_TOOLKIT = Path("/usr/local/cuda")
VENV_TOOLKIT = "cu13"  # nvidia/cu13, the CUDA 13 wheels torch 2.11 + cu130 brings


def venv_toolkit() -> Path | None:
    """site-packages/nvidia/cu13 where it holds bin/nvcc, else None."""
    spec = importlib.util.find_spec("nvidia")
    for location in (spec.submodule_search_locations or []) if spec else []:
        root = Path(location) / VENV_TOOLKIT
        if (root / "bin" / "nvcc").is_file():
            return root
    return None


def system_toolkit(environ: Mapping[str, str]) -> str | None:
    """Where the JIT compilers would find a toolkit without help, or None."""
    if environ.get("CUDA_HOME"):
        return f"CUDA_HOME={environ['CUDA_HOME']}"
    if nvcc := shutil.which("nvcc", path=environ.get("PATH", os.defpath)):
        return f"nvcc on PATH ({nvcc})"
    if (SYSTEM_TOOLKIT / "bin" / "nvcc").is_file():
        return str(SYSTEM_TOOLKIT)
    return None


def toolkit_env(environ: Mapping[str, str]) -> dict[str, str]:
    """CUDA_HOME and PATH to add for the venv's toolkit; nothing where a system one exists or
    the venv has none."""
    root = venv_toolkit()
    if system_toolkit(environ) or root is None:
        return {}
    path = environ.get("PATH", os.defpath)
    return {"CUDA_HOME": str(root), "PATH": f"{root / 'bin'}{os.pathsep}{path}"}
