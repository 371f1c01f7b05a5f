"""Sharded safetensors on disk: size parsing, shard planning, writing, reading, atomic publish.

Files follow the Hugging Face convention every loader understands: shards named
`model-00001-of-0000N.safetensors` plus `model.safetensors.index.json` mapping each tensor to
its shard. A checkpoint directory is built in a hidden sibling directory and renamed into place
only once every file is written and fsynced, so a crash never leaves a half-written checkpoint
where a server would load it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # torch and safetensors load lazily: the CLI parser imports this module
    import torch

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "2GB"
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}

Item = TypeVar("Item")


def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000 (decimal units as Hugging Face uses; KiB/MiB/GiB are binary)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"size {text!r}: expected a number with a unit such as 500MB, 2GB, 4GiB")
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def plan_shards(
    items: Sequence[Item], size_of: Callable[[Item], int], max_bytes: int
) -> list[list[Item]]:
    """Greedy in-order split: start a new shard when the next item would overflow this one.

    An item larger than `max_bytes` gets a shard of its own (as Hugging Face does).
    """
    shards: list[list[Item]] = [[]]
    filled = 0
    for item in items:
        size = size_of(item)
        if shards[-1] and filled + size > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(item)
        filled += size
    return [shard for shard in shards if shard]


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _fsync_path(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    # "format": "pt" is the metadata transformers and vLLM expect on PyTorch safetensors.
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_index(directory: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


class ShardedReader(Mapping[str, "torch.Tensor"]):
    """Read-only, lazy view of a sharded checkpoint: `reader[name]` loads one tensor."""

    def __init__(self, directory: Path) -> None:
        index_path = directory / INDEX_NAME
        if not index_path.is_file():
            raise FileNotFoundError(f"{index_path} not found: not a sharded safetensors checkpoint")
        self._directory = directory
        self._weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._directory / self._weight_map[name], framework="pt") as shard:
            return shard.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._weight_map)

    def __len__(self) -> int:
        return len(self._weight_map)

    def shard_files(self) -> list[str]:
        return sorted(set(self._weight_map.values()))


@contextlib.contextmanager
def atomic_directory(target: Path, force: bool) -> Iterator[Path]:
    """Yield a staging directory next to `target`; on success fsync it and rename it into place.

    An existing non-empty `target` is refused unless `force`, in which case it is replaced only
    after the new directory is complete. On any error the staging directory is removed.
    """
    target = target.absolute()
    if target.exists():
        if not target.is_dir():
            raise FileExistsError(f"{target} exists and is not a directory")
        if any(target.iterdir()) and not force:
            raise FileExistsError(
                f"{target} is not empty; pass --force to replace it, or choose another directory"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield staging
        # mkdtemp and safetensors create owner-only entries; servers often run as another user.
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
            _fsync_path(path)
        _fsync_path(staging)
        retired = target.parent / f".{target.name}.replaced-{uuid.uuid4().hex[:8]}"
        if target.exists():
            os.rename(target, retired)
        os.rename(staging, target)
        _fsync_path(target.parent)
        shutil.rmtree(retired, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
