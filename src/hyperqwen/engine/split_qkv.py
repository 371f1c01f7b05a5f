"""The GDN layer's contiguous q|k|v buffer in one launch (GDN_SPLIT_QKV, on unless set to 0).

patches/gdn-split-qkv.patch asks `takes(mixed_qkv)` in vLLM's `rearrange_mixed_qkv`; where it
does, kernels/split_qkv.py writes the buffer vLLM's three reshape copies and torch.cat build, bit
for bit, so the views vLLM takes of it are unchanged. HYPERQWEN_GDN_SPLIT_QKV=0 keeps vLLM's
path everywhere (an ablation for `hyperqwen bench ab`). It runs inside vLLM's GDN attention op,
which torch.compile does not trace, so the switch is no part of the compile cache key.
"""

from __future__ import annotations

import torch

from hyperqwen.engine.features import SPLIT_QKV, enabled
from hyperqwen.kernels import split_qkv as kernel


def takes(mixed_qkv: torch.Tensor) -> bool:
    """Whether the kernel builds this step's buffer: switched on, and it runs on the tensor."""
    return enabled(SPLIT_QKV) and kernel.runs_here(mixed_qkv)


def split_qkv(mixed_qkv: torch.Tensor, q_dim: int, k_dim: int, v_dim: int) -> torch.Tensor:
    """The buffer torch.cat would build from mixed_qkv's reshaped q, k and v parts."""
    return kernel.split_qkv(mixed_qkv, q_dim, k_dim, v_dim)
