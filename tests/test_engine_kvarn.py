"""KV=kvarn's engine module (engine/kvarn.py) at its seam: with HYPERQWEN_KV_KVARN=1 the
attention_kv_spec seam (attention-kv-spec.patch: vLLM's Attention layer and its hybrid page
alignment) gives KVarN's uint8 pages for a layer on KVarN's backend, and vLLM's own spec for any
other backend, also through vLLM's own Attention layer (the patched vLLM must be the importable
one, as install.sh leaves it). Switched off, the seam is vLLM's path and imports nothing
(test_engine_seams.py); vLLM's alignment and KV cache config with it: test_capacity.py."""

from __future__ import annotations

import pytest

from hyperqwen.engine import seams
from hyperqwen.engine.features import KVARN, KVARN_V_BITS
from hyperqwen.kvarn.backend import KVarNBackend, KVarNImpl
from hyperqwen.kvarn.layout import TileLayout
from hyperqwen.patches.tree import series_status


def test_the_seam_sizes_kvarn_pages_only_for_its_backend(monkeypatch):
    monkeypatch.setenv(KVARN.env, "1")
    spec = seams.attention_kv_spec(KVarNBackend, 256, 4, 256)
    assert spec == KVarNBackend.kv_cache_spec(256, 4, 256)
    # the hybrid alignment asks at block_size 1: the pool's bytes per token of a layer
    per_token = seams.attention_kv_spec(KVarNBackend, 1, 4, 256).page_size_bytes
    assert per_token == 4 * TileLayout(head_dim=256).slot_bytes
    assert seams.attention_kv_spec(object, 256, 4, 256) is None


def test_the_seam_sizes_3_bit_pages_with_kvarn_v_bits_3(monkeypatch):
    """The variable the launcher sets from KVARN_V_BITS: the seam's pages, and so vLLM's hybrid
    alignment's bytes per token, are those of 3-bit values."""
    monkeypatch.setenv(KVARN.env, "1")
    monkeypatch.setenv(KVARN_V_BITS.env, "3")
    per_token = seams.attention_kv_spec(KVarNBackend, 1, 4, 256).page_size_bytes
    assert per_token == 4 * TileLayout(head_dim=256, v_bits=3).slot_bytes == 4 * 238


@pytest.mark.parametrize("switch", ["1", "0"])
def test_vllms_attention_layer_on_kvarn_takes_its_impl_and_pages(
    vllm_cpu_platform, monkeypatch, switch
):
    """vLLM's own Attention layer built on KVarN's backend (as `--attention-backend CUSTOM`
    gives it): KVarN's impl, the CUSTOM enum member, and through the patched
    get_kv_cache_spec KVarN's pages; with the variable off the seam is silent and vLLM sizes
    16-bit pages (which is why the launcher sets both)."""
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    applied, detail = series_status()
    assert applied, f"the importable vLLM is not patched ({detail}): hyperqwen patches apply"
    monkeypatch.setenv(KVARN.env, switch)
    config = VllmConfig(cache_config=CacheConfig(block_size=256))
    with set_current_vllm_config(config):
        layer = Attention(
            4, 256, 256**-0.5, num_kv_heads=2, cache_config=config.cache_config,
            prefix=f"model.layers.{switch}.self_attn.attn", attn_backend=KVarNBackend,
        )  # fmt: skip
    assert isinstance(layer.impl, KVarNImpl) and layer.backend.name == "CUSTOM"
    spec = layer.get_kv_cache_spec(config)
    if switch == "1":
        assert spec == KVarNBackend.kv_cache_spec(256, 2, 256)
    else:
        # the 16-bit pages of the layer's dtype (a config without a model: fp16)
        assert type(spec).__name__ == "FullAttentionSpec" and spec.dtype.itemsize == 2
