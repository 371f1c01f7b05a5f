"""One Triton cache for every server configuration (TRITON_CACHE, shared unless set to off).

vLLM 0.26 keeps Triton's compiled kernels and autotuning results inside the torch.compile cache
folder of the configuration's hash: its InductorAdaptor sets TRITON_CACHE_DIR there, and under
its default standalone adaptor torch Inductor does, below the TORCHINDUCTOR_CACHE_DIR vLLM's AOT
compile sets per hash. A changed flag or engine switch changes the hash, so each new
configuration recompiles and re-autotunes every Triton kernel, the GDN prefill warm-up's
included (bench/measurements/2026-12-03-h200-gdn-replay-warmup.json). Triton's cache is
content-addressed (kernel source, options, target, Triton version) and vLLM stores autotuning
results in it (TRITON_CACHE_AUTOTUNING=1), so
one folder serves them all: at the compile_cache_initialized seam, after vLLM has set its
folders and before anything compiles, TRITON_CACHE_DIR becomes VLLM_CACHE_ROOT/triton_cache.
With vLLM's compile cache off the seam is not called, and Triton keeps its default folder.
"""

from __future__ import annotations

import os

from vllm import envs
from vllm.logger import init_logger

log = init_logger("vllm.hyperqwen.shared_triton_cache")


def compile_cache_initialized() -> None:
    """Point this process's Triton cache at the folder every configuration shares."""
    folder = os.path.join(envs.VLLM_CACHE_ROOT, "triton_cache")
    os.makedirs(folder, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = folder
    log.info_once(
        "Triton cache: %s, shared by every server configuration (Triton's cache is keyed by "
        "kernel source, options and target), so a changed configuration reuses compiled and "
        "autotuned kernels; TRITON_CACHE=off keeps vLLM's per-configuration folder.",
        folder,
    )
