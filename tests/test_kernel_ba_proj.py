"""The GDN layer's b/a projection kernel (kernels/ba_proj.py) and its op (engine/gdn_ba.py,
GDN_BA=1) against a float64 reference, on the CPU under Triton's interpreter (conftest turns it
on without a GPU): every row count a decode or verify step has, the 27B's 48 heads and its
hidden 5120, outputs poisoned first; beyond 16 rows the op is vLLM's own GEMM, split and copies.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hyperqwen.bench.kernels import relative_error
from hyperqwen.engine import gdn_ba
from hyperqwen.engine.features import GDN_BA
from hyperqwen.kernels import ba_proj

HIDDEN_27B, HEADS_27B = 5120, 48


def inputs(m: int, heads: int, k: int, seed: int, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn((m, k), generator=generator).to(dtype)
    weight = (torch.randn((2 * heads, k), generator=generator) * 0.02).to(dtype)
    return x, weight, x.double() @ weight.double().T


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(
    ("m", "heads", "k"),
    [(1, HEADS_27B, HIDDEN_27B), (4, HEADS_27B, HIDDEN_27B), (16, HEADS_27B, HIDDEN_27B),
     (3, 5, 300), (9, 2, 256), (5, 1, 4200)],  # K beyond the last block; one head
)  # fmt: skip
def test_b_and_a_match_float64_and_every_element_is_written(m, heads, k):
    x, weight, ref = inputs(m, heads, k, seed=m * 100 + heads)
    out = tuple(torch.full((m, heads), float("nan"), dtype=x.dtype) for _ in range(2))
    b, a = ba_proj.ba_projection(x, weight, out=out)
    assert b is out[0] and a is out[1]
    assert not (b.isnan().any() or a.isnan().any()), "some outputs were never written"
    assert relative_error(b, ref[:, :heads]) < 6e-3  # bf16 output rounding
    assert relative_error(a, ref[:, heads:]) < 6e-3
    # with its programmatic-dependent-launch code (kernels/pdl.py): the same bits
    poisoned = tuple(torch.full_like(part, float("nan")) for part in out)
    b_pdl, a_pdl = ba_proj.ba_projection(x, weight, out=poisoned, pdl=True)
    assert torch.equal(b_pdl, b) and torch.equal(a_pdl, a)


@pytest.mark.usefixtures("interpreted")
def test_it_reads_strided_rows_and_fp16():
    x, weight, _ = inputs(4, 3, 512, seed=3, dtype=torch.float16)
    wide = torch.zeros((4, 700), dtype=x.dtype)
    wide[:, 100:612] = x  # rows 700 apart, as a column slice of a bigger output would be
    b, a = ba_proj.ba_projection(wide[:, 100:612], weight)
    ref = x.double() @ weight.double().T
    assert relative_error(b, ref[:, :3]) < 1e-3 and relative_error(a, ref[:, 3:]) < 1e-3


@pytest.mark.usefixtures("interpreted")  # CPU tensors pass runs_here only interpreted
def test_it_refuses_what_it_cannot_take_saying_what_it_takes():
    x, weight, _ = inputs(4, 3, 256, seed=4)
    for bad_x, bad_w in [(x.repeat(5, 1), weight), (x, weight[:5]), (x.float(), weight)]:
        assert not ba_proj.runs_here(bad_x, bad_w)
        with pytest.raises(ValueError, match="takes 1-16 rows"):
            ba_proj.ba_projection(bad_x, bad_w)
    with pytest.raises(ValueError, match="out must be two contiguous"):
        ba_proj.ba_projection(x, weight, out=(torch.empty(4, 3), torch.empty(4, 3)))


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("m", [1, 4, 17, 64])
def test_the_op_is_the_kernel_at_decode_and_vllms_gemm_beyond(m):
    x, weight, ref = inputs(m, 6, 512, seed=m)
    b, a = torch.ops.hyperqwen.gdn_ba(x, weight)
    assert b.is_contiguous() and a.is_contiguous() and b.shape == a.shape == (m, 6)
    if m > ba_proj.MAX_ROWS:  # vLLM's way, exactly
        vllms_b, vllms_a = torch.nn.functional.linear(x, weight).chunk(2, dim=-1)
        assert torch.equal(b, vllms_b) and torch.equal(a, vllms_a)
    assert relative_error(b, ref[:, :6]) < 6e-3 and relative_error(a, ref[:, 6:]) < 6e-3


@pytest.mark.usefixtures("interpreted")
def test_the_op_is_opaque_to_torch_compile_and_its_fake_agrees():
    x, weight, _ = inputs(3, 4, 256, seed=9)
    torch.library.opcheck(torch.ops.hyperqwen.gdn_ba, (x, weight))


def test_it_takes_a_plain_bf16_layer_only():
    """`takes` on a bf16 projection with vLLM's UnquantizedLinearMethod as in_proj_ba."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    projection = torch.nn.Linear(256, 12, bias=False, dtype=torch.bfloat16)
    projection.quant_method = UnquantizedLinearMethod()
    layer = SimpleNamespace(gqa_interleaved_layout=False, tp_size=1, in_proj_ba=projection)
    assert gdn_ba.takes(layer)
    for other in [{"gqa_interleaved_layout": True}, {"tp_size": 2}, {"in_proj_qkv": object()}]:
        assert not gdn_ba.takes(SimpleNamespace(**{**vars(layer), **other}))
    projection.quant_method = object()  # a quantized in_proj_ba keeps vLLM's path
    assert not gdn_ba.takes(layer)


def test_the_built_layer_calls_the_op_only_when_it_takes_the_layer(monkeypatch, engine_log):
    """The gdn_layer_built seam: the forward's hyperqwen_ba_projection is None (vLLM's GEMM,
    split and copies) unless GDN_BA=1 and the op takes the layer."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from hyperqwen.engine import seams

    projection = torch.nn.Linear(256, 12, bias=False, dtype=torch.bfloat16)
    projection.quant_method = UnquantizedLinearMethod()
    layer = SimpleNamespace(gqa_interleaved_layout=False, tp_size=1, in_proj_ba=projection)
    monkeypatch.delenv(GDN_BA.env, raising=False)
    seams.gdn_layer_built(layer)
    assert layer.hyperqwen_ba_projection is None
    monkeypatch.setenv(GDN_BA.env, "1")
    gdn_ba._announce.cache_clear()  # as in a fresh vLLM process
    seams.gdn_layer_built(layer)
    seams.gdn_layer_built(layer)
    assert layer.hyperqwen_ba_projection is torch.ops.hyperqwen.gdn_ba
    assert engine_log.text.count("GDN b/a projection: HyperQwen's kernel") == 1  # once a process
    split_across_ranks = SimpleNamespace(**{**vars(layer), "tp_size": 2})
    seams.gdn_layer_built(split_across_ranks)
    assert split_across_ranks.hyperqwen_ba_projection is None
