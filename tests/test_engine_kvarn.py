"""KV=kvarn's engine module (engine/kvarn.py) at its seam: with HYPERQWEN_KV_KVARN=1 the
attention_kv_spec seam (attention-kv-spec.patch: vLLM's Attention layer and its hybrid page
alignment) gives KVarN's uint8 pages for a layer on KVarN's backend, and vLLM's own spec for any
other backend. Switched off, the seam is vLLM's path and imports nothing
(test_engine_seams.py); vLLM's alignment and KV cache config with it: test_capacity.py."""

from __future__ import annotations

from hyperqwen.engine import seams
from hyperqwen.engine.features import KVARN
from hyperqwen.kvarn.backend import KVarNBackend
from hyperqwen.kvarn.layout import TileLayout


def test_the_seam_sizes_kvarn_pages_only_for_its_backend(monkeypatch):
    monkeypatch.setenv(KVARN.env, "1")
    spec = seams.attention_kv_spec(KVarNBackend, 256, 4, 256)
    assert spec == KVarNBackend.kv_cache_spec(256, 4, 256)
    # the hybrid alignment asks at block_size 1: the pool's bytes per token of a layer
    per_token = seams.attention_kv_spec(KVarNBackend, 1, 4, 256).page_size_bytes
    assert per_token == 4 * TileLayout(head_dim=256).slot_bytes
    assert seams.attention_kv_spec(object, 256, 4, 256) is None
