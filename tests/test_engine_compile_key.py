"""vLLM's torch.compile cache key sees HyperQwen's graph-changing engine switches
(patches/compile-cache-key.patch): the installed vLLM's own envs.compile_factors, hashed the way
its compile cache hashes them."""

from __future__ import annotations

import pytest

from hyperqwen.engine.features import FEATURES, GDN_BA, ON, W4A16_LINEAR


@pytest.mark.parametrize("feature", [W4A16_LINEAR, GDN_BA], ids=lambda f: f.name)
def test_turning_a_switch_on_changes_the_compile_cache_key(monkeypatch, feature):
    from vllm import envs
    from vllm.config.utils import hash_factors

    for each in FEATURES:
        monkeypatch.delenv(each.env, raising=False)
    off = envs.compile_factors()
    monkeypatch.setenv(feature.env, ON)
    on = envs.compile_factors()
    assert off[feature.env] is None and on[feature.env] == ON
    assert hash_factors(on) != hash_factors(off)
    assert {k: v for k, v in on.items() if k != feature.env} == {
        k: v for k, v in off.items() if k != feature.env
    }  # vLLM's own factors unchanged


def test_the_key_holds_exactly_the_graph_changing_switches(monkeypatch):
    from vllm import envs

    for each in FEATURES:
        monkeypatch.delenv(each.env, raising=False)
    factors = envs.compile_factors()
    for feature in FEATURES:
        assert (feature.env in factors) is feature.changes_compiled_graph, feature.name
