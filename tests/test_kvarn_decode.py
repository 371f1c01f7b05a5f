"""KVarN's fused split-K decode attention (kvarn/decode.py) against the float64 reference
(kvarn/attention.py's attention_reference over the same bytes) on the CPU under Triton's
interpreter: outlier data, caches built like the backend's (tests/kvarn_cache.py) with every
byte outside the read plan poisoned and the output poisoned first.

Shapes: grouped heads (2 query heads per KV head), one query head per KV head, the 27B's 24 / 4
heads of head_dim 256; plain decodes and verify blocks of 2 and 4 queries, one crossing a tile
boundary; contexts inside the sink, ending on a tile boundary, with and without a filling tile;
splits sharing the quantized blocks unevenly and splits left empty; sinks evicted from the side
cache (read quantized), also where no 16-bit token is left to read; bf16 and fp16; a pool past
2^32 bytes; tiles of 3-bit values (KVARN_V_BITS=3) at a small shape. Under the interpreter the
dots' operands are fp32 (decode.dot_operands says why) and its bf16 output conversion truncates:
the bounds below are that truncation (2^-8 per element) and fp32 sums; tests/test_kvarn_gpu.py
checks the 16-bit operands on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from kvarn_cache import T, build_cache, moved_past_2_32_bytes

from hyperqwen.bench.kernels import relative_error
from hyperqwen.kvarn.decode import decode_attention

pytestmark = pytest.mark.usefixtures("interpreted")
# measured at most 4.5e-3 (bf16) and 2.7e-4 (fp16)
BOUND = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


def run(cache, num_splits, **changes):
    args = cache.kernel_args() | changes
    query = args.pop("query", cache.query)
    out = torch.full_like(query, float("nan"))
    assert decode_attention(query, **args, num_splits=num_splits, out=out) is out
    return out


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "heads", "kv_heads", "d", "dtype", "splits", "evicted"),
    [
        # sink only; a context of exactly one tile; 2 quantized blocks shared by 3 splits
        ([100, T, 3 * T + 5], [1, 1, 1], 4, 2, 64, torch.bfloat16, 3, ()),
        # one query head per KV head, the context ending on a tile boundary, fp16
        ([5 * T], [1], 2, 2, 32, torch.float16, 2, ()),
        # 27B heads; verify blocks: 4 queries crossing from block 2 into block 3, 2 inside one
        ([3 * T + 2, 2 * T + 50], [4, 2], 24, 4, 256, torch.bfloat16, 2, ()),
        # evicted sinks read quantized: beside one in 16 bits; alone on a tile boundary, where
        # the 16-bit program reads nothing at all; more splits than quantized blocks
        ([3 * T + 5, 2 * T + 7, 2 * T], [1, 1, 1], 4, 2, 64, torch.bfloat16, 4, (0, 2)),
        # 27B heads, a verify block crossing into block 2 with the sink evicted
        ([2 * T + 1, T + 9], [3, 1], 24, 4, 256, torch.bfloat16, 2, (0,)),
    ],
)  # fmt: skip
def test_decode_matches_float64(seq_lens, query_lens, heads, kv_heads, d, dtype, splits, evicted):
    cache = build_cache(
        seq_lens, query_lens, heads, kv_heads, d, seed=len(seq_lens) + d, dtype=dtype,
        evicted_sinks=evicted,
    )  # fmt: skip
    out = run(cache, splits)
    assert not out.isnan().any()
    expected = cache.expected()
    for row in range(out.shape[0]):
        assert relative_error(out[row], expected[row]) < BOUND[dtype], row


def test_3_bit_values_decode_as_float64():
    """Tiles of 3-bit values (dequant.v_codes' high plane): a verify block of 3 crossing into
    block 2 beside a plain decode, both sinks evicted (read quantized) in one and kept in the
    other, uneven splits; every unread byte poisoned as above."""
    cache = build_cache([2 * T + 1, 3 * T + 5], [3, 1], 4, 2, 64, seed=13, evicted_sinks=(0,),
                        v_bits=3)  # fmt: skip
    assert cache.pool.shape[-1] == cache.layout.tile_bytes and cache.layout.v_bits == 3
    out = run(cache, 3)
    assert not out.isnan().any()
    expected = cache.expected()
    for row in range(out.shape[0]):
        assert relative_error(out[row], expected[row]) < BOUND[torch.bfloat16], row


def test_a_verify_block_reads_what_decode_steps_at_its_lengths_read():
    """Each query of a 4-query verify block crossing a tile boundary, against the same query
    decoded alone at its own context length over the same cache (the later decode steps
    would find the drafts' tile stored and its 16-bit copy kept, as here)."""
    cache = build_cache([3 * T + 2], [4], 24, 4, 256, seed=5)
    verify = run(cache, 2)
    for j, context in enumerate(cache.contexts(0)):
        single = run(
            cache, 2, query=cache.query[j : j + 1], max_query_len=1,
            seq_lens=torch.tensor([context], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        )  # fmt: skip
        # the same sums in another order (other shares of the splits), then bf16
        assert torch.allclose(verify[j].float(), single[0].float(), rtol=2**-7, atol=1e-3), j


def test_a_block_past_2_32_bytes_is_read_in_int64():
    """A pool of 4 GiB reserved, not touched (as tests/test_kvarn_store.py's): the request's
    quantized block 1 is its last block, a few KB past 2^32 bytes, where an int32 offset
    wraps into the poisoned first blocks. The output must equal the same cache's from a
    small pool."""
    cache = build_cache([2 * T + 1], [1], 2, 1, 256, seed=9)
    want = run(cache, 1)
    got = run(cache, 1, **moved_past_2_32_bytes(cache))
    assert torch.equal(got, want)


def test_the_launcher_refuses_what_it_cannot_take():
    cache = build_cache([T + 3], [1], 4, 2, 32, seed=1)
    with pytest.raises(ValueError, match=r"query must be a 3-D bfloat16 or float16 tensor"):
        run(cache, 1, query=cache.query.float())
    with pytest.raises(ValueError, match="query heads must be a multiple of KV heads"):
        run(cache, 1, query=cache.query[:, :3].contiguous())
    with pytest.raises(ValueError, match=r"side_k must be a 4-D bfloat16 tensor"):
        run(cache, 1, side_k=cache.side_k.half())
    with pytest.raises(ValueError, match=r"block_table must be int32 \[1, max_blocks\]"):
        run(cache, 1, block_table=cache.block_table.expand(2, -1))
    with pytest.raises(ValueError, match=r"slot_of_block must be a 1-D int32 tensor"):
        run(cache, 1, slot_of_block=cache.slot_of_block.long())
    with pytest.raises(ValueError, match="1 <= max_query_len <= 128"):
        run(cache, 1, max_query_len=0)
    with pytest.raises(ValueError, match="num_splits=0"):
        run(cache, 0)
