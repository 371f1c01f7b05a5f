"""What CUDA GPUs this machine has, without importing torch (slow) or vLLM."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

# vLLM's GPTQ/Marlin W4A16 kernels and FlashAttention 2 need Ampere (sm80) or newer.
MIN_COMPUTE_CAPABILITY = (8, 0)
MIN_MEMORY_GIB_27B = 24

REQUIREMENT = (
    "an NVIDIA GPU with CUDA, compute capability 8.0 or newer (RTX 3090/4090/5090, A100, "
    "H100/H200), 24 GB or more for the 27B model, and the NVIDIA driver (nvidia-smi)"
)


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    compute_capability: tuple[int, int]
    memory_gib: float
    driver: str
    power_limit: str
    """As nvidia-smi reports it, e.g. "450.00 W"; "[N/A]" on cards that hide it."""

    @property
    def sm(self) -> str:
        return f"sm{self.compute_capability[0]}{self.compute_capability[1]}"


def cards_below(gpus: Iterable[Gpu], capability: tuple[int, int]) -> list[str]:
    """The cards older than `capability`, as a refusal names them: "NAME (smXY)"."""
    return [f"{gpu.name} ({gpu.sm})" for gpu in gpus if gpu.compute_capability < capability]


class NoGpu(Exception):
    """No usable CUDA GPU; the message says why."""


def visible_to_cuda(gpus: list[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves to this process, in its order.

    nvidia-smi ignores the variable; vLLM (through CUDA) does not, so a benchmark pinned to one
    GPU of two must report one. Only index lists are read; a list of UUIDs or MIG ids keeps all.
    """
    if cuda_visible_devices is None:
        return gpus
    entries = [entry.strip() for entry in cuda_visible_devices.split(",") if entry.strip()]
    if not all(entry.isdigit() for entry in entries):
        return gpus
    by_index = {gpu.index: gpu for gpu in gpus}
    visible = []
    for entry in entries:
        # CUDA stops at the first index that does not exist.
        if int(entry) not in by_index:
            break
        visible.append(by_index[int(entry)])
    return visible


def list_gpus() -> list[Gpu]:
    """GPUs nvidia-smi reports that CUDA_VISIBLE_DEVICES leaves visible. Raises NoGpu with the
    reason when there are none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise NoGpu("nvidia-smi not found: no NVIDIA driver on this machine")
    query = "index,name,compute_cap,memory.total,driver_version,power.limit"
    try:
        result = subprocess.run(
            [smi, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NoGpu(f"nvidia-smi failed: {error}") from None
    if result.returncode != 0:
        raise NoGpu(f"nvidia-smi failed: {(result.stderr or result.stdout).strip()}")
    gpus = [parse_smi_line(line) for line in result.stdout.splitlines() if line.strip()]
    if not gpus:
        raise NoGpu("nvidia-smi lists no GPU")
    visible = visible_to_cuda(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not visible:
        raise NoGpu(
            f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} hides all "
            f"{len(gpus)} GPU(s) nvidia-smi lists; unset it or give their indices"
        )
    return visible


def parse_smi_line(line: str) -> Gpu:
    index, name, capability, memory_mib, driver, power = (part.strip() for part in line.split(","))
    major, minor = capability.split(".")
    watts = f"{power} W" if power.replace(".", "", 1).isdigit() else power
    return Gpu(int(index), name, (int(major), int(minor)), float(memory_mib) / 1024, driver, watts)
