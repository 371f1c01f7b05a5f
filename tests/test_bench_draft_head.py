"""`bench draft-head`'s CPU side: the vLLM path it times is LocalArgmaxMixin's, the heads it
builds are int8 rows and their bf16 form, and its rows. The timing itself needs a GPU."""

from __future__ import annotations

import pytest
import torch

from hyperqwen.bench import draft_head
from hyperqwen.engine import draft_vocab


def test_the_timed_vllm_path_picks_what_the_full_vocabulary_argmax_picks():
    token_ids, heads = draft_head.make_heads(rows=96, hidden=256, copies=1, device="cpu")
    codes, scales, bf16 = heads[0]
    assert codes.dtype == torch.int8 and bf16.dtype == torch.bfloat16 and bf16.abs().max() > 0
    assert torch.equal(bf16, (codes.float() * scales.float().repeat_interleave(128, 1)).bfloat16())
    hidden = torch.randn((5, 256)).bfloat16()
    offsets = draft_vocab.target_offsets(token_ids)
    picked = draft_head.vllm_path(bf16, offsets)(hidden)
    logits = torch.nn.functional.linear(hidden, bf16)
    full = draft_vocab.full_vocab_logits(logits, token_ids, int(token_ids[-1]) + 1)
    assert torch.equal(picked, full.argmax(dim=-1))


RAW = {"rows": 200, "hidden": 256, "copy_gbps": 4000.0}


def test_rows_compare_each_batch_and_count_each_paths_bytes():
    entry = {"batch": 4, "vllm_us": 100.0, "fused_us": 50.0, "vllm_eager_us": 120.0,
             "fused_eager_us": 60.0, "fused_bytes": 1_000_000}  # fmt: skip
    raw = {"rows": 1000, "hidden": 1000, "copy_gbps": 4000.4, "batches": [entry]}
    rows = {row["name"]: row for row in draft_head.result_rows(raw)}
    assert rows["draft_head_b4"]["stock"] == 100.0 and rows["draft_head_b4"]["patched"] == 50.0
    assert rows["draft_head_eager_b4"]["patched"] == 60.0
    moved = rows["draft_head_moved_b4"]
    assert (moved["stock"], moved["patched"]) == (20.0, 20.0)  # 2 MB in 100 us, 1 MB in 50 us
    assert rows["copy_bandwidth"]["stock"] == 4000


@pytest.mark.usefixtures("interpreted")
def test_a_batch_is_checked_then_timed_on_both_paths():
    token_ids, heads = draft_head.make_heads(rows=200, hidden=256, device="cpu")
    timed = []

    def timer(launches):
        timed.append([launch() for launch in launches])  # each copy's launch runs
        return 10.0

    offsets = draft_vocab.target_offsets(token_ids)
    # Marlin needs a GPU: the bf16 path stands in for it, to run the third path's plumbing
    other = [draft_head.vllm_path(bf16, offsets) for _, _, bf16 in heads]
    entry = draft_head.measure_batch(
        token_ids, heads, 3, lambda line: None, timer, lambda call, hidden: 2.0, "cpu", other
    )
    assert len(timed) == 3 and all(len(copies) == draft_head.COPIES for copies in timed)
    assert entry["marlin_agree_with_vllm_path"] == 1.0 and entry["marlin_eager_us"] == 2.0
    names = {row["name"] for row in draft_head.result_rows({**RAW, "batches": [entry]})}
    assert {"draft_head_marlin_b3", "draft_head_marlin_eager_b3"} <= names
    assert entry["worst_gap_to_float64_best"] <= 1e-6 and entry["agree_with_vllm_path"] > 0.5
    assert entry["fused_bytes"] == 200 * 256 + 200 * 2 * 2
    assert entry["vllm_us"] == entry["fused_us"] == 10.0 and entry["fused_eager_us"] == 2.0
