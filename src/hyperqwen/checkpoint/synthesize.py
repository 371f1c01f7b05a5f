"""Build a servable Qwen3.5 checkpoint of any geometry with seeded random weights.

Every tensor is drawn from its own generator, seeded from (seed, tensor name), so any single
tensor can be regenerated without the rest and the result does not depend on shard size or
order. Tensors are generated, quantized and written one shard at a time, so memory peaks at
about twice the largest shard (safetensors serializes a shard in memory), whatever the model size.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hyperqwen.checkpoint import config_json, layout, shards, tokenizer, w4a16
from hyperqwen.checkpoint.geometry import Geometry
from hyperqwen.checkpoint.layout import Init, WeightSpec

# Standard deviation of linear and embedding weights: Qwen3.5's initializer_range, what a
# freshly initialised model holds.
INIT_STD = config_json.INITIALIZER_RANGE
WEIGHT_DTYPE = torch.bfloat16


@dataclass
class SynthesisResult:
    directory: Path
    files: dict[str, int]  # name -> bytes
    parameters: int
    seconds: float


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def initial_value(spec: WeightSpec, seed: int) -> torch.Tensor:
    """The full-precision (bf16) value of one tensor before quantization."""
    generator = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    if spec.init is Init.NORMAL:
        return torch.randn(spec.shape, generator=generator, dtype=WEIGHT_DTYPE).mul_(INIT_STD)
    if spec.init is Init.A_LOG:
        # As transformers initialises Qwen3.5: A ~ U(0.01, 16), stored as log(A).
        decay = torch.empty(spec.shape).uniform_(0.01, 16, generator=generator)
        return decay.log_().to(WEIGHT_DTYPE)
    fill = torch.zeros if spec.init is Init.ZEROS else torch.ones
    return fill(spec.shape, dtype=WEIGHT_DTYPE)


def stored_tensors(spec: WeightSpec, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """What goes into the file for one tensor: packed W4A16 parts, or the bf16 tensor itself."""
    if not spec.quantized:
        return {spec.name: value}
    return {
        w4a16.packed_name(spec.module, suffix): tensor
        for suffix, tensor in w4a16.pack(value).items()
    }


def stored_bytes(spec: WeightSpec) -> int:
    if not spec.quantized:
        return shards.tensor_bytes(spec.shape, WEIGHT_DTYPE)
    return sum(
        shards.tensor_bytes(shape, dtype)
        for shape, dtype in w4a16.stored_shapes(*spec.shape).values()
    )


def check_geometry(geometry: Geometry) -> list[WeightSpec]:
    """Validate the geometry for vLLM and its W4A16 kernels; return the tensor layout."""
    geometry.validate(tokenizer.TOKENIZER_SIZE)
    specs = layout.checkpoint_layout(geometry)
    for spec in specs:
        if spec.quantized:
            assert spec.dims_from is not None, f"{spec.name} is quantized but has no dims_from"
            w4a16.check_kernel_shape(spec.name, *spec.shape, spec.dims_from)
    return specs


def _write_weights(
    directory: Path,
    specs: list[WeightSpec],
    seed: int,
    max_shard_bytes: int,
    on_progress: Callable[[int], None],
) -> None:
    plan = shards.plan_shards(specs, stored_bytes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard_index, shard_specs in enumerate(plan):
        file_name = shards.shard_name(shard_index, len(plan))
        tensors: dict[str, torch.Tensor] = {}
        for spec in shard_specs:
            tensors.update(stored_tensors(spec, initial_value(spec, seed)))
            on_progress(stored_bytes(spec))
        shards.write_shard(directory / file_name, tensors)
        for name, tensor in tensors.items():
            weight_map[name] = file_name
            total_size += tensor.numel() * tensor.element_size()
    shards.write_index(directory, weight_map, total_size)


def synthesize(
    out_dir: Path,
    geometry: Geometry,
    *,
    seed: int = 0,
    config_only: bool = False,
    max_shard_bytes: int = shards.parse_size(shards.DEFAULT_MAX_SHARD_SIZE),
    force: bool = False,
    progress: bool = True,
    edit_quantization: Callable[[dict, list[WeightSpec]], dict] | None = None,
) -> SynthesisResult:
    """Write config, tokenizer and (unless `config_only`) weights to `out_dir`, atomically.

    `edit_quantization(quantization_config, specs)` rewrites config.json's quantization config
    before the folder is renamed into place (the weights, if any, must match what it says)."""
    from tqdm import tqdm

    started = time.monotonic()
    specs = check_geometry(geometry)
    with shards.atomic_directory(out_dir, force=force) as staging:
        config_json.write_config(staging, geometry)
        w4a16.write_quantization_config(staging, layout.unquantized_modules(specs))
        if edit_quantization is not None:
            config_path = staging / "config.json"
            config = json.loads(config_path.read_text())
            config["quantization_config"] = edit_quantization(config["quantization_config"], specs)
            config_path.write_text(json.dumps(config, indent=2) + "\n")
        config_json.write_generation_config(staging)
        tokenizer.write_tokenizer_files(staging, geometry.max_position_embeddings)
        if not config_only:
            total = sum(stored_bytes(spec) for spec in specs)
            with tqdm(
                total=total, unit="B", unit_scale=True, desc="weights", disable=not progress
            ) as bar:
                _write_weights(staging, specs, seed, max_shard_bytes, bar.update)
        files = {path.name: path.stat().st_size for path in sorted(staging.iterdir())}
    return SynthesisResult(
        directory=out_dir.absolute(),
        files=files,
        parameters=sum(math.prod(spec.shape) for spec in specs),
        seconds=time.monotonic() - started,
    )
