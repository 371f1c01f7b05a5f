"""8-bit activations into the int4 body GEMMs (engine/w4a8_linear.py, INT8_ACT): the knob and
what the launcher makes of it, the checkpoint refusals before start, the choice per layer group
and per architecture, and the fold of negative group scales into the codes against a float64
dequantization. The 8-bit kernels themselves need CUDA (tests/test_engine_w4a8_linear_gpu.py);
here a layer INT8_ACT leaves alone runs through the dispatcher into HyperQwen's W4A16 kernel
under Triton's interpreter.
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_runner import ROOT, hyperqwen
from loaded_settings import loaded

from hyperqwen.bench.kernels import (
    W4A8_BACKENDS,
    W4A8_PREFIX,
    relative_error,
    vllm_w4a16_layer,
    w4a16_layer_config,
)
from hyperqwen.checkpoint import w4a16 as checkpoint_format
from hyperqwen.engine import seams, w4a8_linear, w4a16_linear
from hyperqwen.engine.features import W4A8_LINEAR, W4A16_LINEAR
from hyperqwen.engine.w4a8_linear import (
    CANDIDATES,
    Int8ActRefused,
    candidate_for,
    fold_scale_signs,
    int8_activation_refusal,
    layer_group,
    selected_groups,
)
from hyperqwen.gpu import parse_smi_line
from hyperqwen.kernels.w4a16 import pack_codes
from hyperqwen.launch import build_launch
from hyperqwen.settings import SettingsError, load_settings

GROUP = 128


# --- the knob ---------------------------------------------------------------------------------


def test_int8_act_names_layer_groups_and_refuses_anything_else_by_name(tmp_path):
    assert W4A8_LINEAR.values == (
        "0", "mlp", "attn", "gdn", "mlp+attn", "mlp+gdn", "attn+gdn", "all",
    )  # fmt: skip
    for bad in ("1", "on", "gdn+mlp", "mlp,attn", "MLP"):
        with pytest.raises(SettingsError, match="INT8_ACT"):
            load_settings({"INT8_ACT": bad}, tmp_path / "none.env")


@pytest.mark.parametrize(
    ("value", "groups"),
    [
        ("0", set()),
        ("mlp", {"mlp"}),
        ("mlp+gdn", {"mlp", "gdn"}),
        ("attn+gdn", {"attn", "gdn"}),
        ("all", {"mlp", "attn", "gdn"}),
    ],
)
def test_each_value_selects_the_groups_it_names(value, groups):
    assert selected_groups(value) == groups


def test_batch_servers_get_the_variable_and_single_ones_a_warning():
    assert W4A8_LINEAR.env not in build_launch(loaded(), "batch", None).env
    batch = build_launch(loaded(INT8_ACT="mlp+attn"), "batch", None)
    assert batch.env[W4A8_LINEAR.env] == "mlp+attn"
    assert batch.warnings == []
    single = build_launch(loaded(INT8_ACT="mlp"), "single", None)
    assert W4A8_LINEAR.env not in single.env
    assert "INT8_ACT is a batch-mode knob; ignored in single mode." in single.warnings
    # the argv is INT8_ACT's business only through the environment
    assert batch.argv == build_launch(loaded(), "batch", None).argv


# --- the checkpoint, before vLLM starts --------------------------------------------------------


def _compressed_tensors(**weights) -> dict:
    args = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, **weights}
    return {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}},
        }
    }


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (_compressed_tensors(symmetric=False), "group_0 has zero points"),
        (_compressed_tensors(actorder="group"), "group_0 has activation order"),
        ({"quantization_config": {"quant_method": "gptq", "sym": False}}, "sym: false"),
        ({"quantization_config": {"quant_method": "gptq", "desc_act": True}}, "desc_act"),
        ({"quantization_config": {"quant_method": "awq", "zero_point": True}}, "AWQ"),
        ({"torch_dtype": "bfloat16"}, "no quantization_config"),
    ],
)
def test_checkpoints_the_8_bit_kernels_cannot_take_are_refused_with_the_fix(config, named):
    refusal = int8_activation_refusal(config, "m/config.json", "mlp")
    assert refusal is not None
    assert refusal.startswith("INT8_ACT=mlp: m/config.json")
    assert named in refusal and "set INT8_ACT=0" in refusal


def test_the_flagship_format_is_taken():
    """What `hyperqwen prepare` writes: the W4A16 base group plus its int8 head groups."""
    config = {"quantization_config": checkpoint_format.with_int_group(
        checkpoint_format.quantization_config(["lm_head"]).model_dump(mode="json"),
        "group_1", 8, ["lm_head"], ["lm_head"], ["lm_head"],
    )}  # fmt: skip
    assert int8_activation_refusal(config, "m/config.json", "all") is None


def test_serve_refuses_a_checkpoint_with_zero_points_before_vllm(tmp_path):
    """Before the GPU check: a model with zero points is wrong for INT8_ACT on any machine."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(_compressed_tensors(symmetric=False)))
    env = {"MODEL": str(model), "INT8_ACT": "mlp"}
    done = hyperqwen("serve", "batch", env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"refusing to start: INT8_ACT=mlp: {model}/config.json: config group group_0 has " in (
        done.stderr
    )
    # the same folder without INT8_ACT gets as far as the missing GPU
    assert hyperqwen("serve", "batch", env={"MODEL": str(model)}, cwd=tmp_path).returncode == 3


# --- which layer runs what --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "group"),
    [
        ("language_model.model.layers.3.mlp.gate_up_proj", "mlp"),
        ("language_model.model.layers.3.mlp.down_proj", "mlp"),
        ("language_model.model.layers.3.self_attn.qkv_proj", "attn"),
        ("language_model.model.layers.3.self_attn.o_proj", "attn"),
        ("language_model.model.layers.0.linear_attn.in_proj_qkvz", "gdn"),
        ("language_model.model.layers.0.linear_attn.out_proj", "gdn"),
        ("model.layers.11.mlp.gate_up_proj", "mlp"),  # a text-only model (SmolLM2, Llama)
        ("lm_head", None),
        ("visual.blocks.0.mlp.linear_fc1", None),  # the vision tower is no decoder layer
        ("", None),
    ],
)
def test_a_layer_s_group_comes_from_its_prefix(prefix, group):
    assert layer_group(prefix) == group


def test_the_architecture_table_and_its_refusal(monkeypatch):
    for capability in (80, 86, 89):
        assert candidate_for(capability) is CANDIDATES["marlin_int8"]
    monkeypatch.setenv(W4A8_LINEAR.env, "mlp")
    for capability, device in ((100, "sm100"), (75, "sm75"), (None, "other than CUDA")):
        with pytest.raises(Int8ActRefused, match=f"INT8_ACT=mlp: .*{device}.*set INT8_ACT=0"):
            candidate_for(capability)
    # sm90: timed, and slower than W4A16; the refusal cites the result file, which exists
    with pytest.raises(Int8ActRefused, match="sm90 every 8-bit-activation kernel timed was sl"):
        candidate_for(90)
    assert (ROOT / w4a8_linear.SLOWER_THAN_W4A16[90]).is_file()


def test_serve_refuses_int8_act_on_a_gpu_the_table_does_not_serve(tmp_path):
    """Before vLLM starts: every visible GPU's architecture must have a kernel in the table."""
    rtx_3090 = parse_smi_line("0, NVIDIA GeForce RTX 3090, 8.6, 24576, 560.35, 350.00")
    h200 = parse_smi_line("1, NVIDIA H200, 9.0, 143771, 580.95, 700.00")
    assert w4a8_linear.serve_refusal("mlp", [rtx_3090], tmp_path) is None
    refusal = w4a8_linear.serve_refusal("mlp", [rtx_3090, h200], tmp_path)
    assert refusal is not None
    assert refusal.startswith("INT8_ACT=mlp: on sm90 every 8-bit-activation kernel timed")
    assert refusal.endswith("set INT8_ACT=0 (GPU 1: NVIDIA H200)")


def test_each_candidate_is_built_with_the_8_bit_config_its_vllm_kernel_checks(vllm_cpu_platform):
    from vllm.scalar_type import scalar_types

    layer = w4a16_layer_config(256, 1024)
    cutlass = CANDIDATES["cutlass_fp8"].config(layer)
    assert (cutlass.act_type, cutlass.weight_type) == (torch.float8_e4m3fn, scalar_types.int4)
    assert cutlass.out_type == torch.bfloat16  # CUTLASS W4A8 writes bf16 only
    marlin = CANDIDATES["marlin_int8"].config(layer)
    assert (marlin.act_type, marlin.weight_type) == (torch.int8, scalar_types.uint4b8)
    humming = CANDIDATES["humming_int8"].config(layer)
    assert humming.act_type == torch.bfloat16  # humming takes its input dtype from the layer
    assert layer.act_type == torch.bfloat16  # the layer's own config is left as it was
    # Marlin's int8 path needs two groups for its per-layer scale; vLLM's checks come after
    assert "needs 2" in CANDIDATES["marlin_int8"].refusal(w4a16_layer_config(256, GROUP))
    module = torch.nn.Module()
    CANDIDATES["humming_fp8"].prepare(module)
    assert module._humming_input_quant_config["input_dtype"] == "float8e4m3"


def test_bench_kernels_times_every_candidate_by_name():
    """The names `hyperqwen bench kernels --backends` takes (declared without importing torch)."""
    assert tuple(W4A8_PREFIX + name for name in CANDIDATES) == W4A8_BACKENDS
    assert set(w4a8_linear.ARCH_TABLE.values()) <= set(CANDIDATES)


def test_the_dispatcher_comes_first_only_when_switched_on_and_on_cuda(monkeypatch):
    vllms = ["MarlinLinearKernel"]
    monkeypatch.delenv(W4A8_LINEAR.env, raising=False)
    monkeypatch.delenv(W4A16_LINEAR.env, raising=False)
    assert seams.linear_kernels(vllms, on_cuda=True) == vllms
    monkeypatch.setenv(W4A8_LINEAR.env, "0")
    assert seams.linear_kernels(vllms, on_cuda=True) == vllms
    monkeypatch.setenv(W4A8_LINEAR.env, "mlp")
    assert seams.linear_kernels(vllms, on_cuda=False) == vllms
    dispatcher, *rest = seams.linear_kernels(vllms, on_cuda=True)
    assert rest == vllms and dispatcher.fallback == tuple(vllms)
    # with LINEAR_BACKEND=hyperqwen too, a layer left at 16 bits gets HyperQwen's kernel next
    monkeypatch.setenv(W4A16_LINEAR.env, "1")
    dispatcher, *rest = seams.linear_kernels(vllms, on_cuda=True)
    assert dispatcher.fallback == (w4a16_linear.linear_kernel_class(), *vllms)


@pytest.mark.parametrize(
    ("changes", "takes"),
    [
        ({}, True),
        ({"act_type": torch.float16}, True),
        ({"zero_points": True}, False),
        ({"has_g_idx": True}, False),
        ({"act_type": torch.float32}, False),
    ],
)
def test_the_dispatcher_takes_the_int4_body_only(changes, takes):
    kernel = w4a8_linear.linear_kernel_class(())
    assert kernel.can_implement(w4a16_layer_config(256, 1024, **changes))[0] is takes
    assert not kernel.can_implement(w4a16_layer_config(256, 1024, bits=8))[0]  # the int8 heads


@pytest.fixture(scope="module")
def one_rank(vllm_cpu_platform):
    from vllm.config import VllmConfig, set_current_vllm_config

    from hyperqwen.bench.kernels import start_one_rank

    with set_current_vllm_config(VllmConfig()):
        start_one_rank()
    yield
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


def _layer(prefix: str, n: int = 32, k: int = 256, seed: int = 3):
    weight = torch.randn((n, k), generator=torch.Generator().manual_seed(seed)) * 0.05
    stored = checkpoint_format.pack(weight.to(torch.bfloat16))
    layer = vllm_w4a16_layer(stored["weight_packed"], stored["weight_scale"])
    layer.prefix = prefix
    return layer, checkpoint_format.unpack(stored).double()


@pytest.mark.usefixtures("interpreted")
def test_a_layer_int8_act_leaves_alone_runs_the_next_kernel(one_rank, monkeypatch):
    monkeypatch.setenv(W4A8_LINEAR.env, "mlp")
    rest = (w4a16_linear.linear_kernel_class(),)
    layer, dense = _layer("model.layers.0.self_attn.o_proj")
    kernel = w4a8_linear.linear_kernel_class(rest)(
        w4a16_layer_config(32, 256), "weight_packed", "weight_scale"
    )
    kernel.process_weights_after_loading(layer)
    assert type(kernel.inner) is rest[0]
    x = torch.randn((5, 256), generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert relative_error(kernel.apply_weights(layer, x), x.double() @ dense.T) < 6e-3


def test_a_selected_layer_without_a_declared_kernel_is_refused_by_name(one_rank, monkeypatch):
    """Here, on the CPU: no architecture of the table."""
    monkeypatch.setenv(W4A8_LINEAR.env, "mlp+attn")
    layer, _ = _layer("model.layers.0.self_attn.o_proj")
    kernel = w4a8_linear.linear_kernel_class(())(
        w4a16_layer_config(32, 256), "weight_packed", "weight_scale"
    )
    with pytest.raises(Int8ActRefused, match=r"INT8_ACT=mlp\+attn: .*set INT8_ACT=0"):
        kernel.process_weights_after_loading(layer)


# --- negative group scales ---------------------------------------------------------------------


def _dequantized(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 weights of checkpoint words and scales: (code - 8) * scale, per group."""
    from hyperqwen.kernels.w4a16 import unpack_codes

    codes = unpack_codes(packed).double() - 8
    return codes * scale.double().repeat_interleave(GROUP, dim=1)


def _signed_layer(n: int, k: int, seed: int, code_zero_in_negative: bool = False):
    gen = torch.Generator().manual_seed(seed)
    scale = (torch.rand((n, k // GROUP), generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    negative = torch.rand((n, k // GROUP), generator=gen) < 0.4
    scale = torch.where(negative, -scale, scale)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    flip = negative.repeat_interleave(GROUP, dim=1)
    if not code_zero_in_negative:
        codes = torch.where(flip & (codes == 0), torch.ones_like(codes), codes)
    return pack_codes(codes), scale


def test_folding_the_sign_into_the_codes_keeps_every_weight(monkeypatch):
    packed, scale = _signed_layer(80, 512, seed=11)
    assert bool((scale < 0).any()) and bool((scale > 0).any())
    reference = _dequantized(packed, scale)
    monkeypatch.setattr(w4a8_linear, "FOLD_ROWS", 32)  # 80 rows: slices of 32, 32 and 16
    folded_packed, folded_scale = fold_scale_signs(packed, scale)
    assert bool((folded_scale >= 0).all()) and folded_scale.dtype == scale.dtype
    assert folded_packed.shape == packed.shape and folded_packed.dtype == torch.int32
    assert torch.equal(_dequantized(folded_packed, folded_scale), reference)
    assert not torch.equal(folded_packed, packed)


def test_non_negative_scales_are_left_as_they_are():
    packed, scale = _signed_layer(16, 256, seed=12)
    scale = scale.abs()
    folded = fold_scale_signs(packed, scale)
    assert folded[0] is packed and folded[1] is scale


def test_code_zero_in_a_negative_group_is_refused_naming_the_layer():
    packed, scale = _signed_layer(16, 256, seed=13, code_zero_in_negative=True)
    with pytest.raises(Int8ActRefused, match=r"layers\.0\.mlp\.down_proj: a group with a negative"):
        fold_scale_signs(packed, scale, "layers.0.mlp.down_proj")


def test_the_bench_layer_carries_what_a_vllm_linear_layer_gives_its_kernel(one_rank):
    """Kernels read a vLLM linear layer's attributes while converting it (humming: has_bias; the
    H200 run of 2026-12-02 failed on the stand-in's missing one): the stand-in has them all."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    with set_current_vllm_config(VllmConfig()):
        real = ColumnParallelLinear(256, 32, bias=False, params_dtype=torch.bfloat16)
    layer, _ = _layer("model.layers.0.mlp.down_proj")
    for name in ("has_bias", "input_size_per_partition", "output_partition_sizes", "params_dtype"):
        assert getattr(layer, name) == getattr(real, name), name
