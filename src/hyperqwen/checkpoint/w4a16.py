"""The on-disk weight format of the public W4A16 base, in one place: pack, unpack, read, config.

Body linears are compressed-tensors `pack-quantized`: symmetric int4 weights in groups of 128
input features, eight 4-bit values per int32 (`weight_packed`, shape [out, in/8]), one bf16
scale per group (`weight_scale`, [out, in/128]) and the unpacked shape (`weight_shape`, int64
[2]). `config.json` carries a `quantization_config` with one group (`group_0`, targets
`Linear`) and an `ignore` list naming every linear and embedding module kept in bf16.

All quantization arithmetic is compressed-tensors' own (its W4A16 preset, scale computation,
`PackedQuantizationCompressor` and `ModelCompressor.update_config`), so files written here are
the files llm-compressor would write for the same weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

FORMAT = CompressionFormat.pack_quantized.value
PRESET = "W4A16"
GROUP_SIZE = 128
NUM_BITS = 4
VALUES_PER_INT32 = 32 // NUM_BITS
SCALE_DTYPE = torch.bfloat16
# Machete (vLLM's W4A16 kernel on Hopper) tiles weights 128 inputs x 128 outputs; Marlin needs
# 128 x 64. Whole 128-groups on the input side are also what group quantization needs.
KERNEL_IN_MULTIPLE = GROUP_SIZE
KERNEL_OUT_MULTIPLE = 128
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


class FormatError(ValueError):
    """A checkpoint or a weight shape that the W4A16 pack-quantized format cannot hold."""


def scheme() -> QuantizationScheme:
    return preset_name_to_scheme(PRESET, ["Linear"])


def quantization_config(ignore: Iterable[str]) -> QuantizationConfig:
    return QuantizationConfig(
        config_groups={"group_0": scheme()},
        format=FORMAT,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=list(ignore),
    )


def write_quantization_config(checkpoint_dir: Path, ignore: Iterable[str]) -> None:
    """Add `quantization_config` to the checkpoint's config.json, as llm-compressor does."""
    ModelCompressor(quantization_config=quantization_config(ignore)).update_config(
        str(checkpoint_dir)
    )


def read_quantization_config(checkpoint_dir: Path) -> QuantizationConfig:
    """The checkpoint's quantization config, refused unless it is this W4A16 format."""
    config_path = checkpoint_dir / "config.json"
    raw = json.loads(config_path.read_text()).get("quantization_config")
    if raw is None:
        raise FormatError(f"{config_path} has no quantization_config: not a W4A16 checkpoint")
    config = QuantizationConfig.model_validate(raw)
    expected = scheme().weights
    groups = list(config.config_groups.values())
    if (
        config.format != FORMAT
        or len(groups) != 1
        or groups[0].weights is None
        or groups[0].weights.model_dump() != expected.model_dump()
    ):
        raise FormatError(
            f"{config_path}: quantization_config is not compressed-tensors {FORMAT} "
            f"{PRESET} (int4, symmetric, group size {GROUP_SIZE})"
        )
    return config


def packed_name(module: str, suffix: str) -> str:
    return f"{module}.{suffix}"


def stored_shapes(
    out_features: int, in_features: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each stored tensor of one quantized linear, keyed by suffix."""
    return {
        "weight_packed": ((out_features, in_features // VALUES_PER_INT32), torch.int32),
        "weight_scale": ((out_features, in_features // GROUP_SIZE), SCALE_DTYPE),
        "weight_shape": ((2,), torch.int64),
    }


def check_kernel_shape(
    weight_name: str, out_features: int, in_features: int, dims_from: tuple[str, str]
) -> None:
    """Refuse shapes vLLM's W4A16 kernels reject; name the geometry knobs that set them."""
    for size, multiple, side, knob in (
        (in_features, KERNEL_IN_MULTIPLE, "in_features", dims_from[1]),
        (out_features, KERNEL_OUT_MULTIPLE, "out_features", dims_from[0]),
    ):
        if size % multiple:
            raise FormatError(
                f"{weight_name}: {side}={size} (= {knob}) is not a multiple of {multiple}, "
                f"which vLLM's int4 group-{GROUP_SIZE} kernels need; change {knob} with --set"
            )


def pack(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize one [out, in] bf16 weight; returns the stored tensors keyed by suffix."""
    weight_args = scheme().weights
    scale, zero_point = compute_dynamic_scales_and_zp(weight, weight_args, module=None)
    compressed = PackedQuantizationCompressor.compress(
        {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}, scheme()
    )
    return {suffix: compressed[suffix] for suffix in PACKED_SUFFIXES}


def unpack(stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Dequantize the stored tensors of one linear (keyed by suffix) back to a bf16 weight."""
    decompressed = PackedQuantizationCompressor.decompress(dict(stored), scheme())
    return decompressed["weight"].to(SCALE_DTYPE)


def read_linear(tensors: Mapping[str, torch.Tensor], module: str) -> torch.Tensor:
    """The bf16 weight of `module`, dequantized if it is stored packed."""
    if packed_name(module, "weight_packed") in tensors:
        return unpack({suffix: tensors[packed_name(module, suffix)] for suffix in PACKED_SUFFIXES})
    return tensors[f"{module}.weight"]
