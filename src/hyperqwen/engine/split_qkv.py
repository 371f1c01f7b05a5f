"""The GDN layer's contiguous q|k|v buffer in one launch (GDN_SPLIT_QKV, on unless set to 0).

At the gdn_mixed_qkv seam (seams.py, in vLLM's `rearrange_mixed_qkv`), where the kernel runs on
the tensor, kernels/split_qkv.py writes the buffer vLLM's three reshape copies and torch.cat
build, bit for bit, so the views vLLM takes of it are unchanged. HYPERQWEN_GDN_SPLIT_QKV=0 keeps
vLLM's path everywhere (an ablation for `hyperqwen bench ab`). It runs inside vLLM's GDN attention
op, which torch.compile does not trace, so the switch is no part of the compile cache key.
"""

from __future__ import annotations

import torch

from hyperqwen.kernels import split_qkv as kernel


def gdn_mixed_qkv(
    mixed_qkv: torch.Tensor, q_dim: int, k_dim: int, v_dim: int
) -> torch.Tensor | None:
    """The buffer torch.cat would build from mixed_qkv's reshaped q, k and v parts, where the
    kernel runs on the tensor; None: vLLM's cat."""
    return kernel.split_qkv(mixed_qkv, q_dim, k_dim, v_dim) if kernel.runs_here(mixed_qkv) else None
