"""Sharded safetensors on disk: size parsing, shard planning, writing, reading, atomic publish.

Files follow the Hugging Face convention every loader understands: shards named
`model-00001-of-0000N.safetensors` plus `model.safetensors.index.json` mapping each tensor to
its shard. A checkpoint directory is built in a hidden sibling directory and renamed into place
only once every file is written and fsynced, so a crash never leaves a half-written checkpoint
where a server would load it.

For rewriting files of a large checkpoint in little memory there is a header reader that also
proves a file complete (`read_header`), a writer that streams tensor bytes into a shard whose
header is known up front (`StreamingShard`), and a single-file atomic replace (`atomic_file`).
A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor
name to its dtype, shape and [begin, end) byte range in the data that follows, then the data.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import struct
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
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
# Bytes per element of each safetensors dtype name.
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_TORCH_DTYPE_NAMES = {
    "torch.bool": "BOOL",
    "torch.uint8": "U8",
    "torch.int8": "I8",
    "torch.int16": "I16",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.int32": "I32",
    "torch.float32": "F32",
    "torch.int64": "I64",
    "torch.float64": "F64",
}
HEADER_LENGTH_BYTES = 8
# A header larger than this is corruption, not a checkpoint (safetensors itself caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"


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


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("BF16" for torch.bfloat16)."""
    return _TORCH_DTYPE_NAMES[str(dtype)]


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


def index_text(weight_map: Mapping[str, str], metadata: Mapping) -> str:
    """The text of `model.safetensors.index.json`: metadata (total_size, ...) and the sorted map."""
    index = {"metadata": dict(metadata), "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(index, indent=2) + "\n"


def write_index(directory: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    (directory / INDEX_NAME).write_text(index_text(weight_map, {"total_size": total_size}))


class ShardFileError(ValueError):
    """A safetensors file that is truncated or malformed; the message names the file."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    tensors: dict[str, TensorEntry]  # in data order
    metadata: dict[str, str]


def read_header(path: Path) -> ShardHeader:
    """Parse a safetensors header and prove the file complete: every tensor's byte range has
    the size its dtype and shape need, the ranges tile the data, and the data ends exactly at
    the end of the file. Raises ShardFileError naming the file otherwise."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(HEADER_LENGTH_BYTES)
        if len(prefix) < HEADER_LENGTH_BYTES:
            raise ShardFileError(f"{path}: {size} bytes, too short for a safetensors header")
        (header_length,) = struct.unpack("<Q", prefix)
        if header_length > min(MAX_HEADER_BYTES, size - HEADER_LENGTH_BYTES):
            raise ShardFileError(
                f"{path}: header claims {header_length} bytes but the file has {size}: "
                "truncated or not a safetensors file"
            )
        try:
            raw = json.loads(handle.read(header_length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ShardFileError(f"{path}: unreadable safetensors header ({error})") from None
    data_start = HEADER_LENGTH_BYTES + header_length
    metadata = raw.pop(METADATA_KEY, None) or {}
    entries = []
    for name, info in raw.items():
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if info["dtype"] not in DTYPE_SIZES:
            raise ShardFileError(f"{path}: {name} has unknown dtype {info['dtype']!r}")
        if end - begin != math.prod(shape) * DTYPE_SIZES[info["dtype"]]:
            raise ShardFileError(
                f"{path}: {name} spans {end - begin} bytes, its shape {list(shape)} "
                f"of {info['dtype']} needs {math.prod(shape) * DTYPE_SIZES[info['dtype']]}"
            )
        entries.append(
            (name, TensorEntry(info["dtype"], shape, data_start + begin, data_start + end))
        )
    entries.sort(key=lambda item: item[1].begin)
    position = data_start
    for name, entry in entries:
        if entry.begin != position:
            raise ShardFileError(
                f"{path}: {name} starts at byte {entry.begin}, expected {position}"
            )
        position = entry.end
    if position != size:
        raise ShardFileError(
            f"{path}: the header describes {position} bytes but the file has {size}: "
            + (
                "truncated (an interrupted download or copy)"
                if size < position
                else "trailing data"
            )
        )
    return ShardHeader(path, dict(entries), dict(metadata))


def copy_bytes(source: Path, begin: int, end: int, sink: Callable[[bytes], None]) -> None:
    """Feed bytes [begin, end) of `source` to `sink` in blocks, never holding more than one."""
    block = 64 * 2**20
    with source.open("rb") as handle:
        handle.seek(begin)
        remaining = end - begin
        while remaining:
            data = handle.read(min(block, remaining))
            if not data:
                raise ShardFileError(f"{source}: ended {remaining} bytes early")
            sink(data)
            remaining -= len(data)


def read_rows(path: Path, entry: TensorEntry, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a tensor, read with plain file reads: unlike safetensors' mmap, the
    file's pages then do not count as this process's memory (RSS) after use."""
    import torch

    row_bytes = entry.nbytes // entry.shape[0]
    stop = min(stop, entry.shape[0])
    with path.open("rb") as handle:
        handle.seek(entry.begin + start * row_bytes)
        data = bytearray(handle.read((stop - start) * row_bytes))
    dtype = next(
        getattr(torch, name.removeprefix("torch."))
        for name, short in _TORCH_DTYPE_NAMES.items()
        if short == entry.dtype
    )
    return torch.frombuffer(data, dtype=dtype).reshape(stop - start, *entry.shape[1:])


class StreamingShard:
    """Write one safetensors file whose tensors (name, dtype, shape) are known up front, their
    bytes arriving in order and in any number of pieces. The header is written first, so memory
    holds one piece at a time, never the shard."""

    def __init__(
        self,
        handle,
        layout: Sequence[tuple[str, str, tuple[int, ...]]],
        metadata: Mapping[str, str],
    ) -> None:
        header: dict = {METADATA_KEY: dict(metadata)}
        offset = 0
        self._sizes: list[tuple[str, int]] = []
        for name, dtype, shape in layout:
            nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
            header[name] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._sizes.append((name, nbytes))
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        # Pad to 8 bytes with spaces, as safetensors does, so the data stays aligned.
        encoded += b" " * (-len(encoded) % 8)
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        self._handle = handle
        self._index = 0
        self._written = 0

    def write(self, data) -> None:
        """Append bytes of the current tensor (moving on to the next once it is full)."""
        view = memoryview(data).cast("B")
        while view.nbytes:
            if self._index >= len(self._sizes):
                raise ValueError("more bytes than the layout holds")
            nbytes = self._sizes[self._index][1]
            piece = view[: nbytes - self._written]
            self._handle.write(piece)
            self._written += piece.nbytes
            view = view[piece.nbytes :]
            if self._written == nbytes:
                self._index, self._written = self._index + 1, 0

    def finish(self) -> None:
        while self._index < len(self._sizes) and self._sizes[self._index][1] == 0:
            self._index += 1
        if self._index != len(self._sizes):
            raise ValueError(f"{self._sizes[self._index][0]} is incomplete")


def tensor_view(tensor: torch.Tensor):
    """The raw little-endian bytes of a tensor, without copying a contiguous one."""
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


@contextlib.contextmanager
def atomic_file(target: Path) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success fsync it, rename it over `target`
    and fsync the directory, so `target` is always either the old file or the complete new one.
    On error the temporary file is removed."""
    descriptor, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(descriptor)
    temporary = Path(name)
    try:
        yield temporary
        temporary.chmod(0o644)
        _fsync_path(temporary)
        os.rename(temporary, target)
        _fsync_path(target.parent)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


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
