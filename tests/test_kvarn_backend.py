"""KVarN's vLLM attention backend (kvarn/backend.py) on the CPU.

The metadata builder and the impl are driven directly, as vLLM's runner and Attention layer
would, through three steps whose CommonAttentionMetadata is built by hand the way vLLM's
runner lays out a batch (decodes first, slots = block * 128 + offset, -1 for padding, q, k and
v slices of one fused projection), with a side cache of 4 slots so that they run out: step 1
prefills two requests, step 2 decodes one (its token fills a tile; its sink's slot has gone to
the other, so it reads its sink quantized) and prefills the next chunk of the other (filling a
tile and reading it quantized from its later queries), step 3 decodes that one and prefills a
third request that hits the first one's 2 tiles in the prefix cache, its sink without a slot.
Every output row is compared with attention.py's float64 attention_reference at that query's
own context (the sink quantized where its block has no slot), over the pool the impl wrote;
each tile the impl stored, the sinks included, is compared byte for byte with store.py run on
the original K and V. Output, pool and the side cache start poisoned (NaN, 0xFF bytes), so a
read outside the plan shows. Under Triton's interpreter; bounds as in test_kvarn_decode.py
(fp16 output rounding, fp32 sums).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from kvarn_data import outlier_keys, outlier_values

from hyperqwen.bench.kernels import relative_error
from hyperqwen.kvarn.attention import attention_reference
from hyperqwen.kvarn.backend import KVarNBackend, KVarNImpl, SideCache
from hyperqwen.kvarn.layout import TileLayout, bytes_per_token
from hyperqwen.kvarn.slots import SlotAllocator
from hyperqwen.kvarn.store import store_tiles

T = 128
HEADS, KV_HEADS, D = 4, 2, 32
DTYPE = torch.float16
BOUND = 1e-3  # test_kvarn_decode.py's fp16 bound
POISON_BYTE = 0xFF


@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_pages_are_the_pool_and_cost_the_layouts_bytes_per_token(head_size):
    layout = TileLayout(head_dim=head_size)
    shape = KVarNBackend.get_kv_cache_shape(7, T, 4, head_size)
    assert shape == layout.pool_shape(7, 4)
    spec = KVarNBackend.kv_cache_spec(T, 4, head_size)
    # vLLM allocates page_size_bytes per block and views it as the shape, uint8
    assert spec.page_size_bytes == math.prod(shape[1:]) * torch.uint8.itemsize
    assert spec.page_size_bytes == T * 4 * bytes_per_token(layout)
    assert spec.dtype == torch.uint8
    with pytest.raises(ValueError, match="128-token tile"):
        KVarNBackend.get_kv_cache_shape(7, 64, 4, head_size)


def test_vllms_runner_views_a_layers_bytes_as_the_pool():
    """gpu_model_runner.py: _reshape_kv_cache_tensors. A hybrid block of 3 tiles (vLLM's block
    is a multiple of the 128-token kernel block) becomes 3 kernel blocks of the pool."""
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    blocks, tiles_per_block, heads, d = 5, 3, 4, 256
    spec = KVarNBackend.kv_cache_spec(tiles_per_block * T, heads, d)
    raw = torch.zeros(blocks * spec.page_size_bytes, dtype=torch.int8)
    kernel_blocks = blocks * tiles_per_block
    shape = KVarNBackend.get_kv_cache_shape(kernel_blocks, T, heads, d)
    pool = _reshape_attention_kv_cache(raw, spec, shape, (0, 1, 2), kernel_blocks, None)
    TileLayout(head_dim=d).check_pool(pool)
    assert pool.shape == (kernel_blocks, heads, TileLayout(head_dim=d).tile_bytes)
    assert pool.data_ptr() == raw.data_ptr() and pool.is_contiguous()


def test_the_backend_takes_only_what_it_serves():
    assert KVarNBackend.get_supported_kernel_block_sizes() == [T]
    assert KVarNBackend.supports_kv_cache_dtype("auto")
    assert not KVarNBackend.supports_kv_cache_dtype("fp8")
    with pytest.raises(NotImplementedError, match="a sliding window"):
        KVarNImpl(HEADS, D, 1.0, KV_HEADS, sliding_window=64)


class Sequence:
    def __init__(self, length, seed, blocks, prefix=None, shared=0):
        self.key = outlier_keys(length, KV_HEADS, D, seed).to(DTYPE)
        self.value = outlier_values(length, KV_HEADS, D, seed + 1).to(DTYPE)
        if prefix is not None:  # a prefix-cache hit: the first `shared` tokens are another's
            self.key[:shared] = prefix.key[:shared]
            self.value[:shared] = prefix.value[:shared]
        self.blocks = blocks  # pool block of each position


def common_metadata(requests, num_blocks, width, padding=0, ahead=None):
    """vLLM's per-step batch description (v1/attention/backend.py: CommonAttentionMetadata) as
    its runner fills it: requests (sequence, computed, scheduled) in batch order, decodes first,
    `computed` the device's count; slots block * 128 + offset, then `padding` rows of slot -1;
    the host's sequence lengths exact, or `ahead[r]` tokens above the device's (under async
    speculation vLLM's host assumes the last step's drafts all accepted)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    query_lens = [scheduled for _, _, scheduled in requests]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c + s for _, c, s in requests], dtype=torch.int32)
    table = torch.full((len(requests), width), num_blocks - 1, dtype=torch.int32)
    slots = []
    for row, (seq, computed, scheduled) in enumerate(requests):
        table[row, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        slots += [seq.blocks[p // T] * T + p % T for p in range(computed, computed + scheduled)]
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone(),
        seq_lens=seq_lens,
        num_reqs=len(requests),
        num_actual_tokens=len(slots),
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=table,
        slot_mapping=torch.tensor(slots + [-1] * padding, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq_lens + torch.tensor(ahead or [0] * len(requests)).int(),
    )


def build_from_host_table(builder, cam):
    """The builder's metadata from the runner's host block table, as
    patches/runner-host-block-table.patch passes it (set as an attribute: the venv's vLLM may
    not have the field yet), checked against the same builder's from a copy of the device
    table (stock vLLM): the same slots, side rows and stores, from the same allocator state."""
    planner = getattr(builder, "builder", builder)  # a drafter pass wraps the builder
    allocator = copy.deepcopy(planner.slots)
    from_device = builder.build(0, cam)
    planner.slots = allocator
    cam.block_table_cpu = cam.block_table_tensor.clone()
    meta = builder.build(0, cam)
    for name in ("slot_of_block", "side_rows", "store_blocks", "store_slots"):
        assert torch.equal(getattr(meta, name), getattr(from_device, name)), name
    return meta


def step(impl, builder, pool, requests, num_decodes, queries, padding=0, ahead=None):
    cam = common_metadata(requests, pool.shape[0], 5, padding, ahead)
    meta = build_from_host_table(builder, cam)
    decode_tokens = sum(scheduled for _, _, scheduled in requests[:num_decodes])
    assert (meta.num_decodes, meta.num_decode_tokens) == (num_decodes, decode_tokens)
    n = meta.num_actual_tokens + padding

    def take(name):
        parts = [getattr(s, name)[c : c + k] for s, c, k in requests]
        return torch.cat([*parts, torch.randn(padding, KV_HEADS, D, dtype=DTYPE)])

    query = torch.cat([queries, torch.randn(padding, HEADS, D, dtype=DTYPE)])
    # column slices of one fused projection, as vLLM hands them over
    qkv = torch.cat([x.view(n, -1) for x in (query, take("key"), take("value"))], dim=1)
    query, key, value = qkv.split([HEADS * D, KV_HEADS * D, KV_HEADS * D], dim=1)
    output = torch.full((n, HEADS * D), float("nan"), dtype=DTYPE)
    impl.forward(None, query, key, value, pool, meta, output)
    return output[: meta.num_actual_tokens].view(-1, HEADS, D), meta


def expected(pool, requests, queries, layout, slot_of_block):
    rows, start = [], 0
    for seq, computed, scheduled in requests:
        table = torch.tensor(seq.blocks)
        in_side = int(slot_of_block[seq.blocks[0]]) >= 0
        for j in range(scheduled):
            context = computed + j + 1
            filling = max(T, context // T * T)
            sink = (seq.key[: min(context, T)], seq.value[: min(context, T)])
            rows.append(
                attention_reference(
                    queries[start + j], pool, table, sink if in_side else None,
                    (seq.key[filling:context], seq.value[filling:context]),
                    context, layout, scale=D**-0.5,
                )
            )  # fmt: skip
        start += scheduled
    return torch.stack(rows)


def check_tiles(pool, seq, positions, layout):
    key = torch.stack([seq.key[b * T : (b + 1) * T] for b in positions])
    value = torch.stack([seq.value[b * T : (b + 1) * T] for b in positions])
    ids = torch.tensor([seq.blocks[b] for b in positions])
    reference = torch.full_like(pool, POISON_BYTE)
    store_tiles(key, value, reference, ids, layout)
    assert torch.equal(pool[ids], reference[ids]), positions


def check_step(out, meta, pool, requests, queries, layout):
    want = expected(pool, requests, queries, layout, meta.slot_of_block)
    errors = [relative_error(out[i], want[i]) for i in range(out.shape[0])]
    assert max(errors) < BOUND, errors.index(max(errors))


@pytest.mark.usefixtures("interpreted")
def test_store_and_decode_through_the_impl_match_float64(vllm_cpu_platform):
    from vllm.config import VllmConfig

    layout = TileLayout(head_dim=D)
    num_blocks = 10
    pool = torch.full(layout.pool_shape(num_blocks, KV_HEADS), POISON_BYTE, dtype=torch.uint8)
    spec = KVarNBackend.kv_cache_spec(T, KV_HEADS, D)
    builder = KVarNBackend.get_builder_cls()(spec, ["layer"], VllmConfig(), pool.device)
    assert builder.reorder_batch_threshold == 1  # vLLM puts decodes first
    builder.slots = SlotAllocator(4)  # few enough to run out in step 2
    impl = KVarNBackend.get_impl_cls()(HEADS, D, D**-0.5, KV_HEADS)
    impl.side = SideCache(4, KV_HEADS, D, DTYPE, "cpu")
    impl.side.key.fill_(float("nan"))
    impl.side.value.fill_(float("nan"))
    # shuffled blocks; block 9 is the table's filler and stays poisoned
    a = Sequence(3 * T, seed=1, blocks=[6, 2, 4])
    b = Sequence(301, seed=3, blocks=[1, 8, 5])
    c = Sequence(2 * T + 10, seed=7, blocks=[6, 2, 7], prefix=a, shared=2 * T)
    g = torch.Generator().manual_seed(5)

    # step 1: prefill a's first 383 tokens (sink and tile 1 stored) and b's first 100, one
    # padding row: 4 tiles written, the 4 slots
    first = [(a, 0, 3 * T - 1), (b, 0, 100)]
    queries = torch.randn(3 * T - 1 + 100, HEADS, D, generator=g).to(DTYPE)
    out, meta = step(impl, builder, pool, first, 0, queries, padding=1)
    assert meta.store_blocks.tolist() == [6, 2]
    check_tiles(pool, a, [0, 1], layout)
    check_step(out, meta, pool, first, queries, layout)

    # step 2: a decodes token 384 (fills tile 2); b's chunk 100 -> 300 fills its sink and tile
    # 1, its queries from context 256 on read tile 1 quantized; b's tile 2 takes a's sink's
    # slot (tile 1's is free again, the others in use), so a reads its sink quantized
    second = [(a, 3 * T - 1, 1), (b, 100, 200)]
    queries = torch.randn(201, HEADS, D, generator=g).to(DTYPE)
    out, meta = step(impl, builder, pool, second, 1, queries)
    assert int(meta.slot_of_block[6]) == -1 and int(meta.slot_of_block[1]) >= 0
    assert meta.store_blocks.tolist() == [4, 1, 8]
    check_tiles(pool, a, [0, 1, 2], layout)
    check_tiles(pool, b, [0, 1], layout)
    assert (pool[[5, 9]] == POISON_BYTE).all(), "a filling block was quantized"
    check_step(out, meta, pool, second, queries, layout)

    # step 3: b decodes token 301; c hits a's first 2 tiles in the prefix cache (its sink has
    # no slot: read quantized) and prefills 10 tokens into a fresh block
    third = [(b, 300, 1), (c, 2 * T, 10)]
    queries = torch.randn(11, HEADS, D, generator=g).to(DTYPE)
    out, meta = step(impl, builder, pool, third, 1, queries)
    assert int(meta.slot_of_block[6]) == -1 and meta.store_blocks.numel() == 0
    assert (pool[[5, 7, 9]] == POISON_BYTE).all(), "a filling block was quantized"
    check_step(out, meta, pool, third, queries, layout)


def test_the_builder_plans_from_the_host_table_not_the_device_copy(vllm_cpu_platform):
    """With the runner's host table given, the plan names its blocks: a device table of other
    blocks (here all block 7) is not read back."""
    from vllm.config import VllmConfig

    spec = KVarNBackend.kv_cache_spec(T, KV_HEADS, D)
    builder = KVarNBackend.get_builder_cls()(spec, ["layer"], VllmConfig(), "cpu")
    cam = common_metadata([(Sequence(200, seed=1, blocks=[3, 5]), 0, 200)], 8, 5)
    cam.block_table_cpu = cam.block_table_tensor.clone()
    cam.block_table_tensor = torch.full_like(cam.block_table_tensor, 7)
    meta = builder.build(0, cam)
    assert meta.store_blocks.tolist() == [3]
    assert int(meta.slot_of_block[3]) >= 0 and int(meta.slot_of_block[5]) >= 0
    assert int(meta.slot_of_block[7]) == -1


def test_the_profile_run_allocates_the_side_cache_so_vllm_counts_it(vllm_cpu_platform):
    """Built under vLLM's config, as the model is, the impl knows the builder's slot count and
    allocates its side cache in the profile run (a forward without metadata), where vLLM's
    memory profile sees it; without a config (tests that build it by hand) it waits for the
    first step's metadata."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from hyperqwen.kvarn.backend import side_cache_slots
    from hyperqwen.kvarn.sizing import serving_side_slots

    config = VllmConfig()
    scheduler = config.scheduler_config
    slots = side_cache_slots(config)
    assert slots == serving_side_slots(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
    with set_current_vllm_config(config):
        impl = KVarNImpl(HEADS, D, D**-0.5, KV_HEADS)
    query = torch.randn(3, HEADS * D, dtype=DTYPE)
    kv = torch.randn(3, KV_HEADS * D, dtype=DTYPE)
    output = torch.full_like(query, float("nan"))
    impl.forward(None, query, kv, kv, torch.empty(0, dtype=torch.uint8), None, output)
    assert (output == 0).all()
    assert impl.side.key.shape == (slots * T + 1, KV_HEADS, D) and impl.side.key.dtype == DTYPE
    assert impl.side.value.shape == impl.side.key.shape
    bare = KVarNImpl(HEADS, D, D**-0.5, KV_HEADS)
    bare.forward(None, query, kv, kv, torch.empty(0, dtype=torch.uint8), None, output)
    assert bare.side is None
