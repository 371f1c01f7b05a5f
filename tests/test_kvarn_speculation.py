"""KVarN's backend under speculative decoding with vLLM's async scheduling, on the CPU.

The real metadata builder (speculation on: verify blocks of 1 + 3 drafts are decodes), its
slot allocator, the impl's store and the decode kernel run step by step as vLLM's runner and
drafter drive them (kvarn/README.md, "Speculative decoding"): the device's lengths exact, the
host's `seq_lens_cpu_upper_bound` ahead of them by the drafts the previous step had rejected
(the host assumes all accepted). Each step writes fresh K and V at the device's positions,
so a rejected draft's position gets new content; drafts are rejected across tile boundaries
(a tile the host believes filled that the device did not fill, a tile filled by drafts and
refilled after their rejection), all accepted across one, beside a prefill. Each step checks
every output row against attention.py's float64 reference over the tokens the device has at
that query's context (the accepted ones and the step's own), every full tile byte-equal to
store.py run on its current tokens, and that no pool block changed but those the device
filled; pool, side cache and output start poisoned (tests/test_kvarn_backend.py's helpers).
"""

from __future__ import annotations

import pytest
import torch
from kvarn_data import outlier_keys, outlier_values
from test_kvarn_backend import (
    DTYPE,
    HEADS,
    KV_HEADS,
    POISON_BYTE,
    Sequence,
    builder_config,
    check_step,
    check_tiles,
    common_metadata,
    step,
)

from hyperqwen.kvarn.backend import KVarNBackend, SideCache
from hyperqwen.kvarn.layout import TileLayout
from hyperqwen.kvarn.slots import SlotAllocator

T = 128
D = 32
DRAFTS = 3
SLOTS = 9


def speculative_config():
    from vllm.config import SpeculativeConfig, VllmConfig

    # n-gram drafts: the one method vLLM configures without a draft model; what the builder
    # reads of it (num_speculative_tokens, parallel_drafting) is MTP's too
    drafts = SpeculativeConfig(
        method="ngram", num_speculative_tokens=DRAFTS, prompt_lookup_max=3, prompt_lookup_min=1
    )
    return VllmConfig(speculative_config=drafts)


class Request:
    """A sequence as the device has it (`computed` tokens) and the host's excess over it."""

    def __init__(self, seq, seed):
        self.seq, self.computed, self.ahead, self.seed = seq, 0, 0, seed

    def write(self, count):
        """Fresh K and V at the step's positions: a rejected draft's position is rewritten."""
        first, self.seed = self.computed, self.seed + 2
        self.seq.key[first : first + count] = outlier_keys(count, KV_HEADS, D, self.seed).to(DTYPE)
        self.seq.value[first : first + count] = outlier_values(
            count, KV_HEADS, D, self.seed + 1
        ).to(DTYPE)
        return (self.seq, first, count)

    def accept(self, scheduled, accepted):
        """After the step: the device keeps `accepted` of its `scheduled` tokens; the host's
        next count assumes all of them (vLLM corrects it a step later)."""
        self.computed += accepted
        self.ahead = scheduled - accepted


def make_backend(layout, num_blocks):
    pool = torch.full(layout.pool_shape(num_blocks, KV_HEADS), POISON_BYTE, dtype=torch.uint8)
    spec = KVarNBackend.kv_cache_spec(T, KV_HEADS, D)
    config = builder_config(num_blocks, speculative_config())
    builder = KVarNBackend.get_builder_cls()(spec, ["layer"], config, pool.device)
    builder.slots = SlotAllocator(SLOTS, num_blocks)
    impl = KVarNBackend.get_impl_cls()(HEADS, D, D**-0.5, KV_HEADS)
    impl.side = SideCache(SLOTS, KV_HEADS, D, DTYPE, "cpu")
    impl.side.key.fill_(float("nan"))
    impl.side.value.fill_(float("nan"))
    return pool, builder, impl


def device_filled_blocks(requests):
    """The pool blocks whose tiles the device fills in this step."""
    return {
        seq.blocks[end // T - 1]
        for seq, computed, scheduled in requests
        for end in range(T, computed + scheduled + 1, T)
        if end > computed
    }


def run_step(impl, builder, pool, batch, num_decodes, g, layout):
    """One step of (request, scheduled) in batch order, decodes first: runs it and checks the
    outputs, the full tiles and the blocks the step left alone."""
    ahead = [request.ahead for request, _ in batch]
    requests = [request.write(scheduled) for request, scheduled in batch]
    queries = torch.randn(sum(n for _, n in batch), HEADS, D, generator=g).to(DTYPE)
    before = pool.clone()
    out, meta = step(impl, builder, pool, requests, num_decodes, queries, ahead=ahead)
    # the decode kernel sizes its query rows by it (1 would drop rows at the 27B's 6 per head)
    assert meta.max_decode_query_len == max((n for _, n in batch[:num_decodes]), default=1)
    check_step(out, meta, pool, requests, queries, layout)
    for seq, computed, scheduled in requests:
        if computed + scheduled >= T:
            check_tiles(pool, seq, range((computed + scheduled) // T), layout)
    filled = device_filled_blocks(requests)
    for block in range(pool.shape[0]):
        if block not in filled:
            assert torch.equal(pool[block], before[block]), f"block {block} written"
    stored = {int(b) for b in meta.store_blocks if b >= 0}
    assert stored == filled
    return meta


@pytest.mark.usefixtures("interpreted")
def test_async_speculation_stores_what_the_device_filled_and_reads_the_accepted_tokens(
    vllm_cpu_platform,
):
    layout = TileLayout(head_dim=D)
    pool, builder, impl = make_backend(layout, num_blocks=12)
    assert builder.reorder_batch_threshold == 1 + DRAFTS  # verify blocks are decodes
    a = Request(Sequence(3 * T, seed=11, blocks=[6, 2, 4]), seed=100)
    b = Request(Sequence(3 * T, seed=13, blocks=[1, 5, 3]), seed=200)
    c = Request(Sequence(3 * T, seed=17, blocks=[7, 10, 9]), seed=300)
    g = torch.Generator().manual_seed(19)
    verify = 1 + DRAFTS

    # prefills (exact): a 250 tokens (its sink stored), b 120
    run_step(impl, builder, pool, [(a, 250), (b, 120)], 0, g, layout)
    a.accept(250, 250)
    b.accept(120, 120)

    # first verify blocks; a accepts all, b one token (host 3 ahead)
    run_step(impl, builder, pool, [(a, verify), (b, verify)], 2, g, layout)
    a.accept(verify, verify)  # 254
    b.accept(verify, 1)  # 121, host 124

    # a's verify block fills tile 1 with drafts (stored); b's host believes its sink filled
    # (124 + 4 = 128) but the device reaches 125: a candidate it does not store
    meta = run_step(impl, builder, pool, [(a, verify), (b, verify)], 2, g, layout)
    assert meta.store_blocks.tolist() == [a.seq.blocks[1], -1]  # b's candidate skipped
    sink_b = b.seq.blocks[0]
    assert (pool[sink_b] == POISON_BYTE).all(), "b's sink stored before the device filled it"
    a.accept(verify, 1)  # 255: tile 1's drafts at 255 rejected, host 258
    b.accept(verify, verify)  # 125

    # a rewrites position 255 and refills tile 1 (stored again, from the still-pinned slot);
    # b's verify block fills its sink; c prefills 130 tokens beside them (its sink stored)
    run_step(impl, builder, pool, [(a, verify), (b, verify), (c, 130)], 2, g, layout)
    a.accept(verify, 2)  # 257, host 259
    b.accept(verify, 3)  # 128: the draft at 128 rejected, the sink's tokens all accepted

    # a's tile 1 is final now (released); b's sink is not rewritten (no store), its tile 1
    # rewritten from 128; c's first verify block
    meta = run_step(impl, builder, pool, [(a, verify), (b, verify), (c, verify)], 3, g, layout)
    assert int(meta.slot_of_block[a.seq.blocks[1]]) == -1, "a's final tile 1 keeps its slot"
    assert b.seq.blocks[0] not in meta.store_blocks.tolist()
    a.accept(verify, verify)
    b.accept(verify, verify)
    c.accept(verify, verify)

    # all accepted: nothing ahead; b's sink joins the cached sinks
    assert builder.slots.slot(b.seq.blocks[0]) in builder.slots.pinned, "b's sink not final"
    run_step(impl, builder, pool, [(a, verify), (b, verify), (c, verify)], 3, g, layout)
    assert builder.slots.slot(b.seq.blocks[0]) in builder.slots.sinks


class DrafterPass:
    """The builder as vLLM's drafter calls it (spec_decode/llm_base_proposer.py: propose ->
    build_per_group_and_layer_attn_metadata -> build_for_drafting(cam, draft_index))."""

    def __init__(self, builder, draft_index):
        self.builder, self.draft_index = builder, draft_index

    def build(self, common_prefix_len, cam):
        return self.builder.build_for_drafting(cam, self.draft_index)


@pytest.mark.usefixtures("interpreted")
def test_the_drafters_passes_store_and_read_like_the_target(vllm_cpu_platform):
    """The MTP layer's own builder and cache through the drafter's passes of each step: pass 0
    over the verify step's batch (host ahead by the last step's rejections), then one query
    per request at the accepted length + j - 1 while the host counts from the verify step's
    upper bound + j, so it is ahead by up to twice the drafts. A draft pass fills the sink
    (stored), the next step's pass 0 rewrites that position and refills it (stored again);
    the sink is cached only once its tokens are final."""
    layout = TileLayout(head_dim=D)
    pool, builder, impl = make_backend(layout, num_blocks=6)
    a = Request(Sequence(2 * T, seed=23, blocks=[3, 1]), seed=400)
    g = torch.Generator().manual_seed(29)
    verify = 1 + DRAFTS

    def drafter_step(scheduled, accepted):
        """Pass 0 over the step's `scheduled` tokens, then the draft passes after
        `accepted` of them were accepted; returns each pass's store list (the builder writes
        each pass's into the same tensor)."""
        host_after = a.computed + a.ahead + scheduled
        decodes = int(scheduled <= verify)
        first = run_step(impl, DrafterPass(builder, 0), pool, [(a, scheduled)], decodes, g, layout)
        stores = [first.store_blocks.tolist()]
        a.accept(scheduled, accepted)
        start, rejected_ahead = a.computed, a.ahead
        for draft_index in range(1, DRAFTS):
            a.computed = start + draft_index - 1  # the draft pass writes one position
            a.ahead = host_after + draft_index - (a.computed + 1)
            meta = run_step(impl, DrafterPass(builder, draft_index), pool, [(a, 1)], 1, g, layout)
            stores.append(meta.store_blocks.tolist())
        a.computed, a.ahead = start, rejected_ahead
        return stores

    sink = a.seq.blocks[0]
    drafter_step(120, 120)  # the prompt (pass 0 a prefill), then drafts at 120, 121
    drafter_step(verify, verify)  # 124; drafts at 124, 125
    drafter_step(verify, 1)  # pass 0 fills the sink; 125 accepted, drafts at 125, 126
    stores = drafter_step(verify, 2)  # 125..128 refill it; 127 accepted; draft 1 at 127 fills it
    assert stores == [[sink], [sink], [-1]]
    assert builder.slots.slot(sink) in builder.slots.pinned
    drafter_step(verify, verify)  # 127..130 refill it again; 131 accepted
    drafter_step(verify, verify)
    assert builder.slots.slot(sink) in builder.slots.sinks


def test_a_verify_row_behind_a_prefill_is_refused_a_first_chunk_is_not(vllm_cpu_platform):
    """Rows after the decodes go to the prefill path, which reads the host's lengths: exact for
    a first chunk wherever it stands (vLLM's reorder puts those last, whatever their size),
    an upper bound for a verify block, which a smaller reorder threshold than KVarN's could put
    there."""
    layout = TileLayout(head_dim=D)
    pool, builder, _ = make_backend(layout, num_blocks=8)
    prefill = Sequence(T + 50, seed=31, blocks=[1, 2])
    verifying = Sequence(T + 50, seed=33, blocks=[3, 4])
    tiny_prompt = Sequence(3, seed=35, blocks=[5])
    meta = builder.build(
        0, common_metadata([(prefill, 0, 100), (tiny_prompt, 0, 3)], pool.shape[0], 5)
    )
    assert meta.num_decodes == 0
    misordered = [(prefill, 100, 50), (verifying, 120, 1 + DRAFTS)]
    with pytest.raises(RuntimeError, match="smaller decode threshold"):
        builder.build(0, common_metadata(misordered, pool.shape[0], 5, ahead=[0, 2]))
