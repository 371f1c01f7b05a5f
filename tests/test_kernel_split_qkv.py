"""The GDN q|k|v split (kernels/split_qkv.py) against vLLM's own torch.cat of reshaped splits.

A copy, so the check is exact equality. On the CPU the kernel runs in Triton's interpreter
(conftest); on a GPU compiled. Rows are a column slice of a wider projection output, as in the
layer (strided rows), widths are not multiples of the kernel's block, every shape the 27B
serves at tensor-parallel 1 and 2 and the tiny test model's, decode and prefill row counts, and
the output starts poisoned.
"""

from __future__ import annotations

import pytest
import torch

from hyperqwen.kernels.pdl import runs_here as pdl_runs_here
from hyperqwen.kernels.split_qkv import runs_here, split_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (q_dim, k_dim, v_dim): 27B (16 k-heads, 48 v-heads of 128) at TP 1 and 2, the tiny model,
# and three unequal parts (the layer's q and k are equal; the kernel must not rely on it)
SHAPES = [(2048, 2048, 6144), (1024, 1024, 3072), (256, 256, 512), (96, 160, 1056)]
ROWS = [1, 4, 5, 16, 33, 300]


def vllm_reference(mixed: torch.Tensor, q_dim: int, k_dim: int, v_dim: int) -> torch.Tensor:
    """What vLLM 0.26's rearrange_mixed_qkv builds before taking its views."""
    query, key, value = torch.split(mixed, [q_dim, k_dim, v_dim], dim=-1)
    return torch.cat([query.reshape(-1), key.reshape(-1), value.reshape(-1)], dim=0)


@pytest.mark.parametrize("dims", SHAPES, ids=lambda d: "x".join(map(str, d)))
@pytest.mark.parametrize("rows", ROWS)
def test_split_matches_vllms_concatenation_exactly(dims, rows) -> None:
    width = sum(dims)
    generator = torch.Generator().manual_seed(rows * 7 + width)
    projection = torch.randn(rows, width + 1536, generator=generator).to(torch.bfloat16)
    mixed = projection.to(DEVICE)[:, :width]  # the q|k|v columns of q|k|v|z rows
    assert runs_here(mixed)
    assert mixed.stride(0) == width + 1536  # strided rows
    out = torch.full((rows * width,), float("nan"), dtype=mixed.dtype, device=DEVICE)
    result = split_qkv(mixed, *dims, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(result.cpu(), vllm_reference(mixed, *dims).cpu())
    if pdl_runs_here(mixed.device):  # its programmatic-dependent-launch code: the same bits
        again = torch.full_like(out, float("nan"))
        assert torch.equal(split_qkv(mixed, *dims, out=again, pdl=True), result)


def test_without_out_it_allocates_and_refuses_wrong_inputs() -> None:
    mixed = torch.randn(3, 40, device=DEVICE).to(torch.float16)
    assert torch.equal(split_qkv(mixed, 8, 8, 24).cpu(), vllm_reference(mixed, 8, 8, 24).cpu())
    with pytest.raises(ValueError, match="8\\+8\\+20"):
        split_qkv(mixed, 8, 8, 20)
    with pytest.raises(ValueError, match="contiguous"):
        split_qkv(mixed.t().contiguous().t(), 8, 8, 24)  # columns strided
    with pytest.raises(ValueError, match="out must be"):
        split_qkv(mixed, 8, 8, 24, out=torch.empty(5, dtype=mixed.dtype, device=DEVICE))
    assert split_qkv(mixed[:0], 8, 8, 24).numel() == 0


@pytest.mark.parametrize("switch", [None, "1", "0"], ids=["unset", "on", "off"])
def test_vllms_patched_layer_takes_its_views_from_the_kernels_buffer(monkeypatch, switch) -> None:
    """The installed vLLM's GatedDeltaNet.rearrange_mixed_qkv (the gdn_mixed_qkv seam,
    patches/gdn-layer.patch) calls the kernel, unless GDN_SPLIT_QKV=0 keeps vLLM's cat, and returns
    the same (1, T, heads, dim) tensors as vLLM's own cat either way."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn

    from hyperqwen.engine.features import SPLIT_QKV
    from hyperqwen.kernels import split_qkv as module

    if switch is None:
        monkeypatch.delenv(SPLIT_QKV.env, raising=False)
    else:
        monkeypatch.setenv(SPLIT_QKV.env, switch)

    calls = []
    monkeypatch.setattr(module, "split_qkv", lambda *a, **k: calls.append(1) or split_qkv(*a, **k))
    layer = type("Layer", (), {"key_dim": 2048, "value_dim": 6144, "tp_size": 2,
                               "head_k_dim": 128, "head_v_dim": 128})()  # fmt: skip
    rearrange = next(
        value.rearrange_mixed_qkv
        for value in vars(gdn).values()
        if isinstance(value, type) and "rearrange_mixed_qkv" in vars(value)
    )
    mixed = torch.randn(4, 6144, device=DEVICE).to(torch.bfloat16)[:, :5120]
    query, key, value = rearrange(layer, mixed)
    assert calls == ([] if switch == "0" else [1])
    flat = vllm_reference(mixed, 1024, 1024, 3072)
    assert query.shape == (1, 4, 8, 128) and value.shape == (1, 4, 24, 128)
    assert torch.equal(query.reshape(-1).cpu(), flat[: 4 * 1024].cpu())
    assert torch.equal(key.reshape(-1).cpu(), flat[4 * 1024 : 8 * 1024].cpu())
    assert torch.equal(value.reshape(-1).cpu(), flat[8 * 1024 :].cpu())
