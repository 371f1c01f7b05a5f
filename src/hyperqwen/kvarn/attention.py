"""Which parts of a sequence KVarN reads from where, and a float64 attention over them.

`read_plan(context_len)` is the rule every KVarN reader follows (the fused decode kernel and
the verify path of speculative decoding): the first 128 tokens (the attention sink, block 0)
are read in 16 bits; blocks 1 .. n-1 of the n = context_len // 128 full blocks from the
pool's quantized tiles; the tokens after the last full block (the newest, still-filling tile)
in 16 bits. With `sink_quantized` (a full sink whose 16-bit copy the side cache has evicted,
slots.py) block 0 comes from its quantized tile too. A block is quantized exactly when it is
full, so a query's plan depends on its own context length only: the k + 1 queries of a
verify step must read what k + 1 decode steps at those lengths would, including a step whose
drafts fill a block. For that the backend quantizes a tile in the step that writes its last
token, keeps its 16-bit copy until the sequence's accepted length has passed it, and
quantizes it again when a rejected draft's position in it is rewritten and the tile is full
again.

`blocks_to_store(before, after)` is the write side of the same rule: the block positions a step
that takes a sequence from `before` to `after` tokens fills, whose tiles it quantizes in that
step (from their 16-bit copies, into the blocks the request's block table names then). Block
0 is stored too: the pool stays complete, so a sink whose 16-bit copy is gone is still read
(quantized). A step that fills no block stores nothing, so a request freed with a partial
tile leaves no write behind that could land in its recycled page.

`attention_reference` is one query token's GQA attention computed in float64 from those three
sources; `exact_attention` the same from the unquantized K and V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hyperqwen.kvarn.layout import TILE_TOKENS, TileLayout
from hyperqwen.kvarn.packing import unpack_tile
from hyperqwen.kvarn.quantize import dequantize_tile


@dataclass(frozen=True)
class ReadPlan:
    sink_tokens: int  # tokens [0, sink_tokens) from the 16-bit sink tile
    quantized_blocks: range  # positions in the block table read from the pool
    filling_tokens: range  # token positions from the 16-bit filling tile


def read_plan(context_len: int, tile: int = TILE_TOKENS, sink_quantized: bool = False) -> ReadPlan:
    if context_len < 1:
        raise ValueError(f"context_len={context_len}: a query attends to at least itself")
    full = context_len // tile
    if sink_quantized and full < 1:
        raise ValueError(
            f"context_len={context_len}: the sink is still filling, it has no quantized tile"
        )
    return ReadPlan(
        sink_tokens=0 if sink_quantized else min(context_len, tile),
        quantized_blocks=range(0 if sink_quantized else 1, full),
        filling_tokens=range(max(tile, full * tile), context_len),
    )


def blocks_to_store(before: int, after: int, tile: int = TILE_TOKENS) -> range:
    if not 0 <= before <= after:
        raise ValueError(f"a step goes from {before} to {after} tokens: not 0 <= before <= after")
    return range(before // tile, after // tile)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """q [Hq, D], k and v [L, Hkv, D], all float64 -> [Hq, D]; query head h reads KV head
    h // (Hq / Hkv)."""
    heads, kv_heads = q.shape[0], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("hd,lhd->hl", q, k) * (scale or 1 / math.sqrt(q.shape[1]))
    return torch.einsum("hl,lhd->hd", scores.softmax(dim=1), v)


def exact_attention(q, key, value, scale: float | None = None) -> torch.Tensor:
    """Float64 attention of q [Hq, D] over key and value [L, Hkv, D] as given."""
    return _attend(q.double(), key.double(), value.double(), scale)


def attention_reference(
    q: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    sink: tuple[torch.Tensor, torch.Tensor] | None,
    filling: tuple[torch.Tensor, torch.Tensor],
    context_len: int,
    layout: TileLayout | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Float64 attention of one query q [Hq, D] over a KVarN sequence of context_len tokens:
    sink = (K, V) of its first min(context_len, 128) tokens and filling = (K, V) of the
    tokens after its last full block, each [tokens, Hkv, D] in 16 bits; its full blocks from
    1 on in pool[block_table[j]] (layout.py). sink=None reads block 0 from the pool too (an
    evicted sink: read_plan's sink_quantized)."""
    layout = layout or TileLayout(head_dim=q.shape[-1])
    plan = read_plan(context_len, layout.tokens, sink_quantized=sink is None)
    empty = q.new_empty(0, pool.shape[1], q.shape[-1])
    sink = sink if sink is not None else (empty, empty)
    for name, part, tokens in (
        ("sink", sink, plan.sink_tokens),
        ("filling", filling, len(plan.filling_tokens)),
    ):
        if part[0].shape[0] != tokens or part[1].shape[0] != tokens:
            got = f"{part[0].shape[0]} keys and {part[1].shape[0]} values"
            raise ValueError(
                f"{name} must hold {tokens} tokens at context_len {context_len}; {got}"
            )
    keys, values = [sink[0].double()], [sink[1].double()]
    for position in plan.quantized_blocks:
        tiles = [
            unpack_tile(pool[int(block_table[position]), head], layout)
            for head in range(pool.shape[1])
        ]
        decoded = [dequantize_tile(tile) for tile in tiles]
        keys.append(torch.stack([k for k, _ in decoded], dim=1))
        values.append(torch.stack([v for _, v in decoded], dim=1))
    keys.append(filling[0].double())
    values.append(filling[1].double())
    return _attend(q.double(), torch.cat(keys), torch.cat(values), scale)
