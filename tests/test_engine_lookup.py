"""SPEC=lookup inside vLLM's CPU n-gram proposer (engine/lookup.py, patches/ngram-drafts.patch),
and LOOKUP=1's fusion with MTP drafts.

The installed (patched) NgramProposer runs with HYPERQWEN_LOOKUP=1: each step it drafts, for
every request that sampled a token, what followed the longest, latest earlier match of its last
tokens, checked against the plain-Python reference of tests/test_kernel_lookup.py.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from test_kernel_lookup import reference_drafts, reference_match

from hyperqwen.engine import lookup as engine_lookup, seams
from hyperqwen.engine.features import LOOKUP, FeatureSwitchError
from hyperqwen.launch import LOOKUP_MATCH

DRAFTS = 4
WIDTH = 2048  # max_model_len


def ngram_proposer(checkpoint, drafts: int):
    """The installed NgramProposer; it reads HYPERQWEN_LOOKUP per call (see `propose`). Needs
    the vllm_cpu_platform fixture."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    config = EngineArgs(
        model=str(checkpoint),
        language_model_only=True,
        max_model_len=WIDTH,
        max_num_seqs=4,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": drafts,
            "prompt_lookup_min": LOOKUP_MATCH[0],
            "prompt_lookup_max": LOOKUP_MATCH[1],
        },
    ).create_engine_config()
    with set_current_vllm_config(config):
        return NgramProposer(config)


def propose(proposer, contexts, sampled_rows, lookup_on: bool, drafts: int = DRAFTS):
    """The proposer's drafts for contexts laid out as vLLM keeps them (garbage past each row)."""
    tokens = np.random.default_rng(0).integers(0, 50_000, (len(contexts), WIDTH), dtype=np.int32)
    for row, context in enumerate(contexts):
        tokens[row, : len(context)] = context
    lengths = np.array([len(c) for c in contexts], dtype=np.int32)
    sampled = [[context[-1]] if row in sampled_rows else [] for row, context in enumerate(contexts)]
    with pytest.MonkeyPatch.context() as patch:
        if lookup_on:
            patch.setenv(LOOKUP.env, "1")
        else:
            patch.delenv(LOOKUP.env, raising=False)
        return proposer.propose(drafts, sampled, lengths, tokens)


def test_patched_proposer_drafts_the_longest_latest_match(tiny_checkpoint, vllm_cpu_platform):
    proposer = ngram_proposer(tiny_checkpoint, DRAFTS)
    text = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    contexts = [
        [*text, 5, 6, *text[:8]],  # copying text: an 8-token match
        [1, 2, 3, 4, 9, 1, 2, 3, 4, 8, 1, 2, 3],  # two matches of 3: the latest wins
        [7, 8, 9, 10],  # nothing repeats
        [30, 31, 32] * 3,  # periodic, but this row sampled nothing this step (still in prefill)
    ]
    drafts = propose(proposer, contexts, sampled_rows={0, 1, 2}, lookup_on=True)
    assert drafts[0] == [19, 20, 5, 6]
    assert drafts[1] == [4, 8, 1, 2]  # the latest "1 2 3", not the earliest
    assert drafts[2] == [] and drafts[3] == []
    for row in (0, 1):
        n, j = reference_match(contexts[row], *LOOKUP_MATCH)
        assert drafts[row] == reference_drafts(contexts[row], n, j, DRAFTS)


def test_unset_the_proposer_is_vllms(tiny_checkpoint, vllm_cpu_platform):
    """Without the env the hook is inert: vLLM's numba search, the earliest longest match."""
    proposer = ngram_proposer(tiny_checkpoint, DRAFTS)
    contexts = [[1, 2, 3, 4, 9, 1, 2, 3, 4, 8, 1, 2, 3]]
    assert propose(proposer, contexts, sampled_rows={0}, lookup_on=False) == [[4, 9, 1, 2]]


def test_lookup_drafts_only_with_the_env(monkeypatch):
    """The ngram_drafts seam hands vLLM's proposer back its own search unless LOOKUP is on."""
    monkeypatch.delenv(LOOKUP.env, raising=False)
    proposer = types.SimpleNamespace(min_n=3, max_n=12, max_model_len=64)
    context = np.array([[1, 2, 3, 4, 9, 1, 2, 3]], dtype=np.int32)
    arguments = (proposer, 1, [0], np.array([8]), context, 2)
    assert seams.ngram_drafts(*arguments) is None
    monkeypatch.setenv(LOOKUP.env, "1")
    assert seams.ngram_drafts(*arguments) == [[4, 9]]
    monkeypatch.setenv(LOOKUP.env, "auto")  # auto leaves vLLM's own n-gram search alone
    assert seams.ngram_drafts(*arguments) is None


def test_fused_with_mtp_the_accepted_tokens_land_and_copies_fill_the_slots():
    text = [41, 42, 43, 44, 45, 46, 47, 48]
    contexts = [
        [*text, 9, 9, *text[:5]],  # + accepted 46 47: a 7-token match, copied alone
        [1, 2, 3, 7, 1, 2],  # + accepted 3: "1 2 3" again, short; MTP agrees on 7
        [1, 2, 3, 7, 1, 2],  # the same, but MTP's first draft is 5: MTP's drafts stay
        [5, 6, 7, 8],  # discarded this step: nothing written, MTP's drafts
    ]
    sampled = torch.tensor(
        [[46, 47, -1, -1], [3, -1, -1, -1], [3, -1, -1, -1], [8, 8, -1, -1]], dtype=torch.int64
    )
    discard = torch.tensor([False, False, False, True])
    mtp = torch.tensor([[1, 2, 3], [7, 8, 9], [5, 8, 9], [1, 2, 3]], dtype=torch.int64)
    tokens = torch.randint(0, 50_000, (4, 64), dtype=torch.int32)
    for row, context in enumerate(contexts):
        tokens[row, : len(context)] = torch.tensor(context, dtype=torch.int32)
    lengths = torch.tensor([len(c) for c in contexts], dtype=torch.int32)

    before = tokens.clone()
    lengths = engine_lookup.write_accepted(sampled, discard, tokens, lengths, 50_000)
    drafts = engine_lookup.fuse_into_mtp(mtp, tokens, lengths)
    assert tokens[0, : len(contexts[0]) + 2].tolist() == [*contexts[0], 46, 47]
    assert tokens[1, :7].tolist() == [1, 2, 3, 7, 1, 2, 3]
    assert torch.equal(tokens[3], before[3])  # discarded: its sampled tokens are not real
    assert torch.equal(tokens[:, 17:], before[:, 17:])  # nothing past the new tokens moved
    assert drafts.dtype == torch.int64
    assert drafts.tolist() == [[48, 9, 9], [7, 1, 2], [5, 8, 9], [1, 2, 3]]


@pytest.mark.parametrize("value", ["1", "auto"])
def test_fusion_needs_mtp_with_greedy_drafts(monkeypatch, value):
    monkeypatch.setenv(LOOKUP.env, value)
    greedy = types.SimpleNamespace(method="mtp", draft_sample_method="greedy")
    assert seams.runner_keeps_ngram_buffer(greedy)
    assert not seams.runner_keeps_ngram_buffer(
        types.SimpleNamespace(method="mtp", draft_sample_method="probabilistic")
    )
    assert not seams.runner_keeps_ngram_buffer(
        types.SimpleNamespace(method="ngram_gpu", draft_sample_method="greedy")
    )
    monkeypatch.setenv(LOOKUP.env, "0")
    assert not seams.runner_keeps_ngram_buffer(greedy)
    monkeypatch.delenv(LOOKUP.env)
    assert not seams.runner_keeps_ngram_buffer(greedy)
    monkeypatch.setenv(LOOKUP.env, "true")  # refused by name, never read as off
    with pytest.raises(FeatureSwitchError, match="HYPERQWEN_LOOKUP='true'"):
        seams.runner_keeps_ngram_buffer(greedy)


def test_the_runner_keeps_the_token_buffer_and_fuses_after_mtp(patched_vllm):
    """patches/v1-runner.patch: the buffer is allocated with the MTP drafter, its upkeep is
    vLLM's n-gram flag, MTP is asked for the seam's count, the drafts are amended before anything
    reads them, and quoting's seams sit where vLLM's GPU n-gram drafter has its own hooks
    (after the CUDA graph dispatcher, a private scheduler output, the cut before the draft
    counts are restored)."""
    source = (patched_vllm / "v1" / "worker" / "gpu_model_runner.py").read_text()
    allocated = source.index("seams.runner_drafter_built(self)")
    assert source.rindex("self.drafter = EagleProposer(", 0, allocated) > allocated - 400
    assert "or seams.runner_keeps_ngram_buffer(self.speculative_config)" in source  # is_ngram_gpu
    mtp_call = "draft_token_ids = self.drafter.propose(\n" + " " * 16 + "num_speculative_tokens="
    proposed = source.index(mtp_call + "seams.runner_draft_count(")
    fused = source.index("draft_token_ids = seams.runner_drafted(", proposed)
    assert fused < source.index("return draft_token_ids", proposed)

    dispatcher = source.index("self.cudagraph_dispatcher = CudagraphDispatcher(self.vllm_config)")
    assert source.index("seams.runner_graphs_dispatched(self)") - dispatcher < 300
    copied = ") or seams.runner_copies_scheduler_output(self):"
    assert "and self.speculative_config.use_ngram_gpu()\n        " + copied in source
    cut = source.index("original_num_spec_per_req.update(seams.runner_cut_drafts(self, sched")
    assert source.index("update_scheduler_for_invalid_drafts(") < cut
    assert cut < source.index("orig = original_num_spec_per_req.get(req_id, 0)")


def test_filled_every_step_proposes_the_whole_block(monkeypatch):
    """LOOKUP_FILL=1 (HYPERQWEN_LOOKUP=fill): a match proposes what it proposes without it; no
    match proposes what followed the last token's latest earlier occurrence, else that token
    repeated; always the full width (so every step verifies one width), never past
    max_model_len."""
    drafts_per_row = 6
    text = list(range(100, 140))
    copying = np.array([*text, 7, *text[:8]], dtype=np.int32)
    last_seen = np.array([5, 9, 6, 8, 9, 3, 4, 9], dtype=np.int32)  # 9 seen twice before: latest
    unique = np.arange(500, 530, dtype=np.int32)

    def lookup(context, fill=True, max_model_len=WIDTH):
        return engine_lookup.propose(
            context, *LOOKUP_MATCH, drafts_per_row, max_model_len, fill=fill
        )

    assert lookup(copying) == lookup(copying, fill=False) == text[8 : 8 + drafts_per_row]
    assert lookup(last_seen, fill=False) == []
    assert lookup(last_seen) == [3, 4, 9, 3, 4, 9]  # after the latest earlier 9, periodically
    assert lookup(unique) == [529] * drafts_per_row
    assert lookup(unique, max_model_len=len(unique) + 2) == [529, 529]
    assert lookup(unique, max_model_len=len(unique)) == []
    assert lookup(np.array([], dtype=np.int32)) == []
    # through vLLM's proposer seam: every valid row drafts the full width, the others none
    proposer = types.SimpleNamespace(min_n=2, max_n=12, max_model_len=64)
    rows = np.zeros((2, 64), dtype=np.int32)
    rows[0, :8], rows[1, :5] = last_seen, unique[:5]
    arguments = (proposer, 2, [0], np.array([8, 5]), rows, 3)
    monkeypatch.setenv(LOOKUP.env, "fill")
    assert seams.ngram_drafts(*arguments) == [[3, 4, 9], []]
    monkeypatch.setenv(LOOKUP.env, "1")
    assert seams.ngram_drafts(*arguments) == [[], []]


def test_any_match_proposes_the_whole_block():
    """DRAFT_TOKENS=15: a long match and a chance one of 3 tokens both propose 15 drafts, none
    proposes nothing, and no draft passes max_model_len."""
    drafts_per_row = 15
    text = list(range(100, 140))
    copying = np.array([*text, 7, *text[:8]], dtype=np.int32)  # the last 8 tokens occurred before
    chance = np.array([*text[:20], 9, 8, *text[:3]], dtype=np.int32)  # a chance repeat of 3
    unique = np.arange(500, 530, dtype=np.int32)

    def lookup(context, max_model_len=WIDTH):
        return engine_lookup.propose(context, *LOOKUP_MATCH, drafts_per_row, max_model_len)

    assert lookup(copying) == text[8 : 8 + drafts_per_row]
    assert lookup(chance) == text[3 : 3 + drafts_per_row]
    assert lookup(unique) == []
    assert lookup(copying, max_model_len=len(copying) + 5) == text[8:13]
    assert lookup(copying, max_model_len=len(copying)) == []
