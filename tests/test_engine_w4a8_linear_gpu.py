"""INT8_ACT's 8-bit-activation kernels on a GPU (engine/w4a8_linear.py): each candidate vLLM
0.26 ships, built as the engine builds it from a W4A16 g128 layer in vLLM's own parameter
classes, answers like a float64 reference within its activations' rounding; through the
dispatcher, a selected layer with negative group scales gets the table's kernel for this GPU
(Marlin int8 on a GPU the table refuses, such as sm90; the signs folded where it needs them)
and a layer left out gets vLLM's own.

Run on the GPU host: `pytest -m gpu tests/test_engine_w4a8_linear_gpu.py` (humming JIT-compiles
with nvcc on first use). Tolerances are the activations' rounding, not measured yet: int8 per
token about 0.4 % of a row's largest value, fp8 e4m3 3 bits of mantissa (and CUTLASS's fp8
group scales).
"""

from __future__ import annotations

import pytest
import torch

from hyperqwen.bench.kernels import (
    init_vllm_single_rank,
    relative_error,
    vllm_w4a16_layer,
    w4a16_layer_config,
)
from hyperqwen.engine import w4a8_linear
from hyperqwen.engine.features import W4A8_LINEAR
from hyperqwen.engine.w4a8_linear import ARCH_TABLE, CANDIDATES
from hyperqwen.kernels.w4a16 import pack_codes

pytestmark = pytest.mark.gpu

GROUP = 128
TOLERANCE = {"int8": 2.5e-2, "fp8": 6e-2}
SHAPES = [(1024, 2048), (5120, 17408)]  # a small layer; the 27B's mlp down_proj
ROWS = (1, 16, 64, 256)  # decode batches of the batch profile, and a prefill slice


@pytest.fixture(scope="module")
def capability() -> int:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    init_vllm_single_rank()
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def signed_weights(n: int, k: int, seed: int, negative_share: float):
    """Checkpoint words and group scales with a share of negative scales (no code 0 in those
    groups, which cannot fold), and the float64 weights they stand for."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.rand((n, k // GROUP), device="cuda", generator=gen) * 0.02 + 0.002
    negative = torch.rand(scale.shape, device="cuda", generator=gen) < negative_share
    scale = torch.where(negative, -scale, scale).to(torch.bfloat16)
    codes = torch.randint(0, 16, (n, k), device="cuda", generator=gen)
    flip = negative.repeat_interleave(GROUP, dim=1)
    codes = torch.where(flip & (codes == 0), torch.ones_like(codes), codes)
    dense = (codes.double() - 8) * scale.double().repeat_interleave(GROUP, dim=1)
    return pack_codes(codes), scale, dense


def check_answers(kernel, layer, dense, k: int, tolerance: float) -> None:
    for m in ROWS:
        x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
        out = kernel.apply_weights(layer, x)
        assert out.dtype == torch.bfloat16 and out.shape == (m, dense.shape[0])
        error = relative_error(out, x.double() @ dense.T)
        assert error < tolerance, (m, error)


@pytest.mark.parametrize("name", list(CANDIDATES))
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_each_candidate_answers_like_float64(capability, name, n, k):
    candidate = CANDIDATES[name]
    config = w4a16_layer_config(n, k)
    if why := candidate.refusal(config):
        pytest.skip(f"{name} on sm{capability}: {why}")
    packed, scale, dense = signed_weights(n, k, seed=n + k, negative_share=0.0)
    layer = vllm_w4a16_layer(packed, scale)
    candidate.prepare(layer)
    kernel = candidate.kernel_class()(candidate.config(config), "weight_packed", "weight_scale")
    kernel.process_weights_after_loading(layer)
    check_answers(kernel, layer, dense, k, TOLERANCE[candidate.activations])


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_dispatcher_runs_the_table_s_kernel_for_a_selected_layer(capability, monkeypatch, n, k):
    from vllm.model_executor.kernels.linear import _POSSIBLE_KERNELS
    from vllm.platforms import PlatformEnum

    if capability not in ARCH_TABLE:  # e.g. sm90, refused for speed: the dispatch runs anyway
        monkeypatch.setitem(ARCH_TABLE, capability, "marlin_int8")
    monkeypatch.setenv(W4A8_LINEAR.env, "mlp")
    dispatcher = w4a8_linear.linear_kernel_class(tuple(_POSSIBLE_KERNELS[PlatformEnum.CUDA]))
    candidate = CANDIDATES[ARCH_TABLE[capability]]
    for prefix, selected in (
        ("model.layers.0.mlp.down_proj", True),
        ("model.layers.0.self_attn.o_proj", False),
    ):
        packed, scale, dense = signed_weights(n, k, seed=n - k, negative_share=0.3)
        layer = vllm_w4a16_layer(packed, scale)
        layer.prefix = prefix
        config = w4a16_layer_config(n, k)
        kernel = dispatcher(config, "weight_packed", "weight_scale")
        kernel.process_weights_after_loading(layer)
        eight_bit = kernel.inner.config == candidate.config(config)
        assert eight_bit is selected, (prefix, type(kernel.inner).__name__)
        if selected:
            assert type(kernel.inner).__name__ == candidate.kernel
        tolerance = TOLERANCE[candidate.activations] if selected else 1e-2
        check_answers(kernel, layer, dense, k, tolerance)
