"""KVarN's prefill by dequantization (kvarn/prefill_dequant.py) against the float64 reference
on the CPU, over the caches tests/test_kvarn_prefill.py builds (outlier data, every full tile
stored by the store kernel, sink and filling tiles in shuffled side slots, every byte outside
the read plan poisoned, the output poisoned first), with attend_torch as the attention (vLLM's
FlashAttention, its GPU attention, does not run here; tests/test_kvarn_gpu.py runs it).

In fp32 the read rule, the filling-tile groups, the scratch's segments (also a scratch of 2
tiles, so that contexts take several) and the log-sum-exp merges are checked to fp32's
error. In bf16, with the interpreter rounding as a GPU does (tests/triton_bf16_dots.py), its
error is bounded by the served kernel's (prefill.py with its bf16 dot operands) on the same
cache: the scratch rounds the dequantized values to bf16 where the kernel rounds the query
times the scales, and the test data's outliers make either rounding show. Tiles of 3-bit
values (KVARN_V_BITS=3) in fp32 at a small shape.
"""

from __future__ import annotations

import pytest
import torch
from kvarn_cache import T, build_cache
from test_kvarn_prefill import run
from triton_bf16_dots import bf16_dots  # noqa: F401 (a fixture)

from hyperqwen.bench.kernels import relative_error
from hyperqwen.kvarn import prefill_dequant
from hyperqwen.kvarn.prefill_dequant import (
    filling_groups,
    merge_into,
    plan_prefill,
    prefill_by_dequantization,
)

pytestmark = pytest.mark.usefixtures("interpreted")
FP32_BOUND = 1e-4

CASES = [
    # a whole prompt of 2 tiles and a bit; a chunk from mid tile 2 into tile 3; a chunk ending
    # on a tile boundary; one query; a chunk starting at a tile boundary's query
    ([2 * T + 44, 3 * T + 40, 2 * T, T + 5, 276], [2 * T + 44, 150, 70, 1, 150], 4, 2, 64, ()),
    # sinks evicted (read quantized) in the first two, in 16 bits in the third
    ([3 * T + 5, 3 * T, 2 * T + 9], [200, 129, 2 * T + 9], 4, 2, 64, (0, 1)),
    # the 27B's 24 / 4 heads of 256
    ([3 * T + 20, 90], [150, 90], 24, 4, 256, ()),
]


def dequantized(cache):
    out = torch.full_like(cache.query, float("nan"))
    starts, lengths = cache.query_start_loc.tolist(), cache.seq_lens.tolist()
    plan = plan_prefill(cache.slot_of_block, cache.block_table, starts, lengths,
                        range(len(lengths)), T, cache.query.device)  # fmt: skip
    result = prefill_by_dequantization(
        cache.query, cache.pool, cache.side_k, cache.side_v, plan, out, cache.layout,
    )  # fmt: skip
    assert result is out and not out.isnan().any()
    return out


def worst_error(out, expected):
    return max(relative_error(out[row], expected[row]) for row in range(out.shape[0]))


@pytest.mark.parametrize("scratch_tiles", [256, 2])
@pytest.mark.parametrize(("seq_lens", "query_lens", "heads", "kv_heads", "d", "evicted"), CASES)
def test_prefill_by_dequantization_matches_float64(
    seq_lens, query_lens, heads, kv_heads, d, evicted, scratch_tiles, monkeypatch
):
    monkeypatch.setattr(prefill_dequant, "SCRATCH_TILES", scratch_tiles)
    cache = build_cache(seq_lens, query_lens, heads, kv_heads, d, seed=len(seq_lens) + d,
                        dtype=torch.float32, evicted_sinks=evicted)  # fmt: skip
    assert worst_error(dequantized(cache), cache.expected()) < FP32_BOUND


def test_3_bit_values_by_dequantization_match_float64():
    """Tiles of 3-bit values (dequantize_tiles reads the high plane) in the scratch: one
    request's sink evicted (read quantized from the scratch), the other's kept."""
    cache = build_cache([3 * T + 5, T + 9], [200, T + 9], 4, 2, 64, seed=29,
                        dtype=torch.float32, evicted_sinks=(0,), v_bits=3)  # fmt: skip
    assert worst_error(dequantized(cache), cache.expected()) < FP32_BOUND


@pytest.mark.usefixtures("bf16_dots")
@pytest.mark.parametrize(("seq_lens", "query_lens", "heads", "kv_heads", "d", "evicted"), CASES)
def test_in_bf16_its_error_is_within_the_served_kernels(
    seq_lens, query_lens, heads, kv_heads, d, evicted
):
    cache = build_cache(seq_lens, query_lens, heads, kv_heads, d, seed=len(seq_lens) + d,
                        evicted_sinks=evicted)  # fmt: skip
    expected = cache.expected()
    assert worst_error(dequantized(cache), expected) <= worst_error(run(cache), expected)


def test_groups_cut_a_chunk_where_the_filling_tile_changes():
    """Contexts 128 F .. 128 F + 127 share filling tile F: a chunk of 300 queries after 100
    tokens (contexts 101 .. 400) is cut before contexts 128, 256 and 384."""
    groups = filling_groups([0, 5, 305], [5, 400], range(1, 2))
    assert [(g.filling, g.first, g.count, g.last_context) for g in groups] == [
        (0, 5, 27, 127), (1, 32, 128, 255), (2, 160, 128, 383), (3, 288, 17, 400),
    ]  # fmt: skip


def test_merging_partials_equals_attention_over_their_union_and_empty_rows_weigh_nothing():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, 10, generator=g, dtype=torch.float64)  # [heads, rows, keys]
    values = torch.randn(10, 2, 4, generator=g, dtype=torch.float64)

    def partial(keys):
        part = scores[..., keys]
        lse = part.logsumexp(-1)
        return torch.einsum("hqk,khd->qhd", (part - lse[..., None]).exp(), values[keys]), lse

    acc = torch.zeros(3, 2, 4, dtype=torch.float64)
    acc_lse = torch.full((2, 3), float("-inf"), dtype=torch.float64)
    rows = torch.arange(3)
    for keys in (slice(0, 4), slice(4, 10)):
        merge_into(acc, acc_lse, rows, *partial(keys))
    # an empty partial, as FA2 gives it (+inf) and as FA3 does (-inf)
    for empty in (float("inf"), float("-inf")):
        merge_into(acc, acc_lse, rows, torch.full_like(acc, 7.0), torch.full((2, 3), empty))
    whole, whole_lse = partial(slice(0, 10))
    assert torch.allclose(acc, whole.float().double(), atol=1e-6)
    assert torch.allclose(acc_lse, whole_lse.float().double(), atol=1e-6)
