"""A paged KVarN cache built the way the backend will keep it, for the decode kernel's tests:
requests of random outlier K and V (tests/kvarn_data.py), their full blocks 1 .. F - 1 stored
by the Triton store kernel into shuffled pool blocks, 16-bit copies of the sink and of the
blocks its queries read in 16 bits in shuffled side blocks. Everything the read plan must not
touch is poison: pool blocks full of 0xFF bytes (NaN scales), side blocks and side tokens past
seq_len NaN, table entries past a request's blocks naming poisoned blocks. The float64
expectation comes from attention.py's `attention_reference` over the same bytes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvarn_data import outlier_keys, outlier_values

from hyperqwen.kvarn.attention import attention_reference
from hyperqwen.kvarn.layout import TileLayout
from hyperqwen.kvarn.store import store_tiles

T = 128
POISON_BYTE = 0xFF


@dataclass
class Cache:
    keys: list[torch.Tensor]  # per request [seq_len, Hkv, D], bf16
    values: list[torch.Tensor]
    query: torch.Tensor  # [num_tokens, Hq, D]
    pool: torch.Tensor
    block_table: torch.Tensor
    side_k: torch.Tensor
    side_v: torch.Tensor
    side_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    layout: TileLayout

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())

    def kernel_args(self) -> dict:
        return {name: getattr(self, name) for name in (
            "pool", "block_table", "side_k", "side_v", "side_table", "seq_lens",
            "query_start_loc", "max_query_len", "layout")}  # fmt: skip

    def contexts(self, req: int) -> list[int]:
        """L_j of each query of request req."""
        n = int(self.query_start_loc[req + 1] - self.query_start_loc[req])
        seq_len = int(self.seq_lens[req])
        return [seq_len - n + j + 1 for j in range(n)]

    def expected(self) -> torch.Tensor:
        """Float64 [num_tokens, Hq, D]: each query by attention_reference at its own length."""
        rows = []
        for req, (key, value) in enumerate(zip(self.keys, self.values, strict=True)):
            start = int(self.query_start_loc[req])
            for j, context in enumerate(self.contexts(req)):
                filling = max(T, context // T * T)
                rows.append(
                    attention_reference(
                        self.query[start + j], self.pool, self.block_table[req],
                        (key[: min(context, T)], value[: min(context, T)]),
                        (key[filling:context], value[filling:context]), context, self.layout,
                    )
                )  # fmt: skip
        return torch.stack(rows)


def build_cache(seq_lens, query_lens, heads, kv_heads, d, seed, dtype=torch.bfloat16,
                device="cpu", pool_blocks=None) -> Cache:  # fmt: skip
    """A cache of len(seq_lens) requests, query_lens[r] queries each, on `device`. With
    pool_blocks, the pool has that many blocks and the last holds a request's tile (the int64
    tests' large pools)."""
    layout = TileLayout(head_dim=d)
    g = torch.Generator().manual_seed(seed)
    keys = [outlier_keys(n, kv_heads, d, seed + 2 * i) for i, n in enumerate(seq_lens)]
    values = [outlier_values(n, kv_heads, d, seed + 2 * i + 1) for i, n in enumerate(seq_lens)]
    width = max(-(-n // T) for n in seq_lens) + 1  # one poisoned column past every request
    quantized = [(r, b) for r, n in enumerate(seq_lens) for b in range(1, n // T)]
    sixteen = [(r, b) for r, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True))
               for b in (0, *range(max((n - q + 1) // T, 1), (n - 1) // T + 1))]  # fmt: skip

    blocks = pool_blocks or len(quantized) + 2
    pool = torch.full(layout.pool_shape(blocks, kv_heads), POISON_BYTE, dtype=torch.uint8,
                      device=device)  # fmt: skip
    # the pool's last block holds the first tile; the entry after the last tile's is unused
    order = [blocks - 1, *torch.randperm(blocks - 1, generator=g)[: len(quantized)].tolist()]
    spare_block = order[-1]
    block_table = torch.full((len(seq_lens), width), spare_block, dtype=torch.int32)
    for (r, b), block in zip(quantized, order, strict=False):
        block_table[r, b] = block
    for r, n in enumerate(seq_lens):
        full = [b for rr, b in quantized if rr == r]
        if full:
            tiles = [
                x[T : n // T * T].reshape(-1, T, kv_heads, d).to(device)
                for x in (keys[r], values[r])
            ]
            store_tiles(*tiles, pool, block_table[r, full].to(device), layout)

    side_shape = (len(sixteen) + 1, T, kv_heads, d)
    side_k = torch.full(side_shape, float("nan"), dtype=dtype)
    side_v = torch.full(side_shape, float("nan"), dtype=dtype)
    side_order = torch.randperm(len(sixteen) + 1, generator=g).tolist()
    side_table = torch.full((len(seq_lens), width), side_order[-1], dtype=torch.int32)
    for (r, b), side in zip(sixteen, side_order, strict=False):
        side_table[r, b] = side
        present = keys[r][b * T : (b + 1) * T].shape[0]
        side_k[side, :present] = keys[r][b * T : b * T + present].to(dtype)
        side_v[side, :present] = values[r][b * T : b * T + present].to(dtype)

    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), heads, d, generator=g, dtype=torch.float64) * 2
    return Cache(
        keys=[k.to(device) for k in keys], values=[v.to(device) for v in values],
        query=query.to(device, dtype), pool=pool, block_table=block_table.to(device),
        side_k=side_k.to(device), side_v=side_v.to(device), side_table=side_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=starts.to(device), layout=layout,
    )  # fmt: skip
