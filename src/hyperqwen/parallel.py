"""Which tensor-parallel sizes a checkpoint can take, read from its config.json before vLLM starts.

vLLM shards every attention and Gated DeltaNet head group and every row-parallel input over the
GPUs; a size that does not divide them fails minutes into start-up, deep in a weight loader. The
rules checked here: query heads and both GDN head counts divide by the size; KV heads divide by
it or it by them (vLLM replicates KV heads past their count); each GPU's share of a quantized
row-parallel input (MLP down, attention and GDN output projections) is whole groups of the
quantization's group size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hyperqwen.checkpoint.geometry import text_config

MAX_GPUS = 8


def _group_size(config: Mapping[str, Any]) -> int | None:
    quantization = config.get("quantization_config") or text_config(config).get(
        "quantization_config"
    )
    sizes = [
        group["weights"]["group_size"]
        for group in ((quantization or {}).get("config_groups") or {}).values()
        if (group.get("weights") or {}).get("group_size")
    ]
    return min(sizes) if sizes else None


def tensor_parallel_problems(config: Mapping[str, Any], size: int) -> list[str]:
    """What keeps `size` GPUs from sharding this model (empty: it can)."""
    text = text_config(config)
    problems = []
    for key, label in (
        ("num_attention_heads", "query heads"),
        ("linear_num_key_heads", "GDN key heads"),
        ("linear_num_value_heads", "GDN value heads"),
    ):
        if (count := text.get(key)) and count % size:
            problems.append(f"{count} {label}")
    kv = text.get("num_key_value_heads")
    if kv and kv % size and size % kv:
        problems.append(f"{kv} KV heads")
    group = _group_size(config)
    heads, head_dim = text.get("num_attention_heads"), text.get("head_dim")
    gdn_heads, gdn_dim = text.get("linear_num_value_heads"), text.get("linear_value_head_dim")
    row_inputs = {
        "MLP down inputs": text.get("intermediate_size"),
        "attention output inputs": heads * head_dim if heads and head_dim else None,
        "GDN output inputs": gdn_heads * gdn_dim if gdn_heads and gdn_dim else None,
    }
    for label, width in row_inputs.items():
        if group and width and (width % size or (width // size) % group):
            problems.append(f"{width} {label} (quantized in groups of {group})")
    return problems


def workable_sizes(config: Mapping[str, Any]) -> list[int]:
    return [size for size in range(1, MAX_GPUS + 1) if not tensor_parallel_problems(config, size)]


def tensor_parallel_refusal(config: Mapping[str, Any], size: int, where: str) -> str | None:
    """The error for a size the model at `where` cannot take, naming the knobs and the fix."""
    problems = tensor_parallel_problems(config, size)
    if not problems:
        return None
    sizes = ", ".join(map(str, workable_sizes(config)))
    return (
        f"GPU_COUNT={size} with GPU_SPLIT=tp: the model in {where} cannot be split over {size} "
        f"GPUs: its {', '.join(problems)} do not divide by {size}. GPU_COUNT values that work "
        f"with tp: {sizes}; or set GPU_SPLIT=dp (one whole replica per GPU)."
    )
