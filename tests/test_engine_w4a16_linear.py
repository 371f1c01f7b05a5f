"""HyperQwen's W4A16 kernel as a vLLM linear kernel (engine/w4a16_linear.py, LINEAR_BACKEND=
hyperqwen): a layer built from vLLM's own parameter classes, repacked once, answers every M like
a float64 reference; what it refuses it names; the launch shapes stay within the kernel's
limits. The kernel runs under Triton's interpreter here (conftest turns it on without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from hyperqwen.bench.kernels import (
    PRESETS,
    layer_shapes,
    relative_error,
    vllm_w4a16_layer,
    w4a16_layer_config,
)
from hyperqwen.checkpoint import w4a16 as checkpoint_format
from hyperqwen.engine import seams, w4a16_linear
from hyperqwen.engine.features import W4A16_LINEAR
from hyperqwen.kernels import w4a16

GROUP = 128


@pytest.fixture(scope="module")
def one_rank(vllm_cpu_platform):
    """A one-process gloo world on vLLM's CPU platform: vLLM's weight parameters ask for their
    tensor-parallel rank."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from hyperqwen.bench.kernels import start_one_rank

    with set_current_vllm_config(VllmConfig()):
        start_one_rank()
    yield
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


def loaded_layer(weight: torch.Tensor):
    """A vLLM W4A16 layer holding a compressed-tensors checkpoint's tensors of `weight`, and
    the float64 weights they stand for."""
    stored = checkpoint_format.pack(weight.to(torch.bfloat16))
    layer = vllm_w4a16_layer(stored["weight_packed"], stored["weight_scale"])
    return layer, checkpoint_format.unpack(stored).double()


@pytest.mark.usefixtures("interpreted")
def test_a_vllm_layer_answers_every_m_from_its_one_copy_of_tiles(one_rank):
    n, k = 48, 512
    weight = torch.randn((n, k), generator=torch.Generator().manual_seed(21)) * 0.05
    layer, dense = loaded_layer(weight)
    words_bytes = layer.weight_packed.numel() * 4
    kernel = w4a16_linear.linear_kernel_class()(
        w4a16_layer_config(n, k), "weight_packed", "weight_scale"
    )
    kernel.process_weights_after_loading(layer)
    assert layer.weight_packed.shape == (n // 16, k // GROUP, 16, 16)
    assert layer.weight_packed.numel() * 4 == words_bytes  # moved, not copied beside
    assert {name for name, _ in layer.named_parameters()} == {"weight_packed", "weight_scale"}
    bias = torch.randn(n, generator=torch.Generator().manual_seed(22)).to(torch.bfloat16)
    for shape in [(1, k), (5, k), (2, 3, k), (70, k)]:  # 70 rows: prefill's tiles
        x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).to(
            torch.bfloat16
        )
        out = kernel.apply_weights(layer, x, bias)
        assert out.shape == (*shape[:-1], n) and out.dtype == torch.bfloat16
        ref = x.double() @ dense.T + bias.double()
        error = relative_error(out, ref)
        assert error < 6e-3, (shape, error)


@pytest.mark.usefixtures("interpreted")
def test_the_op_is_opaque_to_torch_compile_and_its_fake_agrees():
    """torch.library.opcheck runs the op eagerly and under fake tensors (what torch.compile
    traces), comparing shapes, dtypes and schema."""
    codes = torch.randint(0, 16, (32, 256), generator=torch.Generator().manual_seed(5))
    scale = (torch.rand((32, 2), generator=torch.Generator().manual_seed(6)) * 0.02 + 0.001).to(
        torch.bfloat16
    )
    words, scales = w4a16.tiles_from_checkpoint(w4a16.pack_codes(codes), scale)
    x = torch.randn((3, 256), generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.hyperqwen.w4a16_linear, (x, words, scales))


def test_repacking_in_slices_is_repacking_whole(monkeypatch):
    codes = torch.randint(0, 16, (80, 256), generator=torch.Generator().manual_seed(8))
    packed = w4a16.pack_codes(codes)
    scale = torch.rand((80, 2), generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    monkeypatch.setattr(w4a16_linear, "REPACK_ROWS", 32)  # 80 rows: slices of 32, 32 and 16
    sliced = w4a16_linear.repack(packed, scale)
    whole = w4a16.tiles_from_checkpoint(packed, scale)
    assert all(torch.equal(a, b) for a, b in zip(sliced, whole, strict=True))


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"group_size": 64}, "group size 64"),
        ({"zero_points": True}, "zero points"),
        ({"partition_weight_shape": (512, 40)}, "N=40"),
        ({"act_type": torch.float32}, "activations torch.float32"),
    ],
)
def test_it_refuses_what_it_cannot_serve_and_says_what(changes, named):
    can, reason = w4a16_linear.linear_kernel_class().can_implement(
        w4a16_layer_config(48, 512, **changes)
    )
    assert not can and named in reason


def test_the_int8_heads_go_to_the_next_kernel():
    config = w4a16_layer_config(48, 512, bits=8)
    can, reason = w4a16_linear.linear_kernel_class().can_implement(config)
    assert not can and "takes uint4b8" in reason


def test_it_comes_first_only_when_asked_and_on_cuda(monkeypatch):
    vllms = ["MarlinLinearKernel"]
    monkeypatch.delenv(W4A16_LINEAR.env, raising=False)
    assert seams.linear_kernels(vllms, on_cuda=True) == vllms
    monkeypatch.setenv(W4A16_LINEAR.env, "1")
    assert seams.linear_kernels(vllms, on_cuda=False) == vllms
    assert seams.linear_kernels(vllms, on_cuda=True) == [
        w4a16_linear.linear_kernel_class(),
        *vllms,
    ]


@pytest.mark.parametrize("m", [1, 4, 16, 64, 65, 256, 8192])
@pytest.mark.parametrize("capability", [86, 90])
def test_launch_shapes_fit_the_kernel_at_every_27b_shape(m, capability):
    for shape in layer_shapes(PRESETS["27b"]):
        config = w4a16_linear.tile_for(m, shape.n, shape.k, capability)
        w4a16.check_config(config, GROUP, shape.k)
        assert shape.k // config.split_k >= config.block_k  # no slice shorter than a K block
        if m <= w4a16_linear.SMALL_M:
            programs = -(-shape.n // config.block_n) * config.split_k
            assert programs >= 640 or config.split_k == 8, (shape.name, config)
        elif capability < 90:
            assert config.block_m == 64  # 128 rows of x overflow an sm86/89 program's 99 KB
