"""GDN spec-decode metadata without the CPU-mask index (engine/gdn_spec.py and its patch).

The patched GDNAttentionMetadataBuilder of the installed vLLM runs on vLLM's CPU platform beside
the wheel's own gdn_attn.py, on the same batches: a decode-only spec step with a padded row (the
slice path) and a mixed step whose spec rows do not lead (the mask path). Both must give the
same state slots and accepted counts. That the slice path no longer synchronizes is checked on
the GPU (test_engine_gdn_spec_gpu.py); a CPU has no stream to wait on.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hyperqwen.engine.gdn_spec import spec_rows

NUM_SPEC = 3


def test_leading_spec_rows_become_a_slice_and_others_stay_a_mask():
    leading = torch.tensor([True, True, True, False])
    assert spec_rows(leading, 3) == slice(0, 3)
    scattered = torch.tensor([True, False, True])
    assert spec_rows(scattered, 2) is scattered
    table = torch.randint(0, 1000, (4, 5))
    assert torch.equal(table[spec_rows(leading, 3)], table[leading])


def synth_config(directory):
    """A tiny Qwen3.5 checkpoint's config and tokenizer (hyperqwen synth --config-only)."""
    command = [sys.executable, "-m", "hyperqwen.cli", "synth", str(directory), "--config-only"]
    subprocess.run(command, check=True, capture_output=True)
    return directory


def make_builders(config_dir, pristine_vllm_dir, device: str):
    """(patched, pristine) GDN metadata builders of one MTP k=3 config on this platform: the
    importable vLLM's (patched) and pristine_vllm_dir's gdn_attn.py beside it."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends import gdn_attn
    from vllm.v1.kv_cache_interface import MambaSpec

    patched_source = Path(gdn_attn.__file__).read_text()
    assert "hyperqwen.engine.gdn_spec" in patched_source, "the series is not applied"
    source = pristine_vllm_dir / "v1" / "attention" / "backends" / "gdn_attn.py"
    spec = importlib.util.spec_from_file_location("pristine_gdn_attn", source)
    pristine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pristine)

    config = EngineArgs(
        model=str(config_dir),
        language_model_only=True,
        max_model_len=2048,
        max_num_seqs=4,
        speculative_config={"method": "mtp", "num_speculative_tokens": NUM_SPEC},
    ).create_engine_config()
    kv_spec = MambaSpec(
        block_size=2048,
        shapes=((4, 4),),
        dtypes=(torch.float32,),
        num_speculative_blocks=NUM_SPEC,
    )
    with set_current_vllm_config(config):
        return tuple(
            module.GDNAttentionMetadataBuilder(kv_spec, ["layer"], config, torch.device(device))
            for module in (gdn_attn, pristine)
        )


@pytest.fixture(scope="module")
def builders(tmp_path_factory, pristine_vllm_dir):
    """The builders on vLLM's CPU platform."""
    import vllm.platforms as platforms
    import vllm.utils.torch_utils as torch_utils
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    config_dir = synth_config(tmp_path_factory.mktemp("synth") / "tiny")
    # decided at import, before the platform was set: the CPU platform pins no memory
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_utils, "PIN_MEMORY", False)
        yield make_builders(config_dir, pristine_vllm_dir, "cpu")


def batch(query_lens: list[int], seq_lens: list[int], drafts: list[int], device: str = "cpu"):
    """CommonAttentionMetadata of one step plus the builder's spec inputs, random block ids; the
    draft counts stay on the CPU, as the runner passes them."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(sum(seq_lens))
    metadata = CommonAttentionMetadata(
        query_start_loc=starts.to(device),
        query_start_loc_cpu=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        num_reqs=len(query_lens),
        num_actual_tokens=int(starts[-1]),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.randint(1, 500, (len(query_lens), 1 + NUM_SPEC), generator=gen)
        .int()
        .to(device),
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64, device=device),
    )
    accepted = torch.randint(1, NUM_SPEC + 2, (len(query_lens),), generator=gen).int().to(device)
    return metadata, accepted, torch.tensor(drafts, dtype=torch.int32)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "drafts", "leading"),
    [
        ([4, 4, 4, 0], [20, 31, 42, 0], [3, 3, 3, -1], True),  # decode-only, one padded row
        ([4], [9], [3], True),
        ([4, 7, 4], [20, 7, 40], [3, -1, 3], False),  # a prefill between two spec decodes
    ],
)
def test_patched_builder_selects_the_rows_the_pristine_one_does(
    builders, query_lens, seq_lens, drafts, leading
):
    patched, pristine = builders
    metadata, accepted, draft_counts = batch(query_lens, seq_lens, drafts)
    results = [
        builder.build(
            0,
            metadata,
            num_accepted_tokens=accepted.clone(),
            num_decode_draft_tokens_cpu=draft_counts,
        )
        for builder in (patched, pristine)
    ]
    spec_mask = draft_counts >= 0
    assert isinstance(spec_rows(spec_mask, int(spec_mask.sum())), slice) is leading
    expected_slots = metadata.block_table_tensor[spec_mask, : NUM_SPEC + 1]
    for result in results:
        assert torch.equal(result.spec_state_indices_tensor, expected_slots)
        assert result.spec_state_indices_tensor.is_contiguous()
        assert torch.equal(result.num_accepted_tokens, accepted[spec_mask])
        assert result.num_spec_decodes == int(spec_mask.sum())
