"""8-bit activations into the int4 body GEMMs of chosen layer groups (INT8_ACT, batch mode).

At the linear_kernels seam (seams.py), switched on, on CUDA, `linear_kernels` puts a dispatching
kernel first in vLLM's list for compressed-tensors W4A16 layers (int4 `uint4b8`, symmetric, no
activation order; the int8 heads and anything else go down vLLM's list as before). vLLM's
layer config carries no layer name, so the choice waits for `process_weights_after_loading`,
which gets the layer and its prefix: a layer of an INT8_ACT group gets the 8-bit-activation
kernel ARCH_TABLE names for the GPU's architecture, built with the 8-bit config that kernel
needs; any other layer gets the kernel vLLM would have chosen from the rest of its list. The
layer's registered parameters are the same either way (the checkpoint's `weight_packed`,
`weight_scale`), so nothing before loading depends on the choice.

Marlin's int8 path rescales each layer's group scales by their maximum into int16 (vLLM's
`marlin_act_int8_process_scales`), which a negative scale breaks: for that kernel the sign of a
negative group scale moves into the group's codes first (`fold_scale_signs`). Code 0 (-8) of
such a group would become +8, which int4 cannot hold: that layer is refused by name.

Status: CPU-tested (knob, choice per layer and architecture, the sign fold against float64). On
the H200, Marlin int8 and CUTLASS fp8 answer like float64, and both were slower than vLLM's W4A16
kernel at the 27B's shapes (SLOWER_THAN_W4A16): sm90 is refused. Ampere/Ada speed not measured.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from hyperqwen.checkpoint.w4a16 import GROUP_SIZE
from hyperqwen.engine.features import INT8_ALL, INT8_LAYER_GROUPS, W4A8_LINEAR, env_value
from hyperqwen.kernels.w4a16 import pack_codes, unpack_codes

log = logging.getLogger("vllm.hyperqwen.w4a8_linear")

CODE_BIAS = 8  # uint4b8: weight = (code - 8) * scale
FOLD_ROWS = 2048  # rows unpacked at a time, so a wide layer needs no big scratch
# a layer's group, from its prefix: vLLM names a decoder layer's mixers and MLP so
_LAYER_PREFIX = re.compile(r"(?:^|\.)layers\.\d+\.(mlp|self_attn|linear_attn)\.")
_GROUP_OF_MODULE = {"mlp": "mlp", "self_attn": "attn", "linear_attn": "gdn"}
_ANNOUNCED: set[tuple[str, str]] = set()


class Int8ActRefused(ValueError):
    """A layer INT8_ACT selects that no 8-bit-activation kernel here can take."""


@dataclass(frozen=True)
class Candidate:
    """One of vLLM 0.26's W4A8 kernels, as HyperQwen builds it for a W4A16 g128 layer."""

    name: str
    kernel: str
    """vLLM's MPLinearKernel class (model_executor/kernels/linear/mixed_precision)."""
    activations: str
    """What each token's activations become: int8 or fp8 (e4m3), with a scale per token."""
    config_act_type: str | None
    """The torch dtype the kernel's layer config names; None: the layer's own (humming reads
    its input dtype from the layer instead)."""
    config_weight_type: str
    """The vLLM scalar type the kernel's config names (CUTLASS converts uint4b8 to int4)."""
    humming_input: str | None = None
    """humming's input dtype, given to it on the layer (`_humming_input_quant_config`)."""
    needs_positive_scales: bool = False
    min_groups: int = 1
    """Groups per partition it needs: Marlin's int8 path sets its per-layer scale only for
    more than one (vLLM's MarlinLinearKernel, `input_global_scale`)."""

    def config(self, config):
        """The 8-bit layer config this kernel is built with, from the layer's W4A16 one."""
        from vllm.scalar_type import scalar_types

        act = getattr(torch, self.config_act_type) if self.config_act_type else config.act_type
        return dataclasses.replace(
            config,
            act_type=act,
            weight_type=getattr(scalar_types, self.config_weight_type),
            out_type=config.act_type,
        )

    def kernel_class(self):
        from vllm.model_executor.kernels.linear import mixed_precision

        return getattr(mixed_precision, self.kernel)

    def refusal(self, config) -> str | None:
        """Why this kernel cannot take the layer (vLLM's own checks, then ours); None: it can."""
        groups = config.partition_weight_shape[0] // config.group_size
        if groups < self.min_groups:
            return f"{groups} group(s) per row; {self.name} needs {self.min_groups}"
        can, why = self.kernel_class().can_implement(self.config(config))
        return None if can else why

    def prepare(self, layer: torch.nn.Module) -> None:
        """What the layer must carry before the kernel processes it."""
        if self.humming_input:
            layer._humming_input_quant_config = {
                "quant_method": "humming",
                "input_dtype": self.humming_input,
            }


CANDIDATES = {
    c.name: c
    for c in (
        Candidate("marlin_int8", "MarlinLinearKernel", "int8", "int8", "uint4b8",
                  needs_positive_scales=True, min_groups=2),
        Candidate("cutlass_fp8", "CutlassW4A8LinearKernel", "fp8", "float8_e4m3fn", "int4"),
        Candidate("humming_int8", "HummingLinearKernel", "int8", None, "uint4b8",
                  humming_input="int8"),
        Candidate("humming_fp8", "HummingLinearKernel", "fp8", None, "uint4b8",
                  humming_input="float8e4m3"),
    )
}  # fmt: skip
# The 8-bit-activation kernel per architecture (capability 10 * major + minor). Ampere/Ada take
# Marlin's int8 path, vLLM's W4A8 for them (not measured on those cards).
ARCH_TABLE = {80: "marlin_int8", 86: "marlin_int8", 89: "marlin_int8"}
# Architectures where every candidate timed lost to vLLM's own W4A16 kernel at the 27B's layer
# shapes and batch rows, with the result file: INT8_ACT would slow them down, so it is refused.
SLOWER_THAN_W4A16 = {90: "docs/results/2026-12-02-h200-27b-kernels-w4a8.json"}


def selected_groups(value: str) -> frozenset[str]:
    """The layer groups an INT8_ACT value names (its values are features.W4A8_LINEAR's)."""
    if value == INT8_ALL:
        return frozenset(INT8_LAYER_GROUPS)
    return frozenset(value.split("+")) - {"0"}


def layer_group(prefix: str) -> str | None:
    """mlp, attn or gdn for a decoder layer's linear (by vLLM's prefix); None for the rest."""
    found = _LAYER_PREFIX.search(prefix)
    return _GROUP_OF_MODULE[found.group(1)] if found else None


def architecture_refusal(capability: int | None, setting: str) -> str | None:
    """Why INT8_ACT=`setting` cannot run on an architecture (None: not a CUDA device), or None
    where ARCH_TABLE names its kernel."""
    if capability in ARCH_TABLE:
        return None
    device = f"sm{capability}" if capability is not None else "a device other than CUDA"
    if capability in SLOWER_THAN_W4A16:
        why = (
            f"on {device} every 8-bit-activation kernel timed was slower than vLLM's W4A16 "
            f"kernel ({SLOWER_THAN_W4A16[capability]})"
        )
    else:
        arches = ", ".join(f"sm{c}" for c in ARCH_TABLE)
        why = (
            f"no 8-bit-activation kernel is declared for {device} (engine/w4a8_linear.py "
            f"ARCH_TABLE has {arches})"
        )
    return f"INT8_ACT={setting}: {why}; set INT8_ACT=0"


def candidate_for(capability: int | None) -> Candidate:
    """The table's 8-bit-activation kernel for an architecture (None: not a CUDA device), or
    a refusal naming the knob."""
    if reason := architecture_refusal(capability, env_value(W4A8_LINEAR)):
        raise Int8ActRefused(reason)
    return CANDIDATES[ARCH_TABLE[capability]]


def fold_scale_signs(
    packed: torch.Tensor, scale: torch.Tensor, prefix: str = "layer"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint words [N, K/8] and group scales [N, K/G] -> the same weights with every
    scale non-negative: a negative group's codes c become 16 - c ((c - 8) * s = (16 - c - 8) *
    -s). Unchanged tensors when no scale is negative. Code 0 of a negative group would need +8:
    Int8ActRefused names the layer."""
    negative = scale < 0
    if not bool(negative.any()):
        return packed, scale
    group = packed.shape[1] * 8 // scale.shape[1]
    parts = []
    for start in range(0, packed.shape[0], FOLD_ROWS):
        codes = unpack_codes(packed[start : start + FOLD_ROWS])
        flip = negative[start : start + FOLD_ROWS].repeat_interleave(group, dim=1)
        if bool((flip & (codes == 0)).any()):
            raise Int8ActRefused(
                f"{prefix}: a group with a negative scale holds code 0 (+8 x |scale| once the "
                f"sign moves into the codes, beyond int4); leave its layer group out of INT8_ACT "
                f"(or INT8_ACT=0), or requantize with non-negative scales"
            )
        parts.append(pack_codes(torch.where(flip, 2 * CODE_BIAS - codes, codes)))
    return torch.cat(parts), scale.abs()


def first_kernel(kernels: tuple, config, capability: int | None):
    """The first of `kernels` that takes `config` at this capability (None: any), as vLLM's
    choose_mp_linear_kernel walks its list (VLLM_DISABLED_KERNELS included)."""
    from vllm import envs

    reasons = []
    for kernel in kernels:
        too_old = capability is not None and kernel.get_min_capability() > capability
        if kernel.__name__ in envs.VLLM_DISABLED_KERNELS or too_old:
            reasons.append(f"{kernel.__name__}: disabled or needs a newer GPU")
            continue
        can, why = kernel.can_implement(config)
        if can:
            return kernel
        reasons.append(f"{kernel.__name__}: {why}")
    raise ValueError("no kernel of vLLM's list takes this W4A16 layer: " + "; ".join(reasons))


def _capability(device: torch.device) -> int | None:
    """10 * major + minor of a CUDA device; None elsewhere (no architecture to look up)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


@functools.cache
def linear_kernel_class(rest: tuple):
    """The dispatching MPLinearKernel in front of `rest` (vLLM's list after it), built on first
    use so importing this module does not load vLLM's layer machinery."""
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import (
        MPLinearKernel,
        MPLinearLayerConfig,
    )
    from vllm.scalar_type import scalar_types

    class HyperQwenW4A8LinearKernel(MPLinearKernel):
        """A W4A16 layer through an 8-bit-activation kernel if INT8_ACT selects its group,
        else through vLLM's next kernel; chosen when its weights are processed."""

        fallback = rest

        @classmethod
        def get_min_capability(cls) -> int:
            # any: on an architecture the table lacks, a selected layer is refused by name at
            # load rather than INT8_ACT silently skipped
            return 0

        @classmethod
        def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
            if c.weight_type != scalar_types.uint4b8 or c.zero_points or c.has_g_idx:
                return False, "takes symmetric int4 (uint4b8) without activation order"
            if c.act_type not in (torch.bfloat16, torch.float16):
                return False, f"activations {c.act_type} (takes bf16, fp16)"
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            kernel, config = self._choose(layer)
            self.inner = kernel(
                config, self.w_q_name, self.w_s_name, self.w_zp_name, self.w_gidx_name
            )
            self.inner.process_weights_after_loading(layer)

        def _choose(self, layer: torch.nn.Module):
            prefix = getattr(layer, "prefix", "")
            device = getattr(layer, self.w_q_name).device
            capability = _capability(device)
            group = layer_group(prefix)
            if group not in selected_groups(env_value(W4A8_LINEAR)):
                return first_kernel(self.fallback, self.config, capability), self.config
            candidate = candidate_for(capability)
            if why := candidate.refusal(self.config):
                raise Int8ActRefused(
                    f"INT8_ACT={env_value(W4A8_LINEAR)}: {prefix} ({group}) cannot run "
                    f"{candidate.name} (sm{capability}): {why}; leave {group} out of INT8_ACT"
                )
            if candidate.needs_positive_scales:
                words, scales = getattr(layer, self.w_q_name), getattr(layer, self.w_s_name)
                words.data, scales.data = fold_scale_signs(words.data, scales.data, prefix)
            candidate.prepare(layer)
            if (group, candidate.name) not in _ANNOUNCED:  # once per group, not per layer
                _ANNOUNCED.add((group, candidate.name))
                log.info("INT8_ACT: %s layers run %s with %s activations (sm%d)", group,
                         candidate.kernel, candidate.activations, capability)  # fmt: skip
            return candidate.kernel_class(), candidate.config(self.config)

        def apply_weights(
            self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            return self.inner.apply_weights(layer, x, bias)

    return HyperQwenW4A8LinearKernel


def linear_kernels(kernels: list, on_cuda: bool) -> list:
    """vLLM's mixed-precision kernels in the order it tries them, the dispatcher first on CUDA
    (it hands a layer it does not run 8-bit to the rest of the list)."""
    return [linear_kernel_class(tuple(kernels)), *kernels] if on_cuda else kernels


def int8_activation_refusal(config: Mapping, where: str, setting: str) -> str | None:
    """Why INT8_ACT=`setting` cannot serve the model whose config.json is `config`: no int4
    layers at all, or quantized weights with zero points (asymmetric) or activation order,
    which the 8-bit-activation kernels do not take (below); None: it can."""
    raw = config.get("quantization_config")
    fix = "set INT8_ACT=0"
    if not raw:
        return f"INT8_ACT={setting}: {where} has no quantization_config (no int4 layers); {fix}"
    method = raw.get("quant_method")
    problems = []
    if method == "compressed-tensors":
        for name, group in (raw.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            if weights.get("symmetric") is False:
                problems.append(f"config group {name} has zero points (symmetric: false)")
            if weights.get("actorder") == "group":
                problems.append(f"config group {name} has activation order (actorder: group)")
    elif method == "gptq":
        if raw.get("sym") is False:
            problems.append("GPTQ with zero points (sym: false)")
        if raw.get("desc_act"):
            problems.append("GPTQ with activation order (desc_act: true)")
    elif method == "awq" and raw.get("zero_point", True):
        problems.append("AWQ with zero points (zero_point: true)")
    if not problems:
        return None
    return (
        f"INT8_ACT={setting}: {where}: {'; '.join(problems)}; the 8-bit-activation kernels "
        f"take symmetric int4 group scales only. {fix}, or serve a symmetric group-{GROUP_SIZE} "
        f"checkpoint (hyperqwen prepare refuses any other)"
    )


def serve_refusal(setting: str, gpus: list, model_dir: Path) -> str | None:
    """Why INT8_ACT=`setting` cannot serve the model in `model_dir` on these GPUs (each a
    gpu.Gpu), or None; a folder without config.json is the launcher's to report."""
    for gpu in gpus:
        major, minor = gpu.compute_capability
        if reason := architecture_refusal(10 * major + minor, setting):
            return f"{reason} (GPU {gpu.index}: {gpu.name})"
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return None
    return int8_activation_refusal(json.loads(config_file.read_text()), str(config_file), setting)
