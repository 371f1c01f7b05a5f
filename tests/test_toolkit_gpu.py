"""On the GPU host: kernels vLLM compiles at first use build with the venv's CUDA toolkit when the
system has none (issue 14: the image is a CUDA runtime base without a toolkit).

The batch profile serves with its fp8 KV cache and FlashInfer attention forced, with the
system's toolkit hidden as the image has it: no CUDA_HOME, no nvcc on PATH, and
HYPERQWEN_SYSTEM_CUDA pointing where /usr/local/cuda would be looked for at nothing.
`hyperqwen serve` then points CUDA_HOME at the venv's toolkit and LIBRARY_PATH at its link
folder (hyperqwen/toolkit.py), and FlashInfer builds its kernels into the workspace given here
with it (before the link folder, on the H200 2026-12-01: compiled, then "cannot find -lcudart").
The GPU kit needs the toolkit's wheels for this, and nvidia-curand beside them, whose headers
FlashInfer's build includes (on the H200 2026-12-02 the host's curand sat in another
site-packages and the build stopped at curand_kernel.h): bash ../shared/gpu-kit/build.sh
nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-curand==10.4.0.35
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from gpu_server import chat, hyperqwen_server, log_dir
from test_serve_gpu import serve_env

from hyperqwen import toolkit

pytestmark = pytest.mark.gpu


def test_flashinfer_attention_builds_with_the_venvs_toolkit(tiny_models_dir, tmp_path):
    root = toolkit.venv_toolkit()
    if root is None:
        pytest.skip(
            "no nvidia/cu13 toolkit importable here: build the GPU kit with the toolkit's wheels "
            "(nvidia-cuda-nvcc, nvidia-cuda-crt, nvidia-nvvm, nvidia-cuda-runtime, "
            "nvidia-cuda-cccl of CUDA 13.0)"
        )
    if lacking := toolkit.missing_headers(root):
        pytest.fail(f"{lacking} (the GPU kit: build it with nvidia-curand beside the toolkit)")
    no_nvcc = os.pathsep.join(
        folder
        for folder in os.environ.get("PATH", "").split(os.pathsep)
        if folder and not (Path(folder) / "nvcc").exists()
    )
    workspace = tmp_path / "flashinfer"
    env = serve_env(
        tiny_models_dir,
        PORT="18061",  # the soaks' ports are 18051-18052; this runs beside them
        GPU_UTIL="0.12",  # a tiny model; the soaks hold 0.4 of the GPU each
        CUDA_HOME="",
        PATH=no_nvcc,
        FLASHINFER_WORKSPACE_BASE=str(workspace),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        **{toolkit.SYSTEM_TOOLKIT_ENV: str(tmp_path / "no-system-cuda")},
    )
    env["EXTRA_ARGS"] += " --attention-backend FLASHINFER"
    log = log_dir(tmp_path) / "serve-batch-venv-toolkit.log"
    with hyperqwen_server("batch", env, log) as base:
        answers = [chat(base, "tiny") for _ in range(2)]
    built = sorted(str(path.relative_to(workspace)) for path in workspace.rglob("*.so"))
    report = {"toolkit": str(root), "built": built, "answers": [a["usage"] for a in answers]}
    (log_dir(tmp_path) / "venv-toolkit.json").write_text(json.dumps(report, indent=1))
    served = log.read_text()
    assert f"CUDA toolkit for JIT kernels: {root} (the venv's: no system toolkit)" in served
    assert "JIT links (-lcudart, -lcuda) search" in served
    assert all(answer["usage"]["completion_tokens"] > 0 for answer in answers)
    assert built, f"FlashInfer built nothing under {workspace}: its kernels did not come from JIT"
