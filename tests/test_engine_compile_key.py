"""vLLM's torch.compile cache key sees HyperQwen's engine switches
(patches/compile-cache-key.patch): the installed vLLM's own envs.compile_factors, hashed the way
its compile cache hashes them."""

from __future__ import annotations

import pytest

from hyperqwen.engine import ENGINE_SWITCHES, GDN_BA_ENV, W4A16_ENV


@pytest.mark.parametrize("switch", [W4A16_ENV, GDN_BA_ENV])
def test_turning_a_switch_on_changes_the_compile_cache_key(monkeypatch, switch):
    from vllm import envs
    from vllm.config.utils import hash_factors

    for name in ENGINE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    off = envs.compile_factors()
    monkeypatch.setenv(switch, "1")
    on = envs.compile_factors()
    assert off[switch] is None and on[switch] == "1"
    assert hash_factors(on) != hash_factors(off)
    assert {k: v for k, v in on.items() if k != switch} == {
        k: v for k, v in off.items() if k != switch
    }  # vLLM's own factors unchanged
