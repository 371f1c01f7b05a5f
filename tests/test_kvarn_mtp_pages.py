"""KV=kvarn with SPEC=mtp: the MTP drafter's attention layer must take KVarN's pages too, or
vLLM cannot unify its page with the target's KVarN pages and the GDN state.

vLLM never gives the drafter `--attention-backend` (v1/spec_decode/llm_base_proposer.py:
`SpecDecodeBaseProposer._create_draft_vllm_config`): its backend is `--speculative-config
attention_backend`, else its own selector's pick (FLASH_ATTN on an H200). So before the launcher
named KVarN there, the MTP layer got 16-bit pages; at the block size the hybrid alignment picked
for KVarN's pages a 16-bit page is the largest, KVarN's does not divide it, and
`unify_kv_cache_spec_page_size` (v1/core/kv_cache_utils.py) refused KVarN's layers: the
server's engine core died at start (2026-12-03, `tests/test_kvarn_serve_gpu.py -k mtp`).

Here the launcher's own argv goes through vLLM's parser and config, vLLM's drafter config, vLLM's
Attention layers (their specs through the attention_kv_spec seam), vLLM's hybrid alignment and
vLLM's KV cache config, on the CPU platform, for the tiny preset and the 27B's geometry.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_capacity import gdn_state_spec

from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.synthesize import synthesize
from hyperqwen.engine.features import FEATURES, KVARN
from hyperqwen.kv_choices import CUSTOM, KVARN_CHOICE, KVARN_MAX_DRAFTS
from hyperqwen.kvarn.backend import KVarNBackend
from hyperqwen.kvarn.layout import TileLayout
from hyperqwen.launch import build_launch
from hyperqwen.settings import LoadedSettings, Settings

GiB = 1 << 30


@pytest.fixture(scope="module", params=["tiny", "27b"])
def preset(request, tmp_path_factory, vllm_cpu_platform):
    """(name, a config-only checkpoint of the preset: vLLM reads its config, no weights)."""
    directory = tmp_path_factory.mktemp("mtp-pages") / request.param
    synthesize(directory, PRESETS[request.param], config_only=True, progress=False)
    return request.param, directory


@pytest.fixture(autouse=True)
def kvarn_registered(monkeypatch):
    """What the package's vLLM plugin does under KV=kvarn: the switch on, KVarN under CUSTOM."""
    from hyperqwen.engine.kvarn import register

    monkeypatch.setenv(KVARN.env, "1")
    register()


def served_config(vllm_serve, model, drafts: int, drafter_backend: bool = True, monkeypatch=None,
                  **more_knobs):  # fmt: skip
    """vLLM's config from the launcher's argv for KV=kvarn, SPEC=mtp (and `more_knobs`), as
    `vllm serve` builds it; with `drafter_backend=False`, the speculative config as it was
    before (no backend). With monkeypatch, the engine features' variables of the launcher's
    environment are set in this process, as `hyperqwen serve` gives them to vLLM's."""
    import json

    from vllm.engine.arg_utils import EngineArgs

    knobs = {"KV": KVARN_CHOICE, "SPEC": "mtp", "DRAFT_TOKENS": str(drafts), "MODEL": str(model)}
    knobs |= {"MAX_LEN": "2048", "MAX_SEQS": "2", **more_knobs}
    plan = build_launch(
        LoadedSettings(Settings.model_validate(knobs), frozenset(knobs)), "single", None
    )
    argv = plan.argv
    for name in (feature.env for feature in FEATURES if monkeypatch and feature.env in plan.env):
        monkeypatch.setenv(name, plan.env[name])
    if not drafter_backend:
        at = argv.index("--speculative-config") + 1
        spec = json.loads(argv[at])
        assert spec.pop("attention_backend") == CUSTOM
        argv[at] = json.dumps(spec)
    args = vllm_serve(argv)
    args.model = args.model_tag  # what `vllm serve` does with its positional model
    return EngineArgs.from_cli_args(args).create_engine_config()


def drafter_config(config):
    """vLLM's own config for the drafter's layers: MTP's proposer's method (the runner builds an
    EagleProposer for MTP; it inherits the method, which reads only these two attributes of the
    proposer; the proposer itself needs a device to construct)."""
    from vllm.v1.spec_decode.eagle import EagleProposer

    proposer = SimpleNamespace(speculative_config=config.speculative_config, vllm_config=config)
    return EagleProposer._create_draft_vllm_config(proposer)


def attention_layer(config, name: str, geometry):
    """vLLM's Attention layer under `config`, on the backend CUDA's selector takes for it: the
    configured one as is (platforms/cuda.py: get_attn_backend_cls); with none configured the
    platform's pick, on the CPU platform CPU_ATTN, which gets vLLM's 16-bit spec from the cache
    dtype as FLASH_ATTN does on a GPU (the seam answers for KVarN's backend only)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    chosen = config.attention_config.backend
    with set_current_vllm_config(config):
        return Attention(
            geometry.num_attention_heads, geometry.head_dim, geometry.head_dim**-0.5,
            num_kv_heads=geometry.num_key_value_heads, cache_config=config.cache_config,
            prefix=name, attn_backend=chosen.get_class() if chosen else None,
        )  # fmt: skip


def kv_cache_specs(config, geometry):
    """Every KV cache layer's spec as the runner collects them: the target's full-attention
    layers, the MTP drafter's, each from its Attention layer after vLLM's hybrid alignment,
    and the GDN layers' state (MambaBase.get_kv_cache_spec's fields); and the drafter's config.
    In the runner's order: the drafter's config is made when its model loads, before the
    alignment (making it re-runs the platform's config checks, which on the CPU platform reset
    the shared cache config's block size)."""
    from vllm.platforms import current_platform

    drafter = drafter_config(config)
    full = [i for i, kind in enumerate(geometry.layer_types) if kind == "full_attention"]
    target_names = [f"language_model.model.layers.{i}.self_attn.attn" for i in full]
    drafter_names = [
        f"mtp.layers.{i}.self_attn.attn" for i in range(geometry.mtp_num_hidden_layers)
    ]
    layers = {name: attention_layer(config, name, geometry) for name in target_names}
    layers |= {name: attention_layer(drafter, name, geometry) for name in drafter_names}
    # as the runner does after loading both models (gpu_model_runner: the first non-SSM layer's
    # backend sets the block size, the GDN state page padded to the attention page)
    current_platform.update_block_size_for_backend(config)
    specs = {
        name: layer.get_kv_cache_spec(drafter if name in drafter_names else config)
        for name, layer in layers.items()
    }
    state = gdn_state_spec(config, config.speculative_config.num_speculative_tokens)
    gdn = [i for i, kind in enumerate(geometry.layer_types) if kind == "linear_attention"]
    specs |= {f"language_model.model.layers.{i}.linear_attn": state for i in gdn}
    return specs, drafter


@pytest.mark.parametrize("drafts", [1, KVARN_MAX_DRAFTS])
def test_vllm_unifies_the_drafters_kvarn_pages_with_the_targets(preset, vllm_serve, drafts):
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import MambaSpec

    name, model = preset
    geometry = PRESETS[name]
    config = served_config(vllm_serve, model, drafts)
    specs, drafter = kv_cache_specs(config, geometry)
    block_size = config.cache_config.block_size
    (kv_cache,) = get_kv_cache_configs(config, [specs], [GiB])  # raised before the fix

    assert drafter.attention_config.backend.get_class() is KVarNBackend
    kvarn = KVarNBackend.kv_cache_spec(block_size, geometry.num_key_value_heads, geometry.head_dim)
    attention = {n: s for n, s in specs.items() if not isinstance(s, MambaSpec)}
    assert len(attention) == geometry.layer_types.count("full_attention") + (
        geometry.mtp_num_hidden_layers
    )
    assert all(spec == kvarn for spec in attention.values())  # the drafter's too
    grouped = [n for group in kv_cache.kv_cache_groups for n in group.layer_names]
    assert sorted(grouped) == sorted(specs)
    layout = TileLayout(head_dim=geometry.head_dim)
    for group in kv_cache.kv_cache_groups:
        spec = group.kv_cache_spec
        # one page size for all; KVarN's unpadded: a block is whole 128-token tiles per head
        assert spec.page_size_bytes == kvarn.page_size_bytes
        if not isinstance(spec, MambaSpec):
            assert spec == kvarn and block_size % layout.tokens == 0
            tiles = block_size // layout.tokens
            assert spec.page_size_bytes == tiles * geometry.num_key_value_heads * layout.tile_bytes


def test_3_bit_values_reach_vllms_pages_through_the_launchers_environment(
    preset, vllm_serve, monkeypatch
):
    """KVARN_V_BITS=3: the launcher's variable gives every KVarN layer, the drafter's too,
    tiles of 3-bit values, and vLLM's alignment and unification size the pool with them."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import MambaSpec

    name, model = preset
    geometry = PRESETS[name]
    config = served_config(vllm_serve, model, KVARN_MAX_DRAFTS, monkeypatch=monkeypatch,
                           KVARN_V_BITS="3")  # fmt: skip
    specs, _ = kv_cache_specs(config, geometry)
    (kv_cache,) = get_kv_cache_configs(config, [specs], [GiB])
    layout = TileLayout(head_dim=geometry.head_dim, v_bits=3)
    tiles = config.cache_config.block_size // layout.tokens
    page = tiles * geometry.num_key_value_heads * layout.tile_bytes
    attention = [s for s in specs.values() if not isinstance(s, MambaSpec)]
    assert all(spec.tq_slot_size == layout.slot_bytes for spec in attention)
    assert {group.kv_cache_spec.page_size_bytes for group in kv_cache.kv_cache_groups} == {page}


def test_without_the_drafters_backend_vllm_refuses_kvarns_pages(preset, vllm_serve):
    """The speculative config as it was before the fix: the drafter's layer on vLLM's selector
    gets 16-bit pages, and vLLM's own unification refuses KVarN's (the H200's error)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    name, model = preset
    config = served_config(vllm_serve, model, KVARN_MAX_DRAFTS, drafter_backend=False)
    specs, drafter = kv_cache_specs(config, PRESETS[name])
    assert drafter.attention_config.backend is None
    with pytest.raises(NotImplementedError, match="cannot be padded"):
        get_kv_cache_configs(config, [specs], [GiB])
