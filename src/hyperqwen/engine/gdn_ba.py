"""The GDN layer's b and a projections for decode and verify steps (GDN_BA=1).

At the gdn_layer_built seam (seams.py), once per Qwen3.5 GDN layer, `takes(layer)` decides;
where it does, the layer's CUDA forward takes b and a from `torch.ops.hyperqwen.gdn_ba` instead of
in_proj_ba's GEMM, the split and two copies. The op runs kernels/ba_proj.py for the few rows
of a decode or verify step and vLLM's own F.linear, split and copies for more (prefill), so the
compiled graph holds one opaque call for every token count. It takes the layer only where
vLLM's path is that plain: the bf16 weight of an unquantized in_proj_ba, b's rows then a's
(Qwen3.5's layout, not Qwen3-Next's interleaved one), one tensor-parallel rank, no LoRA.
"""

from __future__ import annotations

import functools
import logging

import torch

from hyperqwen.kernels import ba_proj

log = logging.getLogger("vllm.hyperqwen.gdn_ba")


def takes(layer) -> bool:
    """Whether b and a of this GatedDeltaNet layer come from the op: from its structure only,
    when it is built, so torch.compile sees a constant."""
    if layer.gqa_interleaved_layout or layer.tp_size != 1:
        return False
    if hasattr(layer, "in_proj_qkv"):  # LoRA splits the projections
        return False
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    projection = layer.in_proj_ba
    return (
        isinstance(projection.quant_method, UnquantizedLinearMethod)
        and getattr(projection, "bias", None) is None
        and projection.weight.dtype in (torch.bfloat16, torch.float16)
    )


def gdn_layer_built(layer) -> None:
    """Where the op takes the layer, its forward calls the op instead of vLLM's path."""
    if takes(layer):
        layer.hyperqwen_ba_projection = torch.ops.hyperqwen.gdn_ba
        _announce()


@functools.cache  # one log line per process, at the first layer it takes
def _announce() -> None:
    log.info(
        "GDN b/a projection: HyperQwen's kernel for steps of up to %d tokens", ba_proj.MAX_ROWS
    )


@torch.library.custom_op("hyperqwen::gdn_ba", mutates_args=())
def gdn_ba(hidden_states: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, a), each [T, H] and contiguous, from hidden_states [T, K] and in_proj_ba's weight
    [2H, K]: the kernel for up to ba_proj.MAX_ROWS rows, vLLM's way beyond."""
    if ba_proj.runs_here(hidden_states, weight):
        return ba_proj.ba_projection(hidden_states, weight)
    b, a = torch.nn.functional.linear(hidden_states, weight).chunk(2, dim=-1)
    return b.contiguous(), a.contiguous()


@gdn_ba.register_fake
def _(hidden_states: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    heads = weight.shape[0] // 2
    shape = (hidden_states.shape[0], heads)
    return hidden_states.new_empty(shape), hidden_states.new_empty(shape)
