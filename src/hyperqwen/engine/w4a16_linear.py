"""HyperQwen's W4A16 kernel as one of vLLM's linear kernels (LINEAR_BACKEND=hyperqwen).

At the linear_kernels seam (seams.py), vLLM's kernel choice for compressed-tensors WNA16 layers
passes through `linear_kernels`: switched on, on CUDA, HyperQwenW4A16LinearKernel comes first,
and a layer it cannot take (not int4 with symmetric groups of 128, N not a multiple of 16:
the int8 heads, for one) gets the next kernel of vLLM's list, which the launcher narrows to
Marlin. The layer keeps one copy of its weights, in the kernel's tiles
(kernels/w4a16.py: tiles_from_checkpoint), and every M runs from it: `tile_for` picks the
launch shape, and the launch is a torch custom op so torch.compile and CUDA graphs see one
opaque call, as they see Marlin's.

Status: correct on the CPU (tests/test_engine_w4a16_linear.py, the real vLLM parameter classes,
the kernel under Triton's interpreter); not run in a server on a GPU yet, so off by default.
The tile rules come from `hyperqwen bench kernels` on the H200 (kernels/README.md) at M <= 16;
the tiles for prefill's M are not timed yet.
"""

from __future__ import annotations

import functools

import torch

from hyperqwen.kernels import w4a16

GROUP = w4a16.PAIR_GROUP
# programs a small-M launch should have: about 7 per SM of the H200's 132 (the sweep's winners
# had 896-1088: gate_up split 2, qkvz and attention qkv split 4, o_proj and down split 8)
SMALL_M_PROGRAMS = 896
SMALL_M = 64  # up to here: 64-row weight tiles, split-K; beyond: prefill's tiles
REPACK_ROWS = 2048  # rows repacked at a time, so a full-vocabulary layer needs no big scratch


def tile_for(m: int, n: int, k: int, capability: int = 90) -> w4a16.TileConfig:
    """The launch shape for M rows of an [N, K] layer. Up to SMALL_M rows: 64 weight rows and 4
    warps per program, K split until the launch has about SMALL_M_PROGRAMS programs. Beyond:
    128 x 128 tiles with 64 rows of x (128 from 256 rows on sm90, whose shared memory holds
    them; an sm86/89 program gets 99 KB)."""
    if m <= SMALL_M:
        block_n, block_k = 64, 256
        tiles = -(-n // block_n)
        split = 1
        while split < 8 and tiles * split < SMALL_M_PROGRAMS and k // (2 * split) >= block_k:
            split *= 2
        return w4a16.TileConfig(block_n, block_k, split, num_warps=4)
    block_m = 128 if m >= 256 and capability >= 90 else 64
    return w4a16.TileConfig(128, 128, 1, num_warps=8, num_stages=4, block_m=block_m)


@functools.cache
def _capability(device: torch.device) -> int:
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


@torch.library.custom_op("hyperqwen::w4a16_linear", mutates_args=())
def w4a16_linear(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the layer's int4 weights (tiles) -> [M, N]: one opaque op for
    torch.compile, which would otherwise trace the launch and specialise on M."""
    n = words.shape[0] * w4a16.TILE_ROWS
    config = tile_for(x.shape[0], n, x.shape[1], _capability(x.device))
    return w4a16.w4a16_matmul(x, words, scales, GROUP, config)


@w4a16_linear.register_fake
def _(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], words.shape[0] * w4a16.TILE_ROWS))


def repack(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> tuple:
    """Checkpoint words [N, K/8] and scales [N, K/G] -> the kernel's tiles, REPACK_ROWS rows at
    a time (unpacking a whole lm_head at once would take gigabytes of int64 codes)."""
    n = weight_packed.shape[0]
    parts = [
        w4a16.tiles_from_checkpoint(
            weight_packed[start : start + REPACK_ROWS], weight_scale[start : start + REPACK_ROWS]
        )
        for start in range(0, n, REPACK_ROWS)
    ]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@functools.cache
def linear_kernel_class():
    """The MPLinearKernel subclass, built on first use, so importing this module does not load
    vLLM's layer machinery."""
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import (
        MPLinearKernel,
        MPLinearLayerConfig,
    )
    from vllm.model_executor.layers.quantization.utils import replace_parameter
    from vllm.model_executor.parameter import permute_param_layout_
    from vllm.scalar_type import scalar_types

    class HyperQwenW4A16LinearKernel(MPLinearKernel):
        """vLLM's compressed-tensors W4A16 layer through kernels/w4a16.py."""

        @classmethod
        def get_min_capability(cls) -> int:
            return 80

        @classmethod
        def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
            k, n = c.partition_weight_shape
            problems = []
            if c.weight_type != scalar_types.uint4b8:
                problems.append(f"weight type {c.weight_type} (takes uint4b8)")
            if c.act_type not in (torch.bfloat16, torch.float16):
                problems.append(f"activations {c.act_type} (takes bf16, fp16)")
            if c.group_size != GROUP:
                problems.append(f"group size {c.group_size} (takes {GROUP})")
            if c.zero_points or c.has_g_idx:
                problems.append("zero points or activation order (takes neither)")
            if n % w4a16.TILE_ROWS or k % GROUP:
                problems.append(f"N={n}, K={k} (takes N % 16 == 0, K % {GROUP} == 0)")
            return (False, "; ".join(problems)) if problems else (True, None)

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            words = getattr(layer, self.w_q_name)
            scales = getattr(layer, self.w_s_name)
            permute_param_layout_(words, input_dim=1, output_dim=0, packed_dim=1)
            permute_param_layout_(scales, input_dim=1, output_dim=0)
            tiled_words, tiled_scales = repack(words.data, scales.data)
            for name, data in ((self.w_q_name, tiled_words), (self.w_s_name, tiled_scales)):
                replace_parameter(layer, name, torch.nn.Parameter(data, requires_grad=False))
            self._reserve_split_k_workspace(tiled_words)

        def _reserve_split_k_workspace(self, words: torch.Tensor) -> None:
            """Grow the shared split-K workspace now, before CUDA graphs are captured, to what
            this layer's largest small-M launch needs."""
            k, n = self.config.partition_weight_shape
            config = tile_for(SMALL_M, n, k, _capability(words.device))
            w4a16.WORKSPACE.reserve(words.device, *w4a16.workspace_size(SMALL_M, n, config))

        def apply_weights(
            self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            words, scales, _, _ = self._get_weight_params(layer)
            x_2d = x.reshape(-1, x.shape[-1]).contiguous()
            out = torch.ops.hyperqwen.w4a16_linear(x_2d, words, scales)
            if bias is not None:
                out.add_(bias)
            return out.reshape(*x.shape[:-1], out.shape[-1])

    return HyperQwenW4A16LinearKernel


def linear_kernels(kernels: list, on_cuda: bool) -> list:
    """vLLM's mixed-precision kernels in the order it tries them, HyperQwen's first on CUDA."""
    return [linear_kernel_class(), *kernels] if on_cuda else kernels
