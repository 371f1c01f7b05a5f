"""Speculative-decode metadata for vLLM's Gated DeltaNet layers without a CPU-GPU sync.

vLLM 0.26's GDNAttentionMetadataBuilder picks the speculative rows of GPU tensors (state slots,
accepted-token counts) with a boolean mask that lives on the CPU; PyTorch copies such an index to
the GPU with a blocking copy, a stream synchronize in every spec-decode step. In a decode-only
step the speculative rows are the leading ones (vLLM puts padded rows at the back), so a slice
selects the same rows with no copy of indices at all (patches/gdn-spec-rows-no-sync.patch).
"""

from __future__ import annotations

import torch


def spec_rows(spec_mask_cpu: torch.Tensor, num_spec: int) -> slice | torch.Tensor:
    """An index of the speculative rows: slice(0, num_spec) where they are the first num_spec
    rows (num_spec is the mask's count, so the rest are then False), else the mask itself."""
    if bool(spec_mask_cpu[:num_spec].all()):
        return slice(0, num_spec)
    return spec_mask_cpu
