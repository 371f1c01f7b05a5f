"""Replay counts from vLLM 0.26's GDN metadata (engine/gdn_replay.py), over a run of steps.

Each step's GDNAttentionMetadata comes from vLLM's own GDNAttentionMetadataBuilder, given what
its runner gives it (gpu_model_runner.py `_prepare_inputs`): the CommonAttentionMetadata of a
batch ordered as `reorder_batch_to_split_decodes_and_prefills` orders it, the per-row
num_accepted_tokens (1 for a request that did not verify last step, the runner's default) and
num_decode_draft_tokens_cpu (drafts of a row scheduled drafts + 1 tokens, else -1). The
expected counts are written out per step from what each request did in its previous step, not
computed by the code under test. The run covers a new request, a prefill in two chunks, the
first verify after a prefill, all drafts accepted, none accepted, some accepted, a finished
request's slot reused by a new one, a verify cut to one token by the budget (a non-spec row
that would skip its replay), a preempted request resumed on a new slot; with CUDA-graph
padding rows where the builder takes its FULL-graph path.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hyperqwen.engine.gdn_replay import NULL_SLOT, new_record, next_record, replay_plan

DRAFTS = 3  # num_speculative_tokens
SLOTS = 16
BLOCK = 16  # mamba block size; mamba_cache_mode "none": one block per request + DRAFTS


@dataclass(frozen=True)
class Row:
    """One batch row as the runner hands it to the builder."""

    slot: int  # block table column 0 (the request's state slot)
    computed: int
    scheduled: int
    drafts: int | None = None  # a verify row's drafts (scheduled == drafts + 1); None: non-spec
    vllm_accepted: int = 1  # the runner's num_accepted_tokens for the row


PADDING = Row(slot=NULL_SLOT, computed=0, scheduled=0)


@pytest.fixture(scope="module")
def builder_for(vllm_cpu_platform):
    import vllm.utils.torch_utils as torch_utils
    import vllm.v1.attention.backends.utils as backend_utils
    from vllm.config import SpeculativeConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    def build(cudagraph_mode: str):
        # the drafting method is irrelevant to the builder: only num_speculative_tokens is read
        speculative = SpeculativeConfig(
            method="ngram", num_speculative_tokens=DRAFTS, prompt_lookup_max=3, prompt_lookup_min=2
        )
        config = VllmConfig(speculative_config=speculative)
        config.compilation_config.cudagraph_mode = CUDAGraphMode[cudagraph_mode]
        spec = MambaSpec(
            shapes=((3 + DRAFTS, 8), (2, 4, 4)),
            dtypes=(torch.bfloat16, torch.float32),
            block_size=BLOCK,
            num_speculative_blocks=DRAFTS,
        )
        return GDNAttentionMetadataBuilder(spec, ["gdn"], config, torch.device("cpu"))

    # vLLM decides at import whether its host copies pin memory, on the platform it guessed
    # then (the modules that import the flag keep that answer); the CPU platform's answer
    with pytest.MonkeyPatch.context() as patch:
        for module in (torch_utils, backend_utils):
            patch.setattr(module, "PIN_MEMORY", platforms_pin_memory())
        yield build


def platforms_pin_memory() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_pin_memory_available()


def metadata(builder, rows: list[Row], state_columns: int = 1 + DRAFTS, accepted=None):
    """The builder's metadata of a step of `rows`; state_columns: the block table's width (1 +
    DRAFTS: vLLM's per-draft blocks; 1: the replay page's one block); accepted: the runner's
    num_accepted_tokens (default: each row's vllm_accepted)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    lens = [r.scheduled for r in rows]
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([r.computed + r.scheduled for r in rows], dtype=torch.int32)
    # column 0 the state slot, the DRAFTS speculative columns other blocks (vLLM's layout);
    # padding rows all null, as the runner's block table beyond its requests
    table = torch.zeros((len(rows), state_columns), dtype=torch.int32)
    for i, r in enumerate(rows):
        if r.slot != NULL_SLOT:
            columns = [r.slot, *(SLOTS + r.slot * DRAFTS + j for j in range(DRAFTS))]
            table[i] = torch.tensor(columns[:state_columns])
    common = CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone(),
        seq_lens=seq_lens,
        num_reqs=len(rows),
        num_actual_tokens=int(starts[-1]),
        max_query_len=max(lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=table,
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )
    if accepted is None:
        accepted = torch.tensor([r.vllm_accepted for r in rows], dtype=torch.int32)
    drafts = torch.tensor([-1 if r.drafts is None else r.drafts for r in rows], dtype=torch.int32)
    return builder.build(
        0, common, num_accepted_tokens=accepted, num_decode_draft_tokens_cpu=drafts
    )


def verify(slot, computed, vllm_accepted):
    return Row(slot, computed, DRAFTS + 1, drafts=DRAFTS, vllm_accepted=vllm_accepted)


# Requests: E (slot 9), A (slot 3), B (slot 5, then 11 after its preemption), C (slot 9, E's).
# Per step: rows in batch order, then the expected (slot, replay count) of each spec row,
# the expected `unreplayed` of each non-spec row, and slots the step must leave saved / not.
STEPS = [
    (  # E and A new; A's 20-token prompt in two chunks
        [Row(9, 0, 6), Row(3, 0, 12)],
        [],
        [False, False],
    ),
    (  # E's first verify after its prefill: vLLM reads 1, nothing saved; A's second chunk; B new
        [verify(9, 6, 1), Row(3, 12, 8), Row(5, 0, 3)],
        [(9, 0)],
        [False, False],
    ),
    (  # E: all 3 drafts accepted last step (4 tokens); A and B: first verify after a prefill
        [verify(9, 7, 4), verify(3, 20, 1), verify(5, 3, 1)],
        [(9, 4), (3, 0), (5, 0)],
        [],
    ),
    (  # E finished; C new on E's slot (saved, stale); A: none accepted (1); B: 2 of 3 (3)
        [verify(3, 21, 1), verify(5, 6, 3), Row(9, 0, 5)],
        [(3, 1), (5, 3)],
        [False],
    ),
    (  # C's first verify (E's stale inputs must not count); A cut to 1 token by the budget: a
        # non-spec row with inputs to fold in; B preempted (not scheduled)
        [verify(9, 5, 1), Row(3, 22, 1)],
        [(9, 0)],
        [True],
    ),
    (  # B resumed: recomputed from its prompt on a new slot; C: all accepted
        [verify(9, 6, 4), Row(11, 0, 9)],
        [(9, 4)],
        [False],
    ),
    (  # B's first verify after its resumption; C: 1 of 3 accepted (2)
        [verify(9, 10, 2), verify(11, 9, 1)],
        [(9, 2), (11, 0)],
        [],
    ),
]
SAVED_AFTER = [set(), {9}, {9, 3, 5}, {3, 5}, {9}, {9}, {9, 11}]


@pytest.mark.parametrize("cudagraph_mode", ["NONE", "FULL_AND_PIECEWISE"])
def test_replay_counts_over_a_run_from_vllms_builder(builder_for, cudagraph_mode):
    builder = builder_for(cudagraph_mode)
    full_graphs = cudagraph_mode != "NONE"
    saved = new_record(SLOTS, "cpu")
    for step, ((rows, spec_rows, non_spec_unreplayed), saved_after) in enumerate(
        zip(STEPS, SAVED_AFTER, strict=True)
    ):
        all_verify = all(r.drafts is not None for r in rows)
        # the runner pads a FULL-graph decode batch with requests of no tokens on the null slot
        padding = 2 if full_graphs and all_verify else 0
        meta = metadata(builder, rows + [PADDING] * padding)
        assert meta.num_spec_decodes == len(spec_rows), step
        plan = replay_plan(meta, saved)
        expected_slots = [s for s, _ in spec_rows] + [NULL_SLOT] * padding
        expected_counts = [c for _, c in spec_rows] + [0] * padding
        assert plan.committed_slots.tolist() == expected_slots, step
        assert plan.replay_counts.tolist() == expected_counts, step
        assert plan.replay_counts.dtype == torch.int32
        assert plan.unreplayed.tolist() == non_spec_unreplayed, step
        saved = next_record(meta, saved)
        live = {r.slot for r in rows}
        assert {s for s in live if saved[s]} == saved_after, step
        assert not saved[NULL_SLOT]
    # slots no step ran keep their value: B's first slot, 5, left when B was preempted after a
    # verify, stays saved until a new owner's first step (a prefill) clears it, as C's did on 9
    assert saved.nonzero().flatten().tolist() == [5, 9, 11]


def test_the_plan_reads_the_record_and_next_record_leaves_it_alone(builder_for):
    """Pure: neither function writes its inputs; next_record changes only the step's slots."""
    builder = builder_for("NONE")
    meta = metadata(builder, [verify(3, 21, 2), Row(5, 0, 7)])
    saved = new_record(SLOTS, "cpu")
    saved[[3, 5, 12]] = True
    before = saved.clone()
    plan = replay_plan(meta, saved)
    after = next_record(meta, saved)
    assert torch.equal(saved, before)
    assert plan.replay_counts.tolist() == [2]
    # 3 verified (saved), 5 prefilled from nothing (not saved, and not unreplayed: no context),
    # 12 not in the step
    assert plan.unreplayed.tolist() == [False]
    assert after.nonzero().flatten().tolist() == [3, 12]


def test_a_step_without_verify_plans_nothing_and_clears_its_slots(builder_for):
    """Plain decodes and prefills only (no drafts anywhere): vLLM's builder makes no spec rows."""
    builder = builder_for("NONE")
    saved = new_record(SLOTS, "cpu")
    saved[[3, 7]] = True
    meta = metadata(builder, [Row(3, 30, 1), Row(6, 0, 4)])
    assert meta.spec_state_indices_tensor is None
    plan = replay_plan(meta, saved)
    assert plan.replay_counts.numel() == 0 and plan.committed_slots.numel() == 0
    # 3 decodes with inputs saved and not folded in; 6 is a new prompt
    assert plan.unreplayed.tolist() == [True, False]
    assert next_record(meta, saved).nonzero().flatten().tolist() == [7]
