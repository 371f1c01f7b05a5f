"""Read and check the base checkpoint before prepare writes anything.

Prepare always plans from the *base*: the pristine copies in `.hyperqwen/pristine/` where an
earlier run made them, the folder's own files otherwise. Everything is checked up front, and
any problem is a `Refused` naming the file and the fix: not compressed-tensors W4A16, not the
Qwen3.5 architecture, a layer layout other than the one the config describes, a missing
tokenizer, a shard missing or truncated (header length and data offsets against the file size).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hyperqwen.checkpoint import layout, shards, w4a16
from hyperqwen.checkpoint.geometry import MODEL_TYPE, TEXT_MODEL_TYPE, Geometry, GeometryError
from hyperqwen.prepare.folder import (
    CONFIG_NAME,
    PLACE_BY_HAND,
    PRISTINE_DIR,
    Refused,
    pristine_path,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Tensors of the vision tower: passed through untouched, never checked against the text layout.
PASS_THROUGH_PREFIXES = (f"{layout.VISION_PREFIX}.",)


@dataclass(frozen=True)
class Base:
    """The base checkpoint prepare computes every output from."""

    directory: Path
    config: dict
    config_text: str
    index_text: str
    index_metadata: dict
    weight_map: dict[str, str]
    geometry: Geometry
    headers: dict[str, shards.ShardHeader]  # shard file name -> header (file in folder or pristine)

    def shard_path(self, name: str) -> Path:
        return self.headers[name].path


def base_file(model_dir: Path, name: str) -> Path:
    """The base's copy of a folder file: its pristine copy once prepare replaced it."""
    backup = pristine_path(model_dir, name)
    return backup if backup.exists() else model_dir / name


def read_geometry(config: dict, config_path: Path) -> Geometry:
    """The text model's geometry from a Qwen3.5 config.json; Refused for anything else."""
    if config.get("model_type") != MODEL_TYPE or not isinstance(config.get("text_config"), dict):
        raise Refused(
            f"{config_path}: model_type {config.get('model_type')!r}; prepare knows the Qwen3.5 "
            f"architecture only (model_type {MODEL_TYPE!r} with a text_config)"
        )
    text = config["text_config"]
    if text.get("model_type") != TEXT_MODEL_TYPE:
        raise Refused(
            f"{config_path}: text_config.model_type {text.get('model_type')!r}, expected "
            f"{TEXT_MODEL_TYPE!r}"
        )
    try:
        return Geometry.from_text_config(text)
    except GeometryError as error:
        raise Refused(f"{config_path}: {error}") from None


def expected_tensors(geometry: Geometry) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (safetensors dtype, shape) of every text tensor the base must hold."""
    expected = {}
    for spec in layout.checkpoint_layout(geometry):
        if spec.quantized:
            for suffix, (shape, dtype) in w4a16.stored_shapes(*spec.shape).items():
                expected[w4a16.packed_name(spec.module, suffix)] = (shards.dtype_name(dtype), shape)
        else:
            expected[spec.name] = ("BF16", spec.shape)
    return expected


def _read_index(model_dir: Path) -> tuple[str, dict, dict[str, str]]:
    index_path = base_file(model_dir, shards.INDEX_NAME)
    if not index_path.is_file():
        raise Refused(
            f"{model_dir}: no {shards.INDEX_NAME} (the base is a sharded checkpoint); "
            + PLACE_BY_HAND.format(folder=model_dir)
        )
    text = index_path.read_text()
    try:
        index = json.loads(text)
        return text, index.get("metadata", {}), dict(index["weight_map"])
    except (json.JSONDecodeError, KeyError, TypeError):
        raise Refused(
            f"{index_path} is not a safetensors index (no weight_map): re-download it"
        ) from None


def _header(path: Path) -> shards.ShardHeader:
    try:
        return shards.read_header(path)
    except shards.ShardFileError as error:
        raise Refused(
            f"{error}. Download or copy {path.name} again (`hyperqwen prepare` resumes an "
            "interrupted download when the folder came from it)"
        ) from None


def _check_layout(base_headers: dict[str, shards.ShardHeader], weight_map, geometry, where):
    expected = expected_tensors(geometry)
    problems = []
    for name, (dtype, shape) in expected.items():
        shard = weight_map.get(name)
        entry = base_headers[shard].tensors.get(name) if shard else None
        if entry is None:
            problems.append(f"{name} is missing" + (f" from {shard}" if shard else ""))
        elif (entry.dtype, entry.shape) != (dtype, shape):
            problems.append(
                f"{name} is {entry.dtype} {list(entry.shape)}, expected {dtype} {list(shape)}"
            )
    unexpected = sorted(
        name
        for name in weight_map
        if name not in expected and not name.startswith(PASS_THROUGH_PREFIXES)
    )
    problems += [f"{name} is not part of the layout" for name in unexpected[:5]]
    if len(unexpected) > 5:
        problems.append(f"... and {len(unexpected) - 5} more unexpected tensors")
    if problems:
        raise Refused(
            f"{where}: the tensors do not match the Qwen3.5 W4A16 base layout that config.json "
            "describes (an unexpected layer layout, or not the base prepare starts from): "
            + "; ".join(problems[:8])
        )


def load_base(model_dir: Path) -> Base:
    """Read and check the base (see the module docstring); nothing is written."""
    config_path = base_file(model_dir, CONFIG_NAME)
    if not config_path.is_file():
        raise Refused(f"{model_dir}: no {CONFIG_NAME}; " + PLACE_BY_HAND.format(folder=model_dir))
    config_text = config_path.read_text()
    try:
        config = json.loads(config_text)
    except json.JSONDecodeError as error:
        raise Refused(f"{config_path} is not JSON ({error}): re-download it") from None
    geometry = read_geometry(config, config_path)
    try:
        quantization = w4a16.read_quantization_config(config_path.parent)
    except (w4a16.FormatError, ValueError) as error:
        raise Refused(
            f"{error}. Prepare starts from the compressed-tensors W4A16 (pack-quantized int4, "
            "group 128) base; point MODEL at that checkpoint"
        ) from None
    if list(quantization.config_groups) != [w4a16.BASE_GROUP]:
        raise Refused(
            f"{config_path} was already prepared, but its pristine copy in "
            f"{model_dir / PRISTINE_DIR} is gone; download the base again into a new folder"
        )
    index_text, index_metadata, weight_map = _read_index(model_dir)
    headers = {}
    for shard in sorted(set(weight_map.values())):
        path = base_file(model_dir, shard)
        if not path.is_file():
            raise Refused(
                f"{model_dir / shard} is missing (the index lists it); "
                + PLACE_BY_HAND.format(folder=model_dir)
            )
        headers[shard] = _header(path)
    for name, shard in weight_map.items():
        if name not in headers[shard].tensors:
            raise Refused(f"{headers[shard].path}: the index says it holds {name}, it does not")
    _check_layout(headers, weight_map, geometry, model_dir)
    missing = [name for name in TOKENIZER_FILES if not (model_dir / name).is_file()]
    if missing:
        raise Refused(
            f"{model_dir}: tokenizer file(s) missing: {', '.join(missing)}; copy them from the "
            "base checkpoint (vLLM needs them to serve)"
        )
    return Base(
        directory=model_dir,
        config=config,
        config_text=config_text,
        index_text=index_text,
        index_metadata=index_metadata,
        weight_map=weight_map,
        geometry=geometry,
        headers=headers,
    )
