"""The on-disk weight format of the public W4A16 base, in one place: pack, unpack, read, config.

Body linears are compressed-tensors `pack-quantized`: symmetric int4 weights in groups of 128
input features, eight 4-bit values per int32 (`weight_packed`, shape [out, in/8]), one bf16
scale per group (`weight_scale`, [out, in/128]) and the unpacked shape (`weight_shape`, int64
[2]). `config.json` carries a `quantization_config` with one group (`group_0`, targets
`Linear`) and an `ignore` list naming every linear and embedding module kept in bf16.

`hyperqwen prepare` adds groups of the same family: the same symmetric group-128 arguments at
8 bits (four values per int32, stored unsigned with a +128 offset, which vLLM reads as
`uint8b128`), each group targeting the modules it moves out of `ignore`.

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

from hyperqwen.checkpoint import w4a16_sizes as sizes
from hyperqwen.checkpoint.w4a16_sizes import GROUP_SIZE, NUM_BITS, REGEX_PREFIX, matches

FORMAT = CompressionFormat.pack_quantized.value
PRESET = "W4A16"
# Bit widths of the groups prepare adds; vLLM's WNA16 linear kernels (Machete, Marlin) and its
# compressed-tensors embedding gather both take 4 and 8.
SUPPORTED_BITS = (4, 8)
BASE_GROUP = "group_0"
SCALE_DTYPE = torch.bfloat16
# Machete (vLLM's W4A16 kernel on Hopper) tiles weights 128 inputs x 128 outputs; Marlin needs
# 128 x 64. Whole 128-groups on the input side are also what group quantization needs.
KERNEL_IN_MULTIPLE = GROUP_SIZE
KERNEL_OUT_MULTIPLE = 128
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


class FormatError(ValueError):
    """A checkpoint or a weight shape that the W4A16 pack-quantized format cannot hold."""


def scheme(num_bits: int = NUM_BITS, targets: Iterable[str] = ("Linear",)) -> QuantizationScheme:
    """The base's symmetric group-128 int scheme, at `num_bits` (4 is the W4A16 preset)."""
    if num_bits not in SUPPORTED_BITS:
        raise FormatError(f"{num_bits}-bit weights: supported widths are {SUPPORTED_BITS}")
    base = preset_name_to_scheme(PRESET, list(targets))
    base.weights = base.weights.model_copy(update={"num_bits": num_bits})
    return base


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


def _group_bits(group: QuantizationScheme) -> int | None:
    """The bit width of a weight-only group of this format family, or None for anything else."""
    if group.weights is None or group.input_activations or group.output_activations:
        return None
    bits = group.weights.num_bits
    if bits not in SUPPORTED_BITS:
        return None
    expected = scheme(bits).weights.model_dump()
    return bits if group.weights.model_dump() == expected else None


def read_quantization_config(checkpoint_dir: Path) -> QuantizationConfig:
    """The checkpoint's quantization config, refused unless it is this W4A16 format.

    `group_0` must be the base's W4A16 group; further groups (added by `hyperqwen prepare`)
    must be weight-only symmetric group-128 int groups of a supported width.
    """
    config_path = checkpoint_dir / "config.json"
    raw = json.loads(config_path.read_text()).get("quantization_config")
    if raw is None:
        raise FormatError(f"{config_path} has no quantization_config: not a W4A16 checkpoint")
    config = QuantizationConfig.model_validate(raw)
    base = config.config_groups.get(BASE_GROUP)
    others = [group for name, group in config.config_groups.items() if name != BASE_GROUP]
    if (
        config.format != FORMAT
        or base is None
        or _group_bits(base) != NUM_BITS
        or any(_group_bits(group) is None for group in others)
    ):
        raise FormatError(
            f"{config_path}: quantization_config is not compressed-tensors {FORMAT} "
            f"{PRESET} (int4, symmetric, group size {GROUP_SIZE})"
        )
    return config


def with_int_group(
    quantization_config: Mapping,
    group_name: str,
    num_bits: int,
    targets: list[str],
    modules: Iterable[str],
    all_modules: Iterable[str],
) -> dict:
    """A copy of config.json's `quantization_config` in which `targets` get int`num_bits` g128.

    `modules` (what the targets name, written as in the checkpoint) leave `ignore`. A regex
    entry of `ignore` that names one of them is replaced by the names it matched in
    `all_modules` other than those, so everything else it kept in bf16 stays so.
    """
    modules = set(modules)
    ignore: list[str] = []
    for entry in quantization_config.get("ignore") or []:
        if entry in modules:
            continue
        if entry.startswith(REGEX_PREFIX) and any(matches(entry, module) for module in modules):
            ignore += [m for m in all_modules if m not in modules and matches(entry, m)]
            continue
        ignore.append(entry)
    groups = dict(quantization_config["config_groups"])
    groups[group_name] = scheme(num_bits, targets).model_dump(mode="json")
    return {**quantization_config, "config_groups": groups, "ignore": list(dict.fromkeys(ignore))}


def packed_name(module: str, suffix: str) -> str:
    return f"{module}.{suffix}"


def stored_shapes(
    out_features: int, in_features: int, num_bits: int = NUM_BITS
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each stored tensor of one quantized linear, keyed by suffix."""
    return {
        "weight_packed": ((out_features, in_features * num_bits // 32), torch.int32),
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


def pack(weight: torch.Tensor, num_bits: int = NUM_BITS) -> dict[str, torch.Tensor]:
    """Quantize one [out, in] bf16 weight; returns the stored tensors keyed by suffix.

    Rows are quantized independently, so packing a block of rows gives exactly those rows of
    the packed whole (prepare packs large tensors block by block).
    """
    bits_scheme = scheme(num_bits)
    scale, zero_point = compute_dynamic_scales_and_zp(weight, bits_scheme.weights, module=None)
    compressed = PackedQuantizationCompressor.compress(
        {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}, bits_scheme
    )
    return {suffix: compressed[suffix] for suffix in PACKED_SUFFIXES}


def packed_bits(stored: Mapping[str, torch.Tensor]) -> int:
    """The bit width of stored packed tensors, from the packed and the logical widths."""
    return sizes.packed_bits(stored["weight_packed"].shape[1], int(stored["weight_shape"][1]))


def unpack(stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Dequantize the stored tensors of one linear (keyed by suffix) back to a bf16 weight."""
    decompressed = PackedQuantizationCompressor.decompress(
        dict(stored), scheme(packed_bits(stored))
    )
    return decompressed["weight"].to(SCALE_DTYPE)


def read_linear(tensors: Mapping[str, torch.Tensor], module: str) -> torch.Tensor:
    """The bf16 weight of `module`, dequantized if it is stored packed."""
    if packed_name(module, "weight_packed") in tensors:
        return unpack({suffix: tensors[packed_name(module, suffix)] for suffix in PACKED_SUFFIXES})
    return tensors[f"{module}.weight"]
