"""What the capacity budget reads from this machine: the card's memory and the model's size.

`hyperqwen serve` calls `probe_machine` before it builds the launch; capacity.py stays pure.
Weights are counted from the safetensors headers, less the tensors vLLM will not load with these
settings: the vision tower with VISION=0 (--language-model-only) and the MTP layer unless
SPEC=mtp; the files an engine feature's prepare step writes count where its step says the server
loads them, at the size the feature holds them in (the draft head:
prepare/marker.FEATURE_STEPS). Served with `--load-format dummy` (EXTRA_ARGS), vLLM reads no
shard and fills the tensors config.json declares: those are counted instead, from the checkpoint
layout and the quantization groups of the config (the benches' config-only folders hold no
shards at all). Either count gets the share more that vLLM was seen to keep after loading
(capacity.LOAD_OVERHEAD_SHARE).
"""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

from hyperqwen.capacity import (
    ASSUMED_CARD_BYTES,
    LOAD_OVERHEAD_SHARE,
    MODEL_DTYPE_BYTES,
    PREPARED_27B_WEIGHT_BYTES,
    GiB,
    Machine,
    with_load_overhead,
)
from hyperqwen.checkpoint.geometry import MODEL_TYPE, PRESETS, Geometry, GeometryError
from hyperqwen.checkpoint.layout import MTP_PREFIX, VISION_PREFIX, checkpoint_layout
from hyperqwen.checkpoint.shards import INDEX_NAME, ShardFileError, read_header
from hyperqwen.checkpoint.w4a16_sizes import GROUP_SIZE, NUM_BITS, SCALE_BYTES, SHAPE_BYTES
from hyperqwen.gpu import Gpu
from hyperqwen.prepare.marker import FEATURE_STEPS
from hyperqwen.settings import Settings
from hyperqwen.vllm_flags import flag_value


def probe_machine(settings: Settings, model_dir: Path, gpus: list[Gpu]) -> Machine | str:
    """The machine to size for, or why there is none: a model that is not a Qwen3.5
    checkpoint, whose layers the budget does not know."""
    if gpus:
        used = gpus[: settings.GPU_COUNT]
        smallest = min(used, key=lambda gpu: gpu.memory_gib)
        card_bytes, card, assumed = int(smallest.memory_gib * GiB), smallest.name, False
    else:
        card_bytes, assumed = ASSUMED_CARD_BYTES, True
        card = f"no GPU seen: an assumed {ASSUMED_CARD_BYTES // GiB} GiB card"
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        geometry, weights = PRESETS["27b"], PREPARED_27B_WEIGHT_BYTES
        source = f"no model at {model_dir}: the prepared 27B's"
    else:
        config = json.loads(config_file.read_text())
        text = config.get("text_config")
        if config.get("model_type") != MODEL_TYPE or not isinstance(text, dict):
            return f"{config_file} is not a Qwen3.5 checkpoint"
        dummy = dummy_load(settings)
        try:
            geometry = Geometry.from_text_config(text)
            weights = loaded_weight_bytes(model_dir, settings, shards=not dummy)
        except (GeometryError, ShardFileError) as error:
            return f"{config_file}: {error}"
        source = f"the weights in {model_dir}"
        if dummy:
            weights += declared_weight_bytes(config, geometry, settings)
            source = f"the tensors {config_file} declares, for --load-format dummy"
        weights = with_load_overhead(weights)
        source += f", and the {LOAD_OVERHEAD_SHARE:.1%} more vLLM keeps after loading"
    return Machine(card_bytes, card, geometry, weights, source, assumed)


def dummy_load(settings: Settings) -> bool:
    return flag_value(shlex.split(settings.EXTRA_ARGS), "--load-format") == "dummy"


def declared_weight_bytes(config: dict, geometry: Geometry, settings: Settings) -> int:
    """Bytes of the text model's tensors as config.json declares them: each linear at the bits
    of the quantization group whose `re:` target names it (prepare's int8 heads), else the
    W4A16 body where the checkpoint layout quantizes it, else bf16; the MTP layer only with
    SPEC=mtp. The vision tower is not in the layout (VISION=1 counts short)."""
    quantization = config.get("quantization_config") or {}
    patterns = [
        (re.compile(target[3:]), group["weights"]["num_bits"])
        for group in (quantization.get("config_groups") or {}).values()
        for target in group.get("targets", [])
        if target.startswith("re:")
    ]
    total = 0
    for spec in checkpoint_layout(geometry):
        if spec.name.startswith(MTP_PREFIX + ".") and settings.SPEC != "mtp":
            continue
        elements = math.prod(spec.shape)
        bits = next((b for pattern, b in patterns if pattern.match(spec.module)), None)
        if bits is None and spec.quantized:
            bits = NUM_BITS
        if bits is None or not spec.name.endswith(".weight"):
            total += elements * MODEL_DTYPE_BYTES
        else:
            total += elements * bits // 8 + elements // GROUP_SIZE * SCALE_BYTES + SHAPE_BYTES
    return total


def loaded_weight_bytes(model_dir: Path, settings: Settings, shards: bool = True) -> int:
    """Bytes of the tensors vLLM loads from the folder's safetensors with these settings: the
    shards its index lists (every *.safetensors without one; none where `shards` is False) and
    what the engine features hold for the model files the server loads with them (their
    step's `served_bytes`: the draft head's int8 rows are widened to bf16 on load)."""
    index = model_dir / INDEX_NAME
    feature_files = {name for step in FEATURE_STEPS.values() for name in step.MODEL_FILES}
    if not shards:
        names = set()
    elif index.is_file():
        names = set(json.loads(index.read_text())["weight_map"].values())
    else:
        names = {path.name for path in model_dir.glob("*.safetensors")} - feature_files
    skipped = [] if settings.VISION == "1" else [VISION_PREFIX + "."]
    if settings.SPEC != "mtp":
        skipped.append(MTP_PREFIX + ".")
    checkpoint = sum(
        entry.nbytes
        for name in sorted(names)
        if (model_dir / name).is_file()
        for tensor, entry in read_header(model_dir / name).tensors.items()
        if not tensor.startswith(tuple(skipped))
    )
    return checkpoint + sum(
        step.served_bytes(model_dir)
        for step in FEATURE_STEPS.values()
        if step.loads_model_files(settings)
    )
