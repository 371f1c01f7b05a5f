"""The MTP draft vocabulary's CPU side: reading prepare's draft head, the id remap, the logits.

The install into a running vLLM drafter and the greedy-equivalence proof run on the GPU
(test_engine_draft_vocab_gpu.py); here: what install() builds on, on real prepared files.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from test_prepare_common import GEOMETRY, prepare_copy, tiny_base_dir

from hyperqwen.checkpoint import shards, w4a16 as checkpoint_format
from hyperqwen.engine import draft_vocab
from hyperqwen.engine.features import DRAFT_VOCAB, FeatureSwitchError, env_value
from hyperqwen.prepare import folder


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare_copy(
        tiny_base_dir(tmp_path_factory), tmp_path_factory.mktemp("draft-vocab") / "model"
    )


def test_reads_the_prepared_head_rows_of_the_draft_ids(prepared):
    head = draft_vocab.load_draft_head(
        prepared / folder.DRAFT_HEAD_FILE,
        GEOMETRY.vocab_size,
        GEOMETRY.hidden_size,
        torch.bfloat16,
    )
    ids = [
        int(line)
        for line in (prepared / folder.DRAFT_IDS_FILE).read_text().splitlines()
        if not line.startswith("#")
    ]
    assert head.token_ids.tolist() == ids and len(ids) == 40_960
    lm_head = checkpoint_format.read_linear(shards.ShardedReader(prepared), "lm_head")
    assert torch.equal(head.weight, lm_head[head.token_ids])  # int8 rows, dequantized alike
    assert torch.equal(head.token_ids, torch.arange(len(ids)) + head.offsets)


def test_int8_rows_are_the_prepared_rows_before_dequantization(prepared, tmp_path):
    path = prepared / folder.DRAFT_HEAD_FILE
    args = (GEOMETRY.vocab_size, GEOMETRY.hidden_size)
    token_ids, codes, scales = draft_vocab.load_int8_rows(path, *args, fix="the fix")
    head = draft_vocab.load_draft_head(path, *args, torch.float32)
    assert torch.equal(token_ids, head.token_ids)
    assert codes.dtype == torch.int8 and codes.shape == (40_960, GEOMETRY.hidden_size)
    assert codes.abs().max() > 100  # group-scaled codes span the int8 range
    assert scales.shape == (40_960, GEOMETRY.hidden_size // 128)
    rows = codes.float() * scales.float().repeat_interleave(128, dim=1)
    assert torch.allclose(rows, head.weight, rtol=1 / 128, atol=0)  # bf16 rounding of load
    bf16 = write_head(tmp_path / folder.DRAFT_HEAD_FILE, token_ids, head.weight.bfloat16())
    with pytest.raises(draft_vocab.DraftVocabError, match=r"holds 16-bit rows.*; the fix"):
        draft_vocab.load_int8_rows(bf16, *args, fix="the fix")


def test_int8_draft_head_serves_only_a_folder_with_int8_rows(prepared, tmp_path):
    """DRAFT_HEAD_INT8's check before vLLM starts, from the file's header: a prepared folder
    serves; a missing head or bf16 rows are refused naming the file and the knob."""
    from hyperqwen.engine import draft_head_int8

    assert draft_head_int8.serve_refusal("1", [], prepared) is None
    assert draft_head_int8.serve_refusal("0", [], tmp_path) is None
    missing = draft_head_int8.serve_refusal("1", [], tmp_path)
    assert "does not exist" in missing and "DRAFT_HEAD_INT8=0" in missing
    head = draft_vocab.load_draft_head(
        prepared / folder.DRAFT_HEAD_FILE, GEOMETRY.vocab_size, GEOMETRY.hidden_size, torch.float32
    )
    write_head(tmp_path / folder.DRAFT_HEAD_FILE, head.token_ids, head.weight.bfloat16())
    bf16 = draft_head_int8.serve_refusal("1", [], tmp_path)
    assert "holds 16-bit rows" in bf16 and str(tmp_path) in bf16 and "DRAFT_HEAD_INT8=0" in bf16


def test_greedy_remap_and_full_logits_pick_what_the_draft_rows_pick():
    gen = torch.Generator().manual_seed(5)
    vocab_size = 1000
    token_ids = torch.sort(torch.randperm(vocab_size, generator=gen)[:96]).values
    head = draft_vocab.DraftHead(token_ids, torch.zeros(96, 8))
    draft_logits = torch.randn((7, 96), generator=gen)
    full = draft_vocab.full_vocab_logits(draft_logits, token_ids, vocab_size)
    best = draft_logits.argmax(dim=-1)
    # LocalArgmaxMixin's remap (k + offsets[k]) and the full-vocabulary argmax agree
    assert torch.equal(best + head.offsets[best], full.argmax(dim=-1))
    assert torch.equal(full[:, token_ids], draft_logits)
    outside = torch.ones(vocab_size, dtype=torch.bool)
    outside[token_ids] = False
    assert torch.isneginf(full[:, outside]).all()
    probs = torch.softmax(full, dim=-1)  # what a sampled draft draws from: the same, restricted
    assert torch.allclose(probs[:, token_ids], torch.softmax(draft_logits, dim=-1))
    assert not probs[:, outside].any()


def write_head(path, token_ids, weight):
    save_file({"draft_head.token_ids": token_ids, "draft_head.weight": weight}, str(path))
    return path


@pytest.mark.parametrize(
    ("token_ids", "rows", "message"),
    [
        (torch.tensor([3, 2, 9]), (3, 8), "not strictly increasing"),
        (torch.tensor([3, 5, 1000]), (3, 8), "outside the model's vocabulary of 1000"),
        (torch.tensor([1, 2, 3]), (3, 16), r"rows have shape \[3, 16\], expected \[3, 8\]"),
    ],
)
def test_refuses_a_broken_head_naming_file_and_fix(tmp_path, token_ids, rows, message):
    path = write_head(tmp_path / folder.DRAFT_HEAD_FILE, token_ids, torch.randn(rows))
    with pytest.raises(draft_vocab.DraftVocabError, match=message) as refused:
        draft_vocab.load_draft_head(path, 1000, 8, torch.bfloat16)
    assert str(path) in str(refused.value) and "DRAFT_VOCAB=off" in str(refused.value)


def test_refuses_a_head_without_rows(tmp_path):
    path = tmp_path / folder.DRAFT_HEAD_FILE
    save_file({"draft_head.token_ids": torch.tensor([1, 2])}, str(path))
    with pytest.raises(draft_vocab.DraftVocabError, match=r"neither draft_head\.weight"):
        draft_vocab.load_draft_head(path, 1000, 8, torch.bfloat16)


def test_knob_reads_auto_by_default_and_refuses_other_words(monkeypatch):
    monkeypatch.delenv(DRAFT_VOCAB.env, raising=False)
    assert env_value(DRAFT_VOCAB) == "auto"
    monkeypatch.setenv(DRAFT_VOCAB.env, "off")
    assert env_value(DRAFT_VOCAB) == "off"
    monkeypatch.setenv(DRAFT_VOCAB.env, "on")
    with pytest.raises(FeatureSwitchError, match="expected one of auto, off"):
        env_value(DRAFT_VOCAB)


@pytest.mark.parametrize(
    ("path", "after"),
    [
        ("v1/spec_decode/llm_base_proposer.py", "self._maybe_share_lm_head(target_language_model)"),
        (  # the V2 runner (VLLM_USE_V2_MODEL_RUNNER=1) has its own speculator
            "v1/worker/gpu/spec_decode/speculator.py",
            "self.model = self.load_draft_model(target_model, target_attn_layer_names)",
        ),
    ],
)
def test_both_runners_install_the_draft_vocabulary_once_the_drafter_is_loaded(
    patched_vllm, path, after
):
    """The proposer_loaded seam (install() here) needs the loaded drafter (proposer.model) and
    vllm_config, and sets use_local_argmax_reduction, which both runners read when they draft
    greedily."""
    source = (patched_vllm / path).read_text()
    loaded = source.index(after)
    hook = source.index("seams.proposer_loaded(self)", loaded)
    assert hook - loaded < 400
    assert "use_local_argmax_reduction" in source
