"""KVarN's chunked-prefill attention (kvarn/prefill.py) against the float64 reference
(kvarn/attention.py's attention_reference over the same bytes, each query at its own context)
on the CPU under Triton's interpreter, over caches built like the backend's
(tests/kvarn_cache.py: outlier data, every full tile stored by the store kernel, the sink and
the chunk's filling tiles in shuffled side slots, every byte outside the read plan poisoned)
with the output poisoned first.

Shapes: several requests of different context and chunk lengths in one launch (whole prompts,
chunks starting mid-tile and crossing tile boundaries, a chunk ending on one, a chunk of one
query); programs smaller than a tile's queries, so that one program's queries read different
filling blocks; grouped heads (2 per KV head), one query head per KV head, the 27B's 24 / 4 of
head_dim 256; sinks evicted from the side cache (read quantized) beside one in 16 bits; bf16 and
fp16; a pool past 2^32 bytes; tiles of 3-bit values (KVARN_V_BITS=3) at a small shape. Under the
interpreter the dots' operands are fp32 (decode.dot_operands) and bf16 output conversion
truncates, so the bounds are test_kvarn_decode.py's; tests/test_kvarn_gpu.py checks the 16-bit
operands at long contexts.
"""

from __future__ import annotations

import pytest
import torch
from kvarn_cache import T, build_cache, moved_past_2_32_bytes
from triton_bf16_dots import bf16_dots  # noqa: F401 (a fixture)

from hyperqwen.bench.kernels import relative_error
from hyperqwen.kvarn.decode import decode_attention
from hyperqwen.kvarn.prefill import prefill_attention, work_items

pytestmark = pytest.mark.usefixtures("interpreted")
BOUND = {torch.bfloat16: 8e-3, torch.float16: 1e-3}  # test_kvarn_decode.py's
BOUND_16_BIT_OPERANDS = 5e-2  # tests/test_kvarn_gpu.py's PREFILL_BOUND_32K (why: there)


def run(cache, **changes):
    args = cache.kernel_args() | changes
    args.pop("max_query_len")
    query = args.pop("query", cache.query)
    out = torch.full_like(query, float("nan"))
    assert prefill_attention(query, **args, out=out) is out
    return out


def assert_matches_float64(cache, out):
    assert not out.isnan().any()
    expected = cache.expected()
    dtype = cache.query.dtype
    errors = [relative_error(out[row], expected[row]) for row in range(out.shape[0])]
    worst = max(range(len(errors)), key=errors.__getitem__)
    assert errors[worst] < BOUND[dtype], (worst, errors[worst])


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "heads", "kv_heads", "d", "dtype", "rows", "evicted"),
    [
        # a whole prompt of 2 tiles and a bit; a chunk from mid tile 2 into tile 3; a chunk
        # ending on a tile boundary; one query; programs of 8 queries (rows 16, 2 heads each),
        # so programs straddle tile boundaries; the last chunk's programs 0 and 16 start at
        # contexts 127 and 255, their first query filling the tile before the others'
        ([2 * T + 44, 3 * T + 40, 2 * T, T + 5, 276], [2 * T + 44, 150, 70, 1, 150],
         4, 2, 64, torch.bfloat16, 16, ()),
        # one query head per KV head, fp16, the default program size (64 queries)
        ([4 * T + 3, 150], [3 * T, 150], 2, 2, 32, torch.float16, 64, ()),
        # sinks evicted (read quantized) in the first two, in 16 bits in the third; the
        # second's chunk ends on a tile boundary
        ([3 * T + 5, 3 * T, 2 * T + 9], [200, 129, 2 * T + 9], 4, 2, 64, torch.bfloat16, 32,
         (0, 1)),
    ],
)  # fmt: skip
def test_prefill_matches_float64(seq_lens, query_lens, heads, kv_heads, d, dtype, rows, evicted):
    cache = build_cache(
        seq_lens, query_lens, heads, kv_heads, d, seed=len(seq_lens) + d + rows, dtype=dtype,
        evicted_sinks=evicted,
    )  # fmt: skip
    assert_matches_float64(cache, run(cache, rows=rows))


def test_3_bit_values_prefill_as_float64():
    """Tiles of 3-bit values: a chunk after 2 tiles with its sink evicted (tiles 0 and 1 read
    quantized), beside a whole prompt past its sink."""
    cache = build_cache([2 * T + 30, T + 20], [90, T + 20], 4, 2, 64, seed=23,
                        evicted_sinks=(0,), v_bits=3)  # fmt: skip
    assert_matches_float64(cache, run(cache, rows=32))


@pytest.mark.parametrize("evicted", [(), (0,)])
def test_prefill_at_27b_heads(evicted):
    """24 query / 4 KV heads of 256: 6 heads per KV head, 10 queries per program (64 rows,
    4 unused); a chunk crossing from tile 1 into tile 2 beside a whole prompt inside the
    sink."""
    cache = build_cache([2 * T + 20, 40], [3 * T // 4, 40], 24, 4, 256, seed=27,
                        evicted_sinks=evicted)  # fmt: skip
    assert_matches_float64(cache, run(cache))


def test_each_row_is_what_a_decode_step_at_its_context_returns():
    """Prefill's rows against the decode kernel's, each query decoded alone at its own
    context over the same cache (a sink in 16 bits, one evicted): the same bytes through the
    same tile loops, so the outputs differ only by the order of the fp32 sums (one online
    softmax against decode's partitions), then bf16. tests/test_kvarn_gpu.py compares the
    two with 16-bit operands at 32k tokens."""
    cache = build_cache([2 * T + 30, 2 * T + 9], [60, 20], 4, 2, 64, seed=12,
                        evicted_sinks=(1,))  # fmt: skip
    prefilled = run(cache, rows=16)
    steps = cache.decode_steps(list(range(cache.query.shape[0])))
    decoded = torch.full_like(steps["query"], float("nan"))
    decode_attention(steps.pop("query"), **steps, num_splits=2, out=decoded)
    assert not decoded.isnan().any()
    for row in range(prefilled.shape[0]):
        assert torch.allclose(prefilled[row].float(), decoded[row].float(), rtol=2**-7,
                              atol=1e-3), row  # fmt: skip


@pytest.mark.usefixtures("bf16_dots")
def test_with_16_bit_operands_a_rows_error_is_the_decode_steps():
    """With the GPU's bf16 dot operands (tests/triton_bf16_dots.py) both kernels round the
    same operands (the query times each tile's key scales, the weights times the value
    scales, the weights of the 16-bit tiles): prefill's only difference is the running
    maximum its weights are taken against (one online softmax, not decode's partitions), so
    a row equals the decode step's on the same query and context to within two bf16
    roundings (2^-8: each kernel rounds its own weights and its own output). The 27B's 6
    query heads per KV head, 4 tiles back. tests/test_kvarn_gpu.py checks the same at 32k
    tokens on the GPU."""
    cache = build_cache([4 * T + 5], [5], 6, 1, 256, seed=93)
    prefilled = run(cache)
    steps = cache.decode_steps(list(range(5)))
    decoded = torch.full_like(steps["query"], float("nan"))
    decode_attention(steps.pop("query"), **steps, num_splits=2, out=decoded)
    for row, want in enumerate(cache.expected()):
        prefill_error = relative_error(prefilled[row], want)
        decode_error = relative_error(decoded[row], want)
        apart = relative_error(prefilled[row], decoded[row].double())
        assert apart < 2**-8, (row, apart, prefill_error, decode_error)
        assert max(prefill_error, decode_error) < BOUND_16_BIT_OPERANDS, row


def test_every_query_is_one_programs_and_long_contexts_go_first():
    items = work_items([0, 5, 5, 25], [105, 7, 30], 8)
    # last contexts 105, 30, 26, 18; request 1 has no queries
    assert items == [(0, 0), (2, 16), (2, 8), (2, 0)]


def test_a_block_past_2_32_bytes_is_read_in_int64():
    """A pool of 4 GiB reserved, not touched (as the other kvarn tests'): the request's
    block 1, read quantized by the chunk's later queries, is moved to a block a few KB past
    2^32 bytes, where an int32 offset wraps into the poisoned first blocks. The output must
    equal the same cache's from the small pool."""
    cache = build_cache([2 * T + 30], [60], 2, 1, 256, seed=9)
    want = run(cache)
    assert not want.isnan().any()
    # the chunk's first queries read block 1 in 16 bits: its slot moves with it
    got = run(cache, **moved_past_2_32_bytes(cache))
    assert torch.equal(got, want)


def test_only_the_requests_rows_are_written():
    """Rows outside every request (the backend's decode rows come first) keep their value."""
    cache = build_cache([T + 20, 2 * T + 1], [30, 50], 4, 2, 32, seed=3)
    shifted = torch.cat([cache.query[:2] * 0 + 7, cache.query])  # 2 rows before the requests
    args = cache.kernel_args()
    args.pop("max_query_len")
    args["query_start_loc"] = cache.query_start_loc + 2
    out = torch.full_like(shifted, float("nan"))
    out[:2] = 5.0
    prefill_attention(shifted, **args, out=out)
    assert (out[:2] == 5.0).all()
    assert torch.equal(out[2:], run(cache))


def test_the_launcher_refuses_what_it_cannot_take():
    cache = build_cache([T + 3], [4], 4, 2, 32, seed=1)
    with pytest.raises(ValueError, match=r"query must be a 3-D bfloat16 or float16 tensor"):
        run(cache, query=cache.query.float())
    with pytest.raises(ValueError, match="query heads must be a multiple of KV heads"):
        run(cache, query=cache.query[:, :3].contiguous())
    with pytest.raises(ValueError, match=r"slot_of_block must be a 1-D int32 tensor"):
        run(cache, slot_of_block=cache.slot_of_block.long())
    with pytest.raises(ValueError, match=r"rows=24: a power of two >= 16"):
        run(cache, rows=24)
    with pytest.raises(ValueError, match="request 0: 4 queries of 3 tokens"):
        run(cache, seq_lens=torch.tensor([3], dtype=torch.int32))
