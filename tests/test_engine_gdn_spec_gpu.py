"""The patched GDN metadata builder prepares a decode-only spec step without a CPU-GPU sync.

torch.cuda's sync debug mode turns every synchronizing call into an error: the wheel's own
builder (indexing GPU tensors with a CPU mask) must trip it, so the check can fail, and the
patched one must not, on the batch shape of a single-profile decode step (MTP k=3, one request
and padded rows).
"""

from __future__ import annotations

import pytest
from gpu_server import stock_vllm_parent
from test_engine_gdn_spec import batch, make_builders, synth_config

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def builders(tmp_path_factory):
    """Run with the patched vLLM importable (first on PYTHONPATH) and the stock one as
    $HYPERQWEN_STOCK_VLLM, e.g. the gpu-kit's vllm-patched and vllm-stock."""
    config_dir = synth_config(tmp_path_factory.mktemp("synth") / "tiny")
    pristine = stock_vllm_parent() / "vllm"
    patched, pristine = make_builders(config_dir, pristine, "cuda")
    return {"patched": patched, "pristine": pristine}


def build_without_sync(builder, query_lens, seq_lens, drafts):
    metadata, accepted, draft_counts = batch(query_lens, seq_lens, drafts, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return builder.build(
            0, metadata, num_accepted_tokens=accepted, num_decode_draft_tokens_cpu=draft_counts
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "drafts"),
    [([4], [130], [3]), ([4, 4, 0, 0], [130, 600, 0, 0], [3, 3, -1, -1])],
)
def test_decode_only_spec_step_builds_without_a_sync(builders, query_lens, seq_lens, drafts):
    with pytest.raises(RuntimeError, match="synchroniz"):
        build_without_sync(builders["pristine"], query_lens, seq_lens, drafts)
    result = build_without_sync(builders["patched"], query_lens, seq_lens, drafts)
    assert result.num_spec_decodes == sum(d >= 0 for d in drafts)
