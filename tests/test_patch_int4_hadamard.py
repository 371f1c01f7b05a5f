"""patches/int4-hadamard-even-chunks.patch: int4_per_token_head's rotation hands hadacore only
even counts of 256-element chunks, and rotates as before. hadacore is CUDA-only, so a stand-in
takes its place here: it refuses an odd chunk count (the count whose last warp skips its wait,
vllm-project/vllm#53167) and rotates exactly; the patched function's result is checked against
vLLM's own CPU butterfly (its third tier) on random rows, for the head dims and row counts the
attention layers send (decode, verify, odd and long prefills) and both dtype branches."""

from __future__ import annotations

import math

import pytest
import torch
import vllm._custom_ops as custom_ops
from vllm.v1.attention.ops import int4_per_token_head

CHUNK = 256  # elements per hadacore chunk; a warp takes two


def sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@pytest.fixture
def hadacore(monkeypatch) -> list[tuple[int, ...]]:
    """The CUDA kernel's stand-in: x @ H / sqrt(d) in place, refusing odd chunk counts."""
    seen = []

    def transform(x: torch.Tensor, inplace: bool) -> torch.Tensor:
        assert inplace and x.is_contiguous()
        d = x.shape[-1]
        chunks = math.ceil(x.numel() / CHUNK)
        seen.append(tuple(x.shape))
        if d <= CHUNK and x.numel() > CHUNK:
            assert chunks % 2 == 0, f"hadacore given {chunks} chunks of {tuple(x.shape)}"
        x.copy_((x.double() @ sylvester(d) / math.sqrt(d)).to(x.dtype))
        return x

    monkeypatch.setattr(int4_per_token_head, "_hadacore_available", lambda: True)
    monkeypatch.setattr(custom_ops, "hadacore_transform", transform, raising=False)
    return seen


def butterfly(x: torch.Tensor) -> torch.Tensor:
    """vLLM's own third tier (the path a CPU tensor takes without the stand-in)."""
    d, h = x.shape[-1], 1
    while h < d:
        xv = x.view(*x.shape[:-1], d // (2 * h), 2, h)
        x = torch.stack([xv[..., 0, :] + xv[..., 1, :], xv[..., 0, :] - xv[..., 1, :]], -2)
        x = x.reshape(*x.shape[:-3], d)
        h <<= 1
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize(("tokens", "heads"), [(1, 9), (4, 9), (1, 3), (149, 3), (4, 24), (9, 1)])
def test_rotation_sends_even_chunk_counts_and_matches_the_butterfly(
    hadacore, dtype, head_dim, tokens, heads
):
    generator = torch.Generator().manual_seed(tokens * 1000 + heads * 10 + head_dim)
    x = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
    before = x.clone()
    got = int4_per_token_head.fast_hadamard_transform(x)
    assert hadacore, "the rotation did not reach hadacore"
    assert torch.equal(x, before)  # the input is left alone
    assert got.shape == x.shape and got.dtype == dtype
    want = butterfly(x.double())
    scale = want.abs().amax(dim=-1, keepdim=True)
    assert float(((got.double() - want).abs() / scale).max()) < 2e-2
