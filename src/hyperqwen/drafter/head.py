"""The draft head: the rows of the prepared lm_head for the draft vocabulary's token ids.

Written as its own safetensors file beside the checkpoint (loaders read only the files the
index names, so stock vLLM never sees it): `draft_head.token_ids` (int64 [N], sorted) and the
lm_head's stored tensors cut to those rows (`draft_head.weight_packed`/`weight_scale` with
`weight_shape` = [N, hidden] for an int8 lm_head, `draft_head.weight` for a bf16 one). Rows are
copied, never requantized: each row of a group-quantized lm_head carries its own scales, so the
draft head scores exactly what the full head scores for those tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from hyperqwen.checkpoint import shards

PREFIX = "draft_head"
SOURCE_MODULE = "lm_head"
FINGERPRINT_KEY = "hyperqwen_fingerprint"
BLOCK_ROWS = 16_384


def lm_head_tensors(weight_map: dict[str, str]) -> dict[str, str]:
    """Stored lm_head tensors (suffix -> shard file) of a checkpoint's weight map."""
    return {
        name.removeprefix(f"{SOURCE_MODULE}."): shard
        for name, shard in weight_map.items()
        if name.startswith(f"{SOURCE_MODULE}.")
    }


def row_tensors(weight_map: dict[str, str]) -> int:
    """How many stored lm_head tensors are cut row by row (all but weight_shape)."""
    return sum(suffix != "weight_shape" for suffix in lm_head_tensors(weight_map))


def fingerprint(vocabulary: Sequence[int], weight_map: dict[str, str]) -> str:
    """Names what the head is cut from: the ids and the lm_head's shard files (prepare names
    rewritten shards by their content, so a new lm_head means new names)."""
    return hashlib.sha256(
        json.dumps([list(vocabulary), sorted(lm_head_tensors(weight_map).items())]).encode()
    ).hexdigest()


def is_current(path: Path, expected_fingerprint: str) -> bool:
    try:
        header = shards.read_header(path)
    except (OSError, shards.ShardFileError):
        return False
    return header.metadata.get(FINGERPRINT_KEY) == expected_fingerprint


def write_head(
    handle,
    model_dir: Path,
    weight_map: dict[str, str],
    vocabulary: Sequence[int],
    progress: Callable[[int], None],
) -> None:
    """Stream the head into the open file `handle`, a block of lm_head rows at a time."""
    sources = lm_head_tensors(weight_map)
    headers = {suffix: shards.read_header(model_dir / shard) for suffix, shard in sources.items()}
    entries = {suffix: headers[suffix].tensors[f"{SOURCE_MODULE}.{suffix}"] for suffix in sources}
    if "weight_shape" in sources:
        with safe_open(model_dir / sources["weight_shape"], framework="pt") as source:
            vocab_size, hidden = source.get_tensor(f"{SOURCE_MODULE}.weight_shape").tolist()
    else:
        vocab_size, hidden = entries["weight"].shape
    ids = torch.tensor(list(vocabulary), dtype=torch.int64)
    layout = [(f"{PREFIX}.token_ids", "I64", (len(ids),))]
    for suffix, entry in entries.items():
        shape = entry.shape if suffix == "weight_shape" else (len(ids), *entry.shape[1:])
        layout.append((f"{PREFIX}.{suffix}", entry.dtype, shape))
    layout.sort(key=lambda item: -shards.DTYPE_SIZES[item[1]])
    writer = shards.StreamingShard(
        handle, layout, {"format": "pt", FINGERPRINT_KEY: fingerprint(vocabulary, weight_map)}
    )
    for name, _, _ in layout:
        suffix = name.removeprefix(f"{PREFIX}.")
        if suffix == "token_ids":
            writer.write(shards.tensor_view(ids))
        elif suffix == "weight_shape":
            writer.write(shards.tensor_view(torch.tensor([len(ids), hidden])))
        else:
            path, entry = model_dir / sources[suffix], entries[suffix]
            for start in range(0, vocab_size, BLOCK_ROWS):
                wanted = ids[(ids >= start) & (ids < start + BLOCK_ROWS)] - start
                if len(wanted):
                    block = shards.read_rows(path, entry, start, start + BLOCK_ROWS)
                    writer.write(shards.tensor_view(block[wanted]))
                progress(len(wanted))
    writer.finish()
