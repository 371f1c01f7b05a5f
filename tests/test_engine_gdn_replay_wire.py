"""The replay verify wired into vLLM 0.26 (engine/gdn_replay*.py): the state page, the builder,
and the layer's verify seam, each driven with vLLM's own classes on the CPU.

The page: a vLLM GDN layer (QwenGatedDeltaNetAttention, its own methods, with the attributes
its constructor sets) and vLLM's Qwen3.5 model class, switched and not, at the 27B's and the
tiny preset's geometry: the spec's shapes, page size, blocks per request and memory per
request against capacity.py's arithmetic. The builder: vLLM's GDN builder under ours, over
test_engine_gdn_replay.py's seven steps, with and without FULL-graph padding; the record must
not move in a CUDA-graph capture nor in a dummy run on the null block. Also: the layer refuses
prefix caching's "all" mode and architectures without the replay page, the model's `align`
copy functions are the conv state's, the launcher switches it on with or without prefix
caching, the plugin's registrations land in vLLM's registries, and the seam refuses metadata
without a plan. The seam over a run of steps against
vLLM's per-token path: test_engine_gdn_replay_seam.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from test_engine_gdn_replay import (
    DRAFTS,
    PADDING,
    SAVED_AFTER,
    SLOTS,
    STEPS,
    Row,
    metadata,
    platforms_pin_memory,
    verify,
)

from hyperqwen.capacity import replay_buffer_bytes
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.engine.gdn_replay import NULL_SLOT

BLOCK = 16


@pytest.fixture(scope="module")
def vllm_on_cpu(vllm_cpu_platform):
    import vllm.utils.torch_utils as torch_utils
    import vllm.v1.attention.backends.utils as backend_utils

    # as test_engine_gdn_replay.py: the CPU platform's pinned-memory answer
    with pytest.MonkeyPatch.context() as patch:
        for module in (torch_utils, backend_utils):
            patch.setattr(module, "PIN_MEMORY", platforms_pin_memory())
        yield


def vllm_config(drafts: int, cudagraph_mode: str = "NONE", tp: int = 1):
    from vllm.config import SpeculativeConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    speculative = None
    if drafts:
        speculative = SpeculativeConfig(
            method="ngram", num_speculative_tokens=drafts, prompt_lookup_max=3, prompt_lookup_min=2
        )
    config = VllmConfig(speculative_config=speculative)
    config.compilation_config.cudagraph_mode = CUDAGraphMode[cudagraph_mode]
    config.cache_config.mamba_block_size = BLOCK
    config.parallel_config.tensor_parallel_size = tp
    return config


def gdn_layer(geometry, config):
    """vLLM's GDN layer class with the attributes its constructor sets that its state methods
    read (building one needs a tensor-parallel group and weights)."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    layer = QwenGatedDeltaNetAttention.__new__(QwenGatedDeltaNetAttention)
    torch.nn.Module.__init__(layer)
    tp = config.parallel_config.tensor_parallel_size
    layer.tp_size = tp
    layer.num_k_heads = geometry.linear_num_key_heads
    layer.num_v_heads = geometry.linear_num_value_heads
    layer.head_k_dim = geometry.linear_key_head_dim
    layer.head_v_dim = geometry.linear_value_head_dim
    layer.conv_kernel_size = geometry.linear_conv_kernel_dim
    speculative = config.speculative_config
    layer.num_spec = speculative.num_speculative_tokens if speculative else 0
    layer.model_config = SimpleNamespace(
        dtype=torch.bfloat16, architecture="Qwen3_5ForConditionalGeneration"
    )
    layer.cache_config = config.cache_config
    return layer


def text_config(geometry):
    from vllm.transformers_utils.configs.qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**dataclasses.asdict(geometry))


@pytest.mark.parametrize("preset", ["27b", "tiny"])
@pytest.mark.parametrize(("drafts", "tp"), [(3, 1), (15, 1), (15, 2)])
def test_the_replay_page_holds_one_state_and_the_saved_inputs(vllm_on_cpu, preset, drafts, tp):
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration
    from vllm.v1.kv_cache_interface import MambaSpec

    from hyperqwen.engine import gdn_replay
    from hyperqwen.engine.gdn_replay_state import replay_model_class

    geometry = PRESETS[preset]
    if geometry.linear_num_key_heads % tp:
        pytest.skip("heads not divisible")
    config = vllm_config(drafts, tp=tp)
    vllms = gdn_layer(geometry, config).get_kv_cache_spec(config)
    layer = gdn_layer(geometry, config)
    gdn_replay.gdn_layer_built(layer)
    ours = layer.get_kv_cache_spec(config)

    assert vllms.num_speculative_blocks == drafts and ours.num_speculative_blocks == 0
    assert ours.shapes[:2] == vllms.shapes  # the conv window keeps its draft columns
    tokens, heads = 1 + drafts, geometry.linear_num_key_heads // tp
    v_heads = geometry.linear_num_value_heads // tp
    assert ours.shapes[2:] == (
        (tokens, heads, 128),
        (tokens, v_heads, 128),
        (tokens, v_heads),
        (tokens, v_heads),
    )
    assert ours.dtypes == (*vllms.dtypes, *(torch.bfloat16,) * 4)
    saved = replay_buffer_bytes(geometry, drafts, tp)
    assert ours.page_size_bytes == vllms.page_size_bytes + saved
    assert vllms.max_memory_usage_bytes(config) == (1 + drafts) * vllms.page_size_bytes
    assert ours.max_memory_usage_bytes(config) == ours.page_size_bytes
    assert ours.max_num_blocks_per_req(config, 4096) == 1

    # the model class's page, which sizes the attention block, is the layer's
    config.model_config = SimpleNamespace(
        hf_text_config=text_config(geometry), dtype=torch.bfloat16
    )
    replay_class = replay_model_class(Qwen3_5ForConditionalGeneration)

    def page(model_class):
        return MambaSpec(
            shapes=model_class.get_mamba_state_shape_from_config(config),
            dtypes=model_class.get_mamba_state_dtype_from_config(config),
            block_size=-1,
        ).page_size_bytes

    assert page(Qwen3_5ForConditionalGeneration) == vllms.page_size_bytes
    assert page(replay_class) == ours.page_size_bytes
    assert issubclass(replay_class, Qwen3_5ForConditionalGeneration)


def test_a_layer_without_speculation_keeps_vllms_page(vllm_on_cpu):
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    from hyperqwen.engine import gdn_replay
    from hyperqwen.engine.gdn_replay_state import replay_model_class

    config = vllm_config(0)
    layer = gdn_layer(PRESETS["tiny"], config)
    gdn_replay.gdn_layer_built(layer)
    assert "get_kv_cache_spec" not in vars(layer)
    assert not getattr(layer, "hyperqwen_replay", False)
    config.model_config = SimpleNamespace(
        hf_text_config=text_config(PRESETS["tiny"]), dtype=torch.bfloat16
    )
    replay_class = replay_model_class(Qwen3_5ForConditionalGeneration)
    for method in ("get_mamba_state_shape_from_config", "get_mamba_state_dtype_from_config"):
        vllms = getattr(Qwen3_5ForConditionalGeneration, method)(config)
        assert getattr(replay_class, method)(config) == vllms


def test_vllms_prefill_warmup_still_reads_two_state_dtypes(vllm_on_cpu, monkeypatch):
    """vLLM's GDN prefill warm-up (in its profiling run) unpacks the layer's state dtypes into
    (conv, recurrent); the replay page's six stopped the first start on the GPU host."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

    from hyperqwen.engine import gdn_replay

    class WarmupReachedItsKernels(Exception):
        pass

    def fused_post_conv_prep(**_):
        raise WarmupReachedItsKernels

    monkeypatch.setattr(qwen_gdn_linear_attn, "fused_post_conv_prep", fused_post_conv_prep)
    layer = gdn_layer(PRESETS["tiny"], vllm_config(3))
    gdn_replay.gdn_layer_built(layer)
    layer._prefill_kernels_warmed_up = False
    layer.A_log = layer.dt_bias = torch.zeros(layer.num_v_heads)
    mixed_qkv = torch.randn(4, 2 * layer.num_k_heads * layer.head_k_dim)
    with pytest.raises(WarmupReachedItsKernels):
        layer._warmup_prefill_kernels(mixed_qkv, 0)
    assert len(layer.get_state_dtype()) == 2 + 4  # the replay page again after the warm-up


def test_the_layer_takes_align_and_refuses_caching_every_block(vllm_on_cpu):
    """Prefix caching's `align` mode copies two states the replay folds instead
    (test_engine_gdn_replay_align_seam.py); "all" caches every block's from per-token states."""
    from hyperqwen.engine import gdn_replay

    config = vllm_config(3)
    config.cache_config.mamba_cache_mode = "align"
    layer = gdn_layer(PRESETS["tiny"], config)
    gdn_replay.gdn_layer_built(layer)
    assert layer.hyperqwen_replay and len(layer.get_state_shape()) == 2 + 4
    config.cache_config.mamba_cache_mode = "all"
    with pytest.raises(ValueError, match="mamba_cache_mode none or align, not all"):
        gdn_replay.gdn_layer_built(gdn_layer(PRESETS["tiny"], config))


@pytest.mark.parametrize("drafts", [0, 3])
def test_the_model_copies_the_conv_state_alone_with_the_replay_page(
    vllm_on_cpu, monkeypatch, drafts
):
    """vLLM's runner asks the model instance for its `align` copy functions; vLLM's model
    constructor needs a tensor-parallel group and weights, so it is replaced by Module's."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    from hyperqwen.engine.gdn_replay_models import ReplayQwen3_5

    def bare(self, *, vllm_config, prefix):
        torch.nn.Module.__init__(self)

    monkeypatch.setattr(Qwen3_5ForConditionalGeneration, "__init__", bare)
    model = ReplayQwen3_5(vllm_config=vllm_config(drafts), prefix="model")
    vllms = Qwen3_5ForConditionalGeneration.get_mamba_state_copy_func()
    expected = (get_conv_copy_spec,) if drafts else vllms
    assert model.get_mamba_state_copy_func() == expected


def test_a_model_without_the_replay_page_is_refused_by_the_layer(vllm_on_cpu):
    from hyperqwen.engine import gdn_replay

    layer = gdn_layer(PRESETS["tiny"], vllm_config(3))
    layer.model_config.architecture = "Qwen3NextForCausalLM"  # the same GDN layer class
    with pytest.raises(ValueError, match="not Qwen3NextForCausalLM"):
        gdn_replay.gdn_layer_built(layer)


def test_the_launcher_switches_it_on_with_either_prefix_caching_and_ignores_no_speculation():
    from pathlib import Path

    from hyperqwen.engine.features import GDN_REPLAY, launch_env, serve_refusal
    from hyperqwen.settings import Settings

    def settings(**values):
        return Settings.model_validate({"GDN_REPLAY": "1", **values})

    for prefix_cache in ("0", "1"):
        on = settings(PREFIX_CACHE=prefix_cache)
        assert serve_refusal(on, "single", [], Path()) is None
        assert launch_env(on, "single")[GDN_REPLAY.env] == "1"
    # nothing verifies without speculation: a warning, not a refusal, and the variable unset
    off = settings(PREFIX_CACHE="1", SPEC="off")
    assert serve_refusal(off, "single", [], Path()) is None
    assert GDN_REPLAY.env not in launch_env(off, "single")
    assert "SPEC=off" in GDN_REPLAY.ignored(off, "single")
    # the shipped default: off, nothing refused
    assert GDN_REPLAY.env not in launch_env(Settings.model_validate({}), "single")


def test_the_plugin_registers_the_backend_and_the_model_classes(vllm_on_cpu):
    from vllm import ModelRegistry
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    from hyperqwen.engine import gdn_replay
    from hyperqwen.engine.gdn_replay_backend import ReplayGDNBackend

    backend = MambaAttentionBackendEnum.GDN_ATTN
    models = dict(ModelRegistry.models)
    try:
        gdn_replay.register()
        assert backend.get_class() is ReplayGDNBackend
        from hyperqwen.engine import gdn_replay_models

        for architecture, path in gdn_replay.REPLAY_MODELS.items():
            model = ModelRegistry.models[architecture].load_model_cls()
            assert model is getattr(gdn_replay_models, path.split(":")[1])
            assert issubclass(model, Qwen3_5ForConditionalGeneration)
    finally:
        backend.clear_override()
        ModelRegistry.models.clear()
        ModelRegistry.models.update(models)


def replay_builder(cudagraph_mode: str, slots: int = SLOTS, pool=None):
    """Ours on the replay page's spec (one block per request), the group's pool bound as the
    runner binds it: static_forward_context[layer].kv_cache."""
    from vllm.v1.kv_cache_interface import MambaSpec

    from hyperqwen.engine.gdn_replay_backend import ReplayGDNBackend

    config = vllm_config(DRAFTS, cudagraph_mode)
    spec = MambaSpec(
        shapes=((3 + DRAFTS, 8), (2, 4, 4)),
        dtypes=(torch.bfloat16, torch.float32),
        block_size=BLOCK,
        num_speculative_blocks=0,
    )
    if pool is None:
        pool = [torch.empty((slots, 3 + DRAFTS, 8))]
    config.compilation_config.static_forward_context["gdn"] = SimpleNamespace(kv_cache=pool)
    builder_cls = ReplayGDNBackend.get_builder_cls()
    return builder_cls(spec, ["gdn"], config, torch.device("cpu"))


@pytest.mark.parametrize("cudagraph_mode", ["NONE", "FULL_AND_PIECEWISE"])
def test_the_builder_plans_each_step_and_advances_the_record(vllm_on_cpu, cudagraph_mode):
    builder = replay_builder(cudagraph_mode)
    full_graphs = cudagraph_mode != "NONE"
    for step, ((rows, spec_rows, unreplayed), saved_after) in enumerate(
        zip(STEPS, SAVED_AFTER, strict=True)
    ):
        padding = 2 if full_graphs and all(r.drafts is not None for r in rows) else 0
        # each row's runner count distinct, so that a fold count shows whose it is
        accepted = torch.tensor([2 + i for i in range(len(rows) + padding)], dtype=torch.int32)
        # a spec row's count is the runner's where the slot is saved (STEPS: a count not 0)
        spec_accepted = [int(accepted[i]) for i, r in enumerate(rows) if r.drafts is not None]
        saved_rows = [count > 0 for _, count in spec_rows]
        expected_counts = [a if s else 0 for a, s in zip(spec_accepted, saved_rows, strict=True)]
        meta = metadata(builder, rows + [PADDING] * padding, state_columns=1, accepted=accepted)
        plan = meta.replay
        assert plan.committed_slots.tolist() == [s for s, _ in spec_rows] + [NULL_SLOT] * padding
        assert plan.replay_counts.tolist() == expected_counts + [0] * padding, step
        # at the builder's fixed buffer (what a FULL graph's captured verify reads)
        if spec_rows:
            assert plan.replay_counts.data_ptr() == builder.replay_counts.data_ptr()
        assert plan.unreplayed.tolist() == unreplayed, step
        non_spec_accepted = [int(accepted[i]) for i, r in enumerate(rows) if r.drafts is None]
        expected_fold = [a if u else 0 for a, u in zip(non_spec_accepted, unreplayed, strict=True)]
        if unreplayed:
            assert meta.fold_counts.tolist() == expected_fold, step
            assert meta.fold_counts.data_ptr() == builder.fold_counts.data_ptr()
        else:
            assert meta.fold_counts is None
        live = {r.slot for r in rows}
        assert {s for s in live if builder.record[s]} == saved_after, step
        assert not builder.record[NULL_SLOT]
    assert builder.record.nonzero().flatten().tolist() == [5, 9, 11]


def test_a_cuda_graph_capture_leaves_the_record_alone(vllm_on_cpu):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    builder = replay_builder("FULL_AND_PIECEWISE")
    metadata(builder, [verify(3, 10, 1), Row(5, 0, 4)], state_columns=1)
    before = builder.record.clone()
    # a capture's batch on real slots would mark them; the capture must not
    rows, width = 2, 1 + DRAFTS
    starts = torch.arange(0, (rows + 1) * width, width, dtype=torch.int32)
    seq_lens = torch.full((rows,), width, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone(),
        seq_lens=seq_lens,
        num_reqs=rows,
        num_actual_tokens=rows * width,
        max_query_len=width,
        max_seq_len=width,
        block_table_tensor=torch.tensor([[7], [8]], dtype=torch.int32),
        slot_mapping=torch.zeros(rows * width, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )
    meta = builder.build_for_cudagraph_capture(common)
    assert meta.replay.committed_slots.tolist() == [7, 8]
    assert torch.equal(builder.record, before)
    assert before.nonzero().flatten().tolist() == [3]


def test_a_dummy_run_on_the_null_block_leaves_the_record_alone(vllm_on_cpu):
    """vLLM's dummy runs (warm-up, an idle data-parallel rank) build real metadata on cleared
    block-table rows: every row on the null block, with tokens and drafts."""
    builder = replay_builder("NONE")
    metadata(builder, [verify(3, 10, 1), Row(5, 30, 1)], state_columns=1)
    before = builder.record.clone()
    dummy = [verify(NULL_SLOT, 0, 1)] * 3
    meta = metadata(builder, dummy, state_columns=1)
    assert meta.replay.replay_counts.tolist() == [0, 0, 0]
    assert torch.equal(builder.record, before)
    assert before.nonzero().flatten().tolist() == [3]


def test_the_seam_refuses_metadata_without_a_plan(vllm_on_cpu):
    """A replay layer's page has one block per request: vLLM's own verify must not run on it."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    from hyperqwen.engine import gdn_replay

    config = vllm_config(DRAFTS)
    layer = gdn_layer(PRESETS["tiny"], config)
    gdn_replay.gdn_layer_built(layer)
    vllms = GDNAttentionMetadata(0, 0, 0, 0, 1, 4, 4)
    with pytest.raises(RuntimeError, match="without a replay plan"):
        gdn_replay.gdn_step_begins(layer, vllms)
    with pytest.raises(RuntimeError, match="without a replay plan"):
        gdn_replay.gdn_verify(layer, vllms, None, None, None, None, None)
