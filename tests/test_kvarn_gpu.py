"""KVarN's kernels compiled on the GPU at full size, against the float64 reference: 64 tiles
of the 27B's 4 KV heads of head_dim 256 in a pool past 2^32 bytes (int32 block ids, as
vLLM's block tables are) judged by tests/kvarn_encoding.py's criterion (exact away from
ties; a failure lists each violation's first place and the worst tile's error ratio), bytes
outside the named blocks left alone, outputs poisoned; the
decode kernel at the 27B's 24 / 4 heads with its 16-bit dot operands, decodes and verify
blocks, in a pool past 2^32 bytes; the prefill kernel there at a long context (an 8k chunk
after 32k tokens) beside a short chunk with its sink evicted. The store, dequantize and decode
tests also with tiles of 3-bit values (KVARN_V_BITS=3)."""

from __future__ import annotations

import pytest
import torch
from kvarn_cache import T, build_cache
from test_kvarn_store import POISON, assert_pool_holds_the_reference, tiles

from hyperqwen.bench.kernels import relative_error
from hyperqwen.kvarn import quantize
from hyperqwen.kvarn.decode import decode_attention, served_stages
from hyperqwen.kvarn.dequant import dequantize_tiles
from hyperqwen.kvarn.hadamard import rotate_reference, rotate_rows
from hyperqwen.kvarn.layout import TileLayout
from hyperqwen.kvarn.packing import unpack_tile
from hyperqwen.kvarn.prefill import prefill_attention
from hyperqwen.kvarn.store import store_tiles

# skipped per test, not per module, so that a plan's `-k` selection collects here
# (tests/test_gpu_plans.py)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEADS, D, TILES = 4, 256, 64
PREFILL_BOUND_32K = 5e-2  # the prefill test's docstring says why


@pytest.mark.parametrize("v_bits", [2, 3])
def test_27b_tiles_in_a_pool_past_2_32_bytes(v_bits):
    layout = TileLayout(head_dim=D, v_bits=v_bits)
    blocks = 2**32 // (HEADS * layout.tile_bytes) + 8
    pool = torch.full(layout.pool_shape(blocks, HEADS), POISON, dtype=torch.uint8, device="cuda")
    ids = torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(0))[: TILES - 1]
    block_ids = torch.cat((torch.tensor([blocks - 1]), ids)).to(torch.int32)
    key, value = tiles(TILES, HEADS, D, seed=51)
    store_tiles(key.cuda(), value.cuda(), pool, block_ids.cuda(), layout)
    outside = torch.ones(blocks, dtype=torch.bool, device="cuda")
    outside[block_ids.long().cuda()] = False
    assert (pool[outside] == POISON).all(), "bytes outside the named blocks changed"
    written = pool[block_ids.long().cuda()].cpu()
    assert_pool_holds_the_reference(written, torch.arange(TILES), key, value, layout)

    out = tuple(
        torch.full((TILES, 128, HEADS, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        for _ in range(2)
    )
    k, v = dequantize_tiles(pool, block_ids.cuda(), layout, out=out)
    assert not (k.isnan().any() or v.isnan().any())
    for i in range(TILES):
        for head in range(HEADS):
            want_k, want_v = quantize.dequantize_tile(unpack_tile(written[i, head], layout))
            assert relative_error(k[i, :, head].cpu(), want_k) < 4e-3
            assert relative_error(v[i, :, head].cpu(), want_v) < 4e-3


@pytest.mark.parametrize("n", [16, 128, 256, 512])
def test_rotate_rows_on_the_gpu(n):
    x = torch.randn(4096, n, generator=torch.Generator().manual_seed(n))
    out = torch.full((4096, n), float("nan"), device="cuda")
    rotate_rows(x.cuda(), out=out)
    assert relative_error(out.cpu(), rotate_reference(x.double())) < 1e-6


@pytest.mark.parametrize("v_bits", [2, 3])
@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("num_splits", [3, 32])
def test_decode_at_27b_shapes_in_a_pool_past_2_32_bytes(num_splits, num_stages, v_bits):
    """A verify block of 4 crossing a tile boundary, 2 inside a tile, decodes inside the
    sink, on a tile boundary and at 64 tiles; the pool's last block (past 2^32 bytes) holds
    a tile. Bound: the bf16 operands (query times key scales, weights times value scales,
    2^-9 each) and bf16 output; the CPU tests bound the same arithmetic in fp32 by 8e-3.
    Both pipelines of the partition kernel (decode.pipeline_stages: 2 where the GPU's shared
    memory holds it); tiles of 2- and 3-bit values."""
    if num_stages > served_stages(torch.device("cuda"), 32, D):
        pytest.skip("a 2-stage partition kernel needs sm80's or sm90's shared memory")
    layout = TileLayout(head_dim=D, v_bits=v_bits)
    blocks = 2**32 // (HEADS * layout.tile_bytes) + 8
    cache = build_cache([4 * T + 2, 20 * T, 100, 64 * T + 77, 9 * T + 60], [4, 1, 1, 1, 2],
                        24, HEADS, D, seed=91, device="cuda", pool_blocks=blocks,
                        v_bits=v_bits)  # fmt: skip
    out = torch.full_like(cache.query, float("nan"))
    decode_attention(cache.query, **cache.kernel_args(), num_splits=num_splits, out=out,
                     num_stages=num_stages)  # fmt: skip
    assert not out.isnan().any()
    expected = cache.expected()
    for row in range(out.shape[0]):
        assert relative_error(out[row], expected[row]) < 1.5e-2, row


def test_prefill_of_an_8k_chunk_after_32k_tokens_in_a_pool_past_2_32_bytes():
    """One launch: an 8192-token chunk after 32768 tokens (256 quantized tiles before it, 64
    filled by the chunk itself) and a 300-token chunk crossing 2 tile boundaries whose sink
    is evicted (read quantized); the pool's last block (past 2^32 bytes) holds a tile. Every
    output row must be written (poisoned first); the float64 reference is taken at rows
    around the chunks' tile boundaries and ends (each costs a float64 decode of its whole
    context), and each of those rows is also decoded alone at its context by the decode
    kernel over the same cache.

    Prefill runs decode's tile loops on the same bytes with the same bf16 operands (the
    query times each tile's key scales, the weights times the value scales, the weights of
    the 16-bit tiles); only the running maximum its weights are taken against differs (one
    online softmax, not decode's partitions), so its rows must equal decode's to within two
    bf16 roundings (2^-8: each kernel rounds its own weights and its own output). A defect
    of prefill's own (a tile, token or sink misread, a rescale missed, an extra rounding)
    breaks that; tests/test_kvarn_prefill.py checks the same under the interpreter with
    bf16 operands, where an extra bf16 rounding of prefill's rotated query (tried by hand)
    fails it.

    Against float64 both must stay under PREFILL_BOUND_32K: decode's error at these
    contexts, not the 1.5e-2 of decode's test at up to 64 tiles, which this test's first
    run exceeded at row 0. The bf16 operands perturb each token's score and value by a
    relative 2^-9 of its whole code range (codes 0..15 and 0..3 above the group's minimum,
    not its deviation from the mean), and on this outlier data the tokens that dominate a
    row's softmax are the extremes of more draws the longer the context, so a row's error
    grows with the context and varies from query to query. Under the interpreter with bf16
    operands (tests/triton_bf16_dots.py) decode's and prefill's errors are the same on each
    query and rise from 4 to 64 to 256 tiles; at 256 tiles the worst of one KV head's 6
    query heads reaches about the bound, and a row here spans 4 KV heads."""
    layout = TileLayout(head_dim=D)
    blocks = 2**32 // (HEADS * layout.tile_bytes) + 8
    past, chunk = 32768, 8192
    cache = build_cache([past + chunk, 5 * T + 17], [chunk, 300], 24, HEADS, D, seed=93,
                        device="cuda", pool_blocks=blocks, evicted_sinks=(1,))  # fmt: skip
    out = torch.full_like(cache.query, float("nan"))
    args = cache.kernel_args()
    args.pop("max_query_len")
    prefill_attention(cache.query, **args, out=out)
    assert not out.isnan().any()
    # contexts 32769 on; rows T - 2 / T - 1 read block 256 in 16 bits / quantized. The short
    # chunk's contexts start at 358: rows 25 / 26 and 153 / 154 straddle tile boundaries
    rows = [0, 1, T - 2, T - 1, T, 4000, chunk - 2, chunk - 1]
    rows += [chunk + j for j in (0, 25, 26, 153, 154, 299)]
    steps = cache.decode_steps(rows)
    decoded = torch.full_like(steps["query"], float("nan"))
    decode_attention(steps.pop("query"), **steps, num_splits=32, out=decoded)
    expected = cache.expected(rows)
    for i, (row, want) in enumerate(zip(rows, expected, strict=True)):
        prefill_error = relative_error(out[row], want)
        decode_error = relative_error(decoded[i], want)
        apart = relative_error(out[row], decoded[i].double())
        assert apart < 2**-8, (row, apart, prefill_error, decode_error)
        assert max(prefill_error, decode_error) < PREFILL_BOUND_32K, row


def test_prefill_by_dequantization_through_flash_attention_at_32k(monkeypatch):
    """prefill_dequant.py's GPU path, vLLM's FlashAttention over the dequantized scratch, on
    test_prefill_of_an_8k_chunk's cache (an 8k chunk after 32k tokens beside a short chunk
    whose sink is evicted) and its rows: against float64, no worse on each row than
    prefill.py's kernel (its bf16 dot operands) plus a bf16 rounding, and within that test's
    bound. The 32k context takes the scratch in one segment and then, at 2 tiles, in many
    (the merges' log-sum-exp from FlashAttention)."""
    from hyperqwen.kvarn import prefill_dequant
    from hyperqwen.kvarn.prefill_dequant import (
        attend_flash,
        plan_prefill,
        prefill_by_dequantization,
    )

    past, chunk = 32768, 8192
    cache = build_cache([past + chunk, 5 * T + 17], [chunk, 300], 24, HEADS, D, seed=93,
                        device="cuda", evicted_sinks=(1,))  # fmt: skip
    args = cache.kernel_args()
    args.pop("max_query_len")
    kernel = prefill_attention(cache.query, **args, out=torch.full_like(cache.query, float("nan")))
    rows = [0, 1, T - 2, T - 1, T, 4000, chunk - 2, chunk - 1]
    rows += [chunk + j for j in (0, 25, 26, 153, 154, 299)]
    expected = cache.expected(rows)
    starts, lengths = cache.query_start_loc.tolist(), cache.seq_lens.tolist()
    for scratch_tiles in (prefill_dequant.SCRATCH_TILES, 2):
        monkeypatch.setattr(prefill_dequant, "SCRATCH_TILES", scratch_tiles)
        out = torch.full_like(cache.query, float("nan"))
        plan = plan_prefill(cache.slot_of_block.cpu(), cache.block_table.cpu(), starts,
                            lengths, range(2), T, "cuda")  # fmt: skip
        prefill_by_dequantization(
            cache.query, cache.pool, cache.side_k, cache.side_v, plan, out, cache.layout,
            attend=attend_flash,
        )  # fmt: skip
        assert not out.isnan().any()
        for row, want in zip(rows, expected, strict=True):
            error = relative_error(out[row], want)
            slack = relative_error(kernel[row], want) + 2**-8
            assert error < slack, (scratch_tiles, row, error)
            assert error < PREFILL_BOUND_32K, (scratch_tiles, row)


def test_the_builders_copies_are_queued_not_waited_for():
    """The metadata is built four times a step (the verify, each drafter pass): a copy that
    waited for the GPU's queue would drain it each time. With seconds of work queued, the
    build's copy and kernel (step_tensors.write_step_tensors) return while it still runs, and
    give the host's values once it has run."""
    from types import SimpleNamespace

    from hyperqwen.kvarn.step_tensors import StepBuffers, write_step_tensors

    stream = torch.cuda.current_stream()
    # request 0 writes positions 255-258 (a verify block of 4), request 1 writes 129
    seq_lens = torch.tensor([258, 129], dtype=torch.int32, device="cuda")
    query_start_loc = torch.tensor([0, 4, 5], dtype=torch.int32, device="cuda")
    mapping = torch.tensor([3 * 128 + 127, 5 * 128, 5 * 128 + 1, 5 * 128 + 2, 9 * 128 + 1, -1],
                           device="cuda")  # fmt: skip
    plan = SimpleNamespace(  # candidate tiles ending at 256 and 384 (request 0), 128 (request 1)
        slot_of_block=torch.arange(4096, dtype=torch.int32) % 7 - 1,
        store_blocks=[7, 9, 11],
        store_slots=[0, 1, 2],
        store_rows=[0, 0, 1],
        store_ends=[256, 384, 128],
    )
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=2, max_num_batched_tokens=64)
    )
    buffers = StepBuffers(4096, 8, config, "cuda")

    def build():
        return write_step_tensors(buffers, plan, mapping, seq_lens, query_start_loc, 3, 8 * 128)

    # once first: PyTorch's caching host allocator gets its pinned blocks from cudaHostAlloc,
    # which waits for the device; a served step reuses blocks whose copies have run
    build()
    torch.cuda.synchronize()
    torch.cuda._sleep(10_000_000_000)  # seconds of cycles queued ahead of the copies
    slot_of_block, side_rows, blocks, slots = build()
    assert not stream.query(), "a copy waited for the queued work"
    torch.cuda.synchronize()
    assert torch.equal(slot_of_block.cpu(), plan.slot_of_block)
    # block 3 -> slot 2, block 5 -> slot 4, block 9 -> slot 1 (arange % 7 - 1); -1: padding
    rows = [2 * 128 + 127, 4 * 128, 4 * 128 + 1, 4 * 128 + 2, 128 + 1, 8 * 128]
    assert side_rows.tolist() == rows
    # only the tile ending at 256 ends inside a step's writes, (254, 258]
    assert blocks.tolist() == [7, -1, -1] and slots.tolist() == [0, 1, 2]


def test_a_cuda_graph_of_the_decode_step_replays_each_steps_metadata():
    """The builder's UNIFORM_BATCH claim on the GPU: a CUDA graph captured over the layer's
    forward for one padded decode batch (2 requests padded to 4, as vLLM's FULL graphs pad),
    replayed for the next steps after each step's build (one fills a sink, so its store
    runs through the padded list), gives the eager forward's outputs and pool bit for bit.
    The batch tensors live where vLLM's runner keeps them, in persistent buffers; a
    metadata tensor that moved between builds would leave the replay reading the captured
    step's."""
    import copy

    from test_kvarn_backend import builder_config
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from hyperqwen.kvarn.backend import KVarNBackend, SideCache
    from hyperqwen.kvarn.slots import SlotAllocator

    heads, kv_heads, slots, num_blocks, width, padded = 24, 4, 8, 16, 4, 4
    layout = TileLayout(head_dim=D)
    spec = KVarNBackend.kv_cache_spec(T, kv_heads, D)
    builder = KVarNBackend.get_builder_cls()(spec, ["layer"], builder_config(num_blocks), "cuda")
    builder.slots = SlotAllocator(slots, num_blocks)
    impl = KVarNBackend.get_impl_cls()(heads, D, D**-0.5, kv_heads)
    impl.side = SideCache(slots, kv_heads, D, torch.bfloat16, "cuda")
    pool = torch.full(layout.pool_shape(num_blocks, kv_heads), POISON, dtype=torch.uint8,
                      device="cuda")  # fmt: skip
    tables = torch.tensor([[3, 5, 0, 0], [6, 1, 7, 0]], dtype=torch.int32)
    prompts = (T - 2, 300)  # request 0's second decode fills its sink
    g = torch.Generator().manual_seed(61)
    # the runner's persistent batch tensors; padded requests: no tokens, the null block 0
    starts = torch.zeros(padded + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(padded, dtype=torch.int32, device="cuda")
    table = torch.zeros(padded, width, dtype=torch.int32, device="cuda")
    mapping = torch.full((sum(prompts),), -1, dtype=torch.int64, device="cuda")

    def batch(lengths, query_lens):
        """lengths: each request's count after the step; the batch padded to `padded` when
        it is a decode batch, as vLLM pads one for a captured graph."""
        reqs = padded if max(query_lens) == 1 else len(lengths)
        host_starts = torch.zeros(reqs + 1, dtype=torch.int32)
        host_starts[1 : len(lengths) + 1] = torch.tensor(query_lens).cumsum(0)
        host_starts[len(lengths) + 1 :] = host_starts[len(lengths)]
        host_lens = torch.zeros(reqs, dtype=torch.int32)
        host_lens[: len(lengths)] = torch.tensor(lengths)
        host_table = torch.zeros(reqs, width, dtype=torch.int32)
        host_table[: len(lengths)] = tables
        pairs = enumerate(zip(lengths, query_lens, strict=True))
        positions = [(row, p) for row, (n, q) in pairs for p in range(n - q, n)]
        tokens = reqs if reqs == padded else len(positions)
        slots_of = [-1] * tokens
        for i, (row, p) in enumerate(positions):
            slots_of[i] = int(tables[row, p // T]) * T + p % T
        starts[: reqs + 1].copy_(host_starts)
        seq_lens[:reqs].copy_(host_lens)
        table[:reqs].copy_(host_table)
        mapping[:tokens].copy_(torch.tensor(slots_of))
        cam = CommonAttentionMetadata(
            query_start_loc=starts[: reqs + 1], query_start_loc_cpu=host_starts,
            seq_lens=seq_lens[:reqs], num_reqs=reqs, num_actual_tokens=tokens,
            max_query_len=max(query_lens), max_seq_len=max(lengths),
            block_table_tensor=table[:reqs], slot_mapping=mapping[:tokens],
            seq_lens_cpu_upper_bound=host_lens,
        )  # fmt: skip
        cam.block_table_cpu = host_table
        return cam, tokens

    def inputs(tokens):
        return (
            torch.randn(tokens, heads * D, generator=g).to(torch.bfloat16).cuda(),
            torch.randn(tokens, kv_heads * D, generator=g).to(torch.bfloat16).cuda(),
            torch.randn(tokens, kv_heads * D, generator=g).to(torch.bfloat16).cuda(),
        )

    def forward(meta, q, k, v):
        out = torch.full_like(q, float("nan"))
        impl.forward(None, q, k, v, pool, meta, out)
        return out

    cam, tokens = batch(prompts, prompts)
    forward(builder.build(0, cam), *inputs(tokens))
    saved = (pool.clone(), impl.side.key.clone(), impl.side.value.clone(),
             copy.deepcopy(builder.slots))  # fmt: skip
    steps = [[n + i for n in prompts] for i in range(1, 5)]
    step_inputs = [inputs(padded) for _ in steps]

    eager = []
    for lengths, args in zip(steps, step_inputs, strict=True):
        cam, _ = batch(lengths, [1, 1])
        eager.append(forward(builder.build(0, cam), *args)[:2].clone())
    eager_pool = pool.clone()

    pool.copy_(saved[0])
    impl.side.key.copy_(saved[1])
    impl.side.value.copy_(saved[2])
    builder.slots = saved[3]
    static = [torch.empty_like(x) for x in step_inputs[0]]
    out = torch.full_like(static[0], float("nan"))
    graph = torch.cuda.CUDAGraph()
    for i, (lengths, args) in enumerate(zip(steps, step_inputs, strict=True)):
        cam, _ = batch(lengths, [1, 1])
        meta = builder.build(0, cam)
        for buffer, x in zip(static, args, strict=True):
            buffer.copy_(x)
        if i == 0:
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                impl.forward(None, *static, pool, meta, out)
        graph.replay()
        assert torch.equal(out[:2], eager[i]), f"step {i}: the replay read another step's data"
    assert torch.equal(pool, eager_pool), "the replays stored other tiles than the eager steps"
