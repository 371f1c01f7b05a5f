"""Host-to-device copies queued behind the device's work instead of waiting for it (the
metadata builder's and the prefill plan's)."""

from __future__ import annotations

import torch


def queued_copy(host: torch.Tensor, device_tensor: torch.Tensor) -> torch.Tensor:
    """`host` copied into `device_tensor` (returned), the copy queued behind the kernels
    already there instead of waiting for them: a copy from pageable memory makes PyTorch
    synchronize the stream, and the metadata is built four times a step (the verify, each
    drafter pass), so every build would have drained the GPU's queue and no step's host work
    could overlap the previous step's kernels. From pinned memory the copy is queued like a
    kernel; PyTorch's caching host allocator keeps the pinned block until the copy has run."""
    if device_tensor.device.type != "cuda":
        return device_tensor.copy_(host)
    return device_tensor.copy_(host.pin_memory(), non_blocking=True)
