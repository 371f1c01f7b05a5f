"""What the capacity budget reads from this machine: the card's memory and the model's size.

`hyperqwen serve` calls `probe_machine` before it builds the launch; capacity.py stays pure.
Weights are counted from the safetensors headers, less the tensors vLLM will not load with
these settings: the vision tower with VISION=0 (--language-model-only) and the MTP layer unless
SPEC=mtp; the files an engine feature's prepare step writes count where its step says the
server loads them (the draft head: prepare/marker.FEATURE_STEPS).
"""

from __future__ import annotations

import json
from pathlib import Path

from hyperqwen.capacity import ASSUMED_CARD_BYTES, PREPARED_27B_WEIGHT_BYTES, GiB, Machine
from hyperqwen.checkpoint.geometry import MODEL_TYPE, PRESETS, Geometry, GeometryError
from hyperqwen.checkpoint.layout import MTP_PREFIX, VISION_PREFIX
from hyperqwen.checkpoint.shards import INDEX_NAME, ShardFileError, read_header
from hyperqwen.gpu import Gpu
from hyperqwen.prepare.marker import FEATURE_STEPS
from hyperqwen.settings import Settings


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
        try:
            geometry = Geometry.from_text_config(text)
            weights = loaded_weight_bytes(model_dir, settings)
        except (GeometryError, ShardFileError) as error:
            return f"{config_file}: {error}"
        source = f"the weights in {model_dir}"
    return Machine(card_bytes, card, geometry, weights, source, assumed)


def loaded_weight_bytes(model_dir: Path, settings: Settings) -> int:
    """Bytes of the tensors vLLM loads from the folder's safetensors with these settings: the
    shards its index lists (every *.safetensors without one) and the engine features' model
    files the server loads with them."""
    index = model_dir / INDEX_NAME
    feature_files = {name for step in FEATURE_STEPS.values() for name in step.MODEL_FILES}
    if index.is_file():
        names = set(json.loads(index.read_text())["weight_map"].values())
    else:
        names = {path.name for path in model_dir.glob("*.safetensors")} - feature_files
    for step in FEATURE_STEPS.values():
        if step.loads_model_files(settings):
            names |= {name for name in step.MODEL_FILES if name.endswith(".safetensors")}
    skipped = [] if settings.VISION == "1" else [VISION_PREFIX + "."]
    if settings.SPEC != "mtp":
        skipped.append(MTP_PREFIX + ".")
    return sum(
        entry.nbytes
        for name in sorted(names)
        if (model_dir / name).is_file()
        for tensor, entry in read_header(model_dir / name).tensors.items()
        if not tensor.startswith(tuple(skipped))
    )
