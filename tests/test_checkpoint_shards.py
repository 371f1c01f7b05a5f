"""Sharded safetensors files and the atomic publish of a checkpoint directory."""

import json

import pytest
import torch
from safetensors import safe_open

from hyperqwen.checkpoint import shards


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GB", 2 * 10**9), ("500MB", 5 * 10**8), ("1.5GiB", 3 * 2**29), ("4096", 4096)],
)
def test_parse_size(text, expected):
    assert shards.parse_size(text) == expected


@pytest.mark.parametrize("text", ["two GB", "2XB", "0GB", ""])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(ValueError, match="size"):
        shards.parse_size(text)


def test_plan_shards_keeps_order_and_isolates_oversized_items():
    sizes = [40, 40, 30, 250, 10, 10]
    plan = shards.plan_shards(sizes, lambda size: size, max_bytes=100)
    assert plan == [[40, 40], [30], [250], [10, 10]]


def test_written_shards_read_back_through_the_index(tmp_path):
    tensors = {
        "a.weight": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "b.weight_packed": torch.arange(4, dtype=torch.int32),
    }
    shards.write_shard(tmp_path / shards.shard_name(0, 1), tensors)
    shards.write_index(tmp_path, dict.fromkeys(tensors, shards.shard_name(0, 1)), 20)
    with safe_open(tmp_path / "model-00001-of-00001.safetensors", framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    index = json.loads((tmp_path / shards.INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 20
    reader = shards.ShardedReader(tmp_path)
    assert sorted(reader) == sorted(tensors)
    assert reader.shard_files() == ["model-00001-of-00001.safetensors"]
    for name, tensor in tensors.items():
        assert torch.equal(reader[name], tensor)


def test_atomic_directory_publishes_only_complete_work(tmp_path):
    target = tmp_path / "ckpt"
    with shards.atomic_directory(target, force=False) as staging:
        (staging / "config.json").write_text("{}")
        assert not target.exists()  # nothing visible until the block completes
    assert (target / "config.json").read_text() == "{}"
    assert oct(target.stat().st_mode & 0o777) == "0o755"
    assert oct((target / "config.json").stat().st_mode & 0o777) == "0o644"

    with pytest.raises(RuntimeError), shards.atomic_directory(target, force=True) as staging:
        (staging / "config.json").write_text('{"half": true}')
        raise RuntimeError("crash mid-write")
    assert (target / "config.json").read_text() == "{}"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]  # staging cleaned up


def test_atomic_directory_refuses_to_overwrite_without_force(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "old.txt").write_text("keep me")
    with (
        pytest.raises(FileExistsError, match="--force"),
        shards.atomic_directory(target, force=False),
    ):
        pass
    assert (target / "old.txt").read_text() == "keep me"

    with shards.atomic_directory(target, force=True) as staging:
        (staging / "new.txt").write_text("replaced")
    assert sorted(path.name for path in target.iterdir()) == ["new.txt"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]


def test_atomic_directory_accepts_an_existing_empty_directory(tmp_path):
    target = tmp_path / "empty"
    target.mkdir()
    with shards.atomic_directory(target, force=False) as staging:
        (staging / "x").write_text("1")
    assert (target / "x").exists()
