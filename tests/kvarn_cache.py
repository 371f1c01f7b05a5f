"""A paged KVarN cache built the way the backend keeps it, for the decode kernel's tests:
requests of random outlier K and V (tests/kvarn_data.py), every full block (the sink
included) stored by the Triton store kernel into shuffled pool blocks, 16-bit copies of the
sink (unless evicted) and of the blocks its queries read in 16 bits in shuffled side slots
named by `slot_of_block`. Everything the read plan must not touch is poison: pool blocks full
of 0xFF bytes (NaN scales; the partial filling blocks too), a side slot of NaN that every
block without a 16-bit read maps to (as a tile filled last step still holds its slot), side
tokens past seq_len NaN, table entries past a request's blocks naming a poisoned block. The
float64 expectation comes from attention.py's `attention_reference` over the same bytes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
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
    slot_of_block: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    layout: TileLayout
    evicted_sinks: frozenset[int] = frozenset()  # requests whose sink is read quantized

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())

    def kernel_args(self) -> dict:
        return {name: getattr(self, name) for name in (
            "pool", "block_table", "side_k", "side_v", "slot_of_block", "seq_lens",
            "query_start_loc", "max_query_len", "layout")}  # fmt: skip

    def contexts(self, req: int) -> list[int]:
        """L_j of each query of request req."""
        n = int(self.query_start_loc[req + 1] - self.query_start_loc[req])
        seq_len = int(self.seq_lens[req])
        return [seq_len - n + j + 1 for j in range(n)]

    def decode_steps(self, rows: list[int]) -> dict:
        """Decode kernel arguments (query included) for each of `rows` as a decode step of
        its own at its own context over this cache: one request per row, reading its
        request's block table, side slots and pool."""
        starts = self.query_start_loc.tolist()
        reqs = [max(r for r in range(len(starts) - 1) if starts[r] <= row) for row in rows]
        contexts = [self.contexts(r)[row - starts[r]] for r, row in zip(reqs, rows, strict=True)]
        device = self.query.device
        return self.kernel_args() | {
            "query": self.query[rows].contiguous(),
            "block_table": self.block_table[reqs].contiguous(),
            "seq_lens": torch.tensor(contexts, dtype=torch.int32, device=device),
            "query_start_loc": torch.arange(len(rows) + 1, dtype=torch.int32, device=device),
            "max_query_len": 1,
        }

    def expected(self, rows: list[int] | None = None) -> torch.Tensor:
        """Float64 [num_tokens, Hq, D] (or [len(rows), Hq, D]: only those query rows, for
        contexts too long to take every one): each query by attention_reference at its own
        length."""
        wanted = None if rows is None else set(rows)
        rows = []
        for req, (key, value) in enumerate(zip(self.keys, self.values, strict=True)):
            start = int(self.query_start_loc[req])
            for j, context in enumerate(self.contexts(req)):
                if wanted is not None and start + j not in wanted:
                    continue
                filling = max(T, context // T * T)
                sink = (key[: min(context, T)], value[: min(context, T)])
                rows.append(
                    attention_reference(
                        self.query[start + j], self.pool, self.block_table[req],
                        None if req in self.evicted_sinks else sink,
                        (key[filling:context], value[filling:context]), context, self.layout,
                    )
                )  # fmt: skip
        return torch.stack(rows)


def build_cache(seq_lens, query_lens, heads, kv_heads, d, seed, dtype=torch.bfloat16,
                device="cpu", pool_blocks=None, evicted_sinks=(), v_bits=2) -> Cache:  # fmt: skip
    """A cache of len(seq_lens) requests, query_lens[r] queries each, on `device`, its tiles
    of `v_bits`-bit values; the requests in evicted_sinks have no 16-bit sink (their first
    query's context must hold the whole sink). With pool_blocks, the pool has that many blocks
    and the last holds a tile a quantized program reads (the int64 tests' large pools)."""
    layout = TileLayout(head_dim=d, v_bits=v_bits)
    g = torch.Generator().manual_seed(seed)
    keys = [outlier_keys(n, kv_heads, d, seed + 2 * i) for i, n in enumerate(seq_lens)]
    values = [outlier_values(n, kv_heads, d, seed + 2 * i + 1) for i, n in enumerate(seq_lens)]
    for r in evicted_sinks:
        if seq_lens[r] - query_lens[r] + 1 < T:
            raise ValueError(f"request {r}'s sink is still filling: it cannot be evicted")
    width = max(-(-n // T) for n in seq_lens) + 1  # one poisoned column past every request
    # every block position a request has; the quantized-read ones first, so that the last
    # pool block goes to one of them
    positions = sorted(
        ((r, b) for r, n in enumerate(seq_lens) for b in range(-(-n // T))),
        key=lambda rb: not 1 <= rb[1] < seq_lens[rb[0]] // T,
    )
    sixteen = [(r, b) for r, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True))
               for b in ((() if r in evicted_sinks else (0,))
                         + tuple(range(max((n - q + 1) // T, 1), (n - 1) // T + 1)))]  # fmt: skip

    blocks = pool_blocks or len(positions) + 2
    pool = torch.full(layout.pool_shape(blocks, kv_heads), POISON_BYTE, dtype=torch.uint8,
                      device=device)  # fmt: skip
    order = [blocks - 1, *torch.randperm(blocks - 1, generator=g)[: len(positions)].tolist()]
    spare_block = order[-1]  # the entry after the last position's: never stored
    block_table = torch.full((len(seq_lens), width), spare_block, dtype=torch.int32)
    for (r, b), block in zip(positions, order, strict=False):
        block_table[r, b] = block
    for r, n in enumerate(seq_lens):
        if n >= T:
            tiles = [x[: n // T * T].reshape(-1, T, kv_heads, d).to(device)
                     for x in (keys[r], values[r])]  # fmt: skip
            store_tiles(*tiles, pool, block_table[r, : n // T].to(device), layout)

    side_shape = (len(sixteen) + 1, T, kv_heads, d)
    side_k = torch.full(side_shape, float("nan"), dtype=dtype)
    side_v = torch.full(side_shape, float("nan"), dtype=dtype)
    side_order = torch.randperm(len(sixteen) + 1, generator=g).tolist()
    slot_of_block = torch.full((blocks,), side_order[-1], dtype=torch.int32)  # the NaN slot
    for r in evicted_sinks:
        slot_of_block[block_table[r, 0]] = -1
    for (r, b), side in zip(sixteen, side_order, strict=False):
        slot_of_block[block_table[r, b]] = side
        present = keys[r][b * T : (b + 1) * T].shape[0]
        side_k[side, :present] = keys[r][b * T : b * T + present].to(dtype)
        side_v[side, :present] = values[r][b * T : b * T + present].to(dtype)

    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), heads, d, generator=g, dtype=torch.float64) * 2
    return Cache(
        keys=[k.to(device) for k in keys], values=[v.to(device) for v in values],
        query=query.to(device, dtype), pool=pool, block_table=block_table.to(device),
        side_k=side_k.to(device), side_v=side_v.to(device),
        slot_of_block=slot_of_block.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=starts.to(device), layout=layout, evicted_sinks=frozenset(evicted_sinks),
    )  # fmt: skip


def moved_past_2_32_bytes(cache: Cache, index: int = 1) -> dict[str, torch.Tensor]:
    """Kernel arguments (pool, block_table, slot_of_block) reading request 0's block `index` from
    a block a few KB past 2^32 bytes of a 4 GiB pool, reserved and not touched, where an int32
    offset wraps into the small pool's blocks, poisoned; its side slot moves with it. Skips
    where the machine refuses to reserve the address space."""
    blocks = 2**32 // cache.layout.tile_bytes + 2
    try:
        big = torch.empty(cache.layout.pool_shape(blocks, 1), dtype=torch.uint8)
    except RuntimeError as refused:
        pytest.skip(f"this machine refuses to reserve 4 GiB of address space: {refused}")
    small_blocks = cache.pool.shape[0]
    big[:small_blocks] = 0xFF
    moved = int(cache.block_table[0, index])
    big[blocks - 1] = cache.pool[moved]
    table = cache.block_table.clone()
    table[0, index] = blocks - 1
    slot_of_block = torch.full((blocks,), -1, dtype=torch.int32)
    slot_of_block[:small_blocks] = cache.slot_of_block
    slot_of_block[blocks - 1] = cache.slot_of_block[moved]
    return {"pool": big, "block_table": table, "slot_of_block": slot_of_block}
