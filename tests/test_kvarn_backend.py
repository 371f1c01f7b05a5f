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
from hyperqwen.engine.features import KVARN_V_BITS, FeatureSwitchError
from hyperqwen.kvarn.attention import attention_reference
from hyperqwen.kvarn.backend import KVarNBackend, KVarNImpl, SideCache
from hyperqwen.kvarn.layout import TileLayout, bytes_per_token
from hyperqwen.kvarn.prefill_dequant import plan_prefill
from hyperqwen.kvarn.slots import SlotAllocator
from hyperqwen.kvarn.store import store_tiles

T = 128
HEADS, KV_HEADS, D = 4, 2, 32
DTYPE = torch.float16
BOUND = 1e-3  # test_kvarn_decode.py's fp16 bound
DEQUANTIZED_BOUND = 1e-2
POISON_BYTE = 0xFF


@pytest.mark.parametrize("v_bits", [None, "2", "3"])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_pages_are_the_pool_and_cost_the_layouts_bytes_per_token(head_size, v_bits, monkeypatch):
    """The tiles' value bits are the variable's (the launcher's KVARN_V_BITS; unset: 2)."""
    if v_bits is None:
        monkeypatch.delenv(KVARN_V_BITS.env, raising=False)
    else:
        monkeypatch.setenv(KVARN_V_BITS.env, v_bits)
    layout = TileLayout(head_dim=head_size, v_bits=int(v_bits or 2))
    shape = KVarNBackend.get_kv_cache_shape(7, T, 4, head_size)
    assert shape == layout.pool_shape(7, 4)
    spec = KVarNBackend.kv_cache_spec(T, 4, head_size)
    # vLLM allocates page_size_bytes per block and views it as the shape, uint8
    assert spec.page_size_bytes == math.prod(shape[1:]) * torch.uint8.itemsize
    assert spec.page_size_bytes == T * 4 * bytes_per_token(layout)
    assert spec.dtype == torch.uint8
    with pytest.raises(ValueError, match="128-token tile"):
        KVarNBackend.get_kv_cache_shape(7, 64, 4, head_size)


@pytest.mark.parametrize("value", ["4", "abc", ""])
def test_value_bits_the_backend_does_not_take_are_refused_by_name(value, monkeypatch):
    monkeypatch.setenv(KVARN_V_BITS.env, value)
    refusal = rf"{KVARN_V_BITS.env}='{value}': expected one of 2, 3 \(the launcher sets it from "
    for build in (
        lambda: KVarNBackend.get_kv_cache_shape(7, T, 4, 256),
        lambda: KVarNBackend.kv_cache_spec(T, 4, 256),
        lambda: KVarNImpl(HEADS, D, 1.0, KV_HEADS),
    ):
        with pytest.raises(FeatureSwitchError, match=refusal + "the KVARN_V_BITS knob"):
            build()


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


def builder_config(num_blocks, config=None):
    """A vLLM config as its worker has it when it builds the attention backends: the KV cache
    sized (backend.pool_blocks), here to `num_blocks` blocks of 128 tokens."""
    from vllm.config import VllmConfig

    config = config or VllmConfig()
    config.cache_config.num_gpu_blocks = num_blocks
    config.cache_config.block_size = T
    return config


STEP_TENSORS = ("slot_of_block", "side_rows", "store_blocks", "store_slots")


def build_from_host_table(builder, cam):
    """The builder's metadata from the runner's host block table, as
    patches/runner-host-block-table.patch passes it (set as an attribute: the venv's vLLM may
    not have the field yet), checked against the same builder's from a copy of the device
    table (stock vLLM): the same slots, side rows and stores, from the same allocator state,
    in the same tensors (a CUDA graph reads them where it was captured)."""
    planner = getattr(builder, "builder", builder)  # a drafter pass wraps the builder
    allocator = copy.deepcopy(planner.slots)
    from_device = builder.build(0, cam)
    # the builder writes every step into the same tensors: keep this build's values
    values = {name: getattr(from_device, name).clone() for name in STEP_TENSORS}
    planner.slots = allocator
    cam.block_table_cpu = cam.block_table_tensor.clone()
    meta = builder.build(0, cam)
    for name in STEP_TENSORS:
        assert torch.equal(getattr(meta, name), values[name]), name
        assert getattr(meta, name).data_ptr() == getattr(from_device, name).data_ptr(), name
    return meta


def stored(meta):
    """The pool blocks a step stores (the list is padded with -1 to a length per request)."""
    return [block for block in meta.store_blocks.tolist() if block >= 0]


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


def check_step(out, meta, pool, requests, queries, layout, bound=BOUND):
    want = expected(pool, requests, queries, layout, meta.slot_of_block)
    errors = [relative_error(out[i], want[i]) for i in range(out.shape[0])]
    assert max(errors) < bound, errors.index(max(errors))


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(
    ("dequantized_prefill", "v_bits"),
    [(False, 2), (True, 2), (False, 3)],
    ids=["kernel", "dequantized", "kernel-3-bit-values"],
)
def test_store_and_decode_through_the_impl_match_float64(
    vllm_cpu_platform, dequantized_prefill, v_bits, monkeypatch
):
    """Prefill by prefill.py's kernel (the CPU's path) and by prefill_dequant.py's (the GPU's
    where vLLM has FlashAttention; here with attend_torch): the latter's bound is its fp16
    scratch's rounding of the outlier keys (tests/test_kvarn_prefill_dequant.py bounds it by
    the kernel's in bf16); a wrong tile or row errs by far more. With 3-bit values (the
    variable KVARN_V_BITS=3 sets) the impl's tiles, stores and reads are 3-bit ones."""
    monkeypatch.setenv(KVARN_V_BITS.env, str(v_bits))
    bound = DEQUANTIZED_BOUND if dequantized_prefill else BOUND
    layout = TileLayout(head_dim=D, v_bits=v_bits)
    num_blocks = 10
    pool = torch.full(layout.pool_shape(num_blocks, KV_HEADS), POISON_BYTE, dtype=torch.uint8)
    spec = KVarNBackend.kv_cache_spec(T, KV_HEADS, D)
    builder = KVarNBackend.get_builder_cls()(
        spec, ["layer"], builder_config(num_blocks), pool.device
    )
    assert builder.reorder_batch_threshold == 1  # vLLM puts decodes first
    builder.slots = SlotAllocator(4, num_blocks)  # few enough to run out in step 2
    impl = KVarNBackend.get_impl_cls()(HEADS, D, D**-0.5, KV_HEADS)
    assert impl.layout == layout
    impl.dequantized_prefill = dequantized_prefill
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
    check_step(out, meta, pool, first, queries, layout, bound)

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
    check_step(out, meta, pool, second, queries, layout, bound)

    # step 3: b decodes token 301; c hits a's first 2 tiles in the prefix cache (its sink has
    # no slot: read quantized) and prefills 10 tokens into a fresh block
    third = [(b, 300, 1), (c, 2 * T, 10)]
    queries = torch.randn(11, HEADS, D, generator=g).to(DTYPE)
    out, meta = step(impl, builder, pool, third, 1, queries)
    assert int(meta.slot_of_block[6]) == -1 and stored(meta) == []
    assert (pool[[5, 7, 9]] == POISON_BYTE).all(), "a filling block was quantized"
    check_step(out, meta, pool, third, queries, layout, bound)


@pytest.mark.usefixtures("interpreted")
def test_prefill_by_dequantization_is_planned_once_per_step(vllm_cpu_platform, monkeypatch):
    """The step's layers share its metadata: the first layer's forward makes the prefill plan
    (host work and a copy), the next ones reuse it and compute the same attention."""
    from hyperqwen.kvarn import backend

    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return plan_prefill(*args, **kwargs)

    monkeypatch.setattr(backend, "plan_prefill", counted)
    layout = TileLayout(head_dim=D)
    pool = torch.full(layout.pool_shape(6, KV_HEADS), POISON_BYTE, dtype=torch.uint8)
    spec = KVarNBackend.kv_cache_spec(T, KV_HEADS, D)
    builder = KVarNBackend.get_builder_cls()(spec, ["layer"], builder_config(6), pool.device)
    impl = KVarNBackend.get_impl_cls()(HEADS, D, D**-0.5, KV_HEADS)
    impl.dequantized_prefill = True
    impl.side = SideCache(builder.slots.num_slots, KV_HEADS, D, DTYPE, "cpu")
    requests = [(Sequence(T + 40, seed=2, blocks=[3, 1]), 0, T + 40)]
    queries = torch.randn(T + 40, HEADS, D, generator=torch.Generator().manual_seed(4)).to(DTYPE)
    first, meta = step(impl, builder, pool, requests, 0, queries)
    plan = meta.prefill_plan
    assert plan is not None and len(calls) == 1
    second = torch.full((T + 40, HEADS * D), float("nan"), dtype=DTYPE)
    qkv = [x.reshape(T + 40, -1) for x in (queries, *(getattr(requests[0][0], name)[: T + 40]
                                                      for name in ("key", "value")))]  # fmt: skip
    impl.forward(None, *qkv, pool, meta, second)
    assert meta.prefill_plan is plan and len(calls) == 1
    assert torch.equal(second.view(-1, HEADS, D), first)


def test_the_builder_plans_from_the_host_table_not_the_device_copy(vllm_cpu_platform):
    """With the runner's host table given, the plan names its blocks: a device table of other
    blocks (here all block 7) is not read back."""
    spec = KVarNBackend.kv_cache_spec(T, KV_HEADS, D)
    builder = KVarNBackend.get_builder_cls()(spec, ["layer"], builder_config(8), "cpu")
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


def padded_like_a_full_graph(cam, requests: int, tokens: int, stale_length: int):
    """The batch as vLLM's runner pads it to a captured CUDA graph's size
    (gpu_model_runner._build_attention_metadata under pad_attn): `requests` more requests of
    no tokens on the null block (0) with a stale host length, and `tokens` more tokens of slot
    -1, counted in num_actual_tokens."""
    import dataclasses

    starts = torch.cat([cam.query_start_loc, cam.query_start_loc[-1:].repeat(requests)])
    null_rows = torch.zeros_like(cam.block_table_tensor[:1]).repeat(requests, 1)
    table = torch.cat([cam.block_table_tensor, null_rows])
    return dataclasses.replace(
        cam,
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone(),
        seq_lens=torch.cat([cam.seq_lens, torch.zeros(requests, dtype=torch.int32)]),
        seq_lens_cpu_upper_bound=torch.cat(
            [cam.seq_lens_cpu_upper_bound, torch.full((requests,), stale_length).int()]
        ),
        num_reqs=cam.num_reqs + requests,
        num_actual_tokens=cam.num_actual_tokens + tokens,
        block_table_tensor=table,
        slot_mapping=torch.cat([cam.slot_mapping, torch.full((tokens,), -1)]),
    )


def allocator_state(slots):
    return slots.slot_of_block.tolist(), list(slots.pinned), list(slots.sinks), list(slots.free)


@pytest.mark.usefixtures("interpreted")
def test_a_padded_decode_batch_plans_reads_and_stores_as_its_requests_alone(vllm_cpu_platform):
    """The CUDA-graph side of the builder (UNIFORM_BATCH): a decode batch padded as a FULL
    graph pads it plans the same slots as its real requests alone, stores the same tiles from
    a list of one entry per request (padding -1), and its real rows read what they would
    unpadded; every step's metadata comes in the same tensors. A dummy batch on the null block
    (vLLM's warm-up and capture runs, slot mapping -1) plans nothing."""
    layout = TileLayout(head_dim=D)
    num_blocks = 8
    spec = KVarNBackend.kv_cache_spec(T, KV_HEADS, D)
    builder = KVarNBackend.get_builder_cls()(spec, ["layer"], builder_config(num_blocks), "cpu")
    assert builder._cudagraph_support.name == "UNIFORM_BATCH"
    builder.slots = SlotAllocator(6, num_blocks)
    impl = KVarNBackend.get_impl_cls()(HEADS, D, D**-0.5, KV_HEADS)
    impl.side = SideCache(6, KV_HEADS, D, DTYPE, "cpu")
    impl.side.key.fill_(float("nan"))
    impl.side.value.fill_(float("nan"))
    pool = torch.full(layout.pool_shape(num_blocks, KV_HEADS), POISON_BYTE, dtype=torch.uint8)
    a = Sequence(2 * T, seed=11, blocks=[3, 5])
    b = Sequence(2 * T, seed=13, blocks=[6, 1])
    g = torch.Generator().manual_seed(17)
    prompts = [(a, 0, T - 1), (b, 0, 200)]
    step(impl, builder, pool, prompts, 0, torch.randn(T - 1 + 200, HEADS, D, generator=g).to(DTYPE))

    # a's token 127 fills its sink, b decodes inside tile 1; then both decode once more
    seen = []
    for decodes in ([(a, T - 1, 1), (b, 200, 1)], [(a, T, 1), (b, 201, 1)]):
        cam = common_metadata(decodes, num_blocks, 5)
        alone = copy.deepcopy(builder.slots)
        unpadded = builder.build(0, cam)
        want = {name: getattr(unpadded, name).clone() for name in STEP_TENSORS}
        after_alone = allocator_state(builder.slots)
        builder.slots = alone
        padded = padded_like_a_full_graph(cam, requests=2, tokens=2, stale_length=300)
        meta = builder.build(0, padded)
        assert allocator_state(builder.slots) == after_alone
        assert torch.equal(meta.slot_of_block, want["slot_of_block"])
        assert torch.equal(meta.side_rows[:2], want["side_rows"])
        assert (meta.side_rows[2:] == 6 * T).all()  # the padding row
        assert meta.store_blocks.tolist() == [*want["store_blocks"].tolist(), -1, -1]
        assert (meta.num_decodes, meta.num_decode_tokens) == (4, 4)
        seen.append({name: getattr(meta, name).data_ptr() for name in STEP_TENSORS})

        queries = torch.randn(2, HEADS, D, generator=g).to(DTYPE)
        query = torch.cat([queries, torch.randn(2, HEADS, D, dtype=DTYPE)]).view(4, -1)
        key = torch.cat([torch.cat([s.key[c : c + 1] for s, c, _ in decodes]),
                         torch.randn(2, KV_HEADS, D, dtype=DTYPE)]).view(4, -1)  # fmt: skip
        value = torch.cat([torch.cat([s.value[c : c + 1] for s, c, _ in decodes]),
                           torch.randn(2, KV_HEADS, D, dtype=DTYPE)]).view(4, -1)  # fmt: skip
        output = torch.full((4, HEADS * D), float("nan"), dtype=DTYPE)
        impl.forward(None, query, key, value, pool, meta, output)
        check_step(output[:2].view(2, HEADS, D), meta, pool, decodes, queries, layout)
    assert seen[0] == seen[1], "a step's metadata moved: a captured graph would read stale data"
    check_tiles(pool, a, [0], layout)

    before = allocator_state(builder.slots)
    dummy = common_metadata([(Sequence(4, seed=19, blocks=[0]), 0, 4)] * 3, num_blocks, 5)
    dummy.slot_mapping.fill_(-1)
    meta = builder.build(0, dummy)
    assert stored(meta) == [] and (meta.side_rows == 6 * T).all()
    assert allocator_state(builder.slots) == before


def test_decode_splits_fill_the_gpu_once_and_stop_at_the_cap():
    """Programs over (requests, KV heads, splits + the 16-bit one) fill the multiprocessors
    once: a C1 batch of the 27B's 4 KV heads on an H100's 132 takes 32 splits (the H100 sweep
    in docs/results/2026-12-06-h100-kvarn-decode-splits.json timed it fastest); a 3090's 82 at
    8 requests 1; a GPU of 600 at C1 stops at the cap."""
    from hyperqwen.kvarn.backend import MAX_DECODE_SPLITS, decode_splits

    assert decode_splits(1, 4, 132) == 32
    assert decode_splits(8, 4, 82) == 1
    assert decode_splits(2, 4, 82) == 9
    assert decode_splits(1, 4, 600) == MAX_DECODE_SPLITS == 64
