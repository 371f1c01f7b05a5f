"""Programmatic dependent launch on the GPU (sm90+): HyperQwen's decode-step kernels in a chain
of GDN layers (bench/pdl_chain.py: w4a16 -> split_qkv -> ba_proj -> gdn_recurrent -> w4a16 ->
a torch add, per layer), captured in a CUDA graph with PDL on and another with it off, replayed
with new inputs each time (x, every layer's state, the accepted count). A kernel that read its
predecessor's output before it was written would read the last replay's: every layer's x and
state must match the chain without PDL bit for bit, and the eager chain too.

    pytest -m gpu tests/test_kernel_pdl_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

LAYERS = 4
REPLAYS = 60


def captured(chain):
    """A CUDA graph of chain.run, after one eager run (Triton compiles, workspaces grow)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        chain.run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        chain.run()
    return graph


def bits(chain) -> list[torch.Tensor]:
    """Every layer's x and state, as integers (NaN compares equal to itself)."""
    return [x.view(torch.int16).clone() for x in chain.x] + [
        state.view(torch.int32).clone() for state in chain.states
    ]


def assert_same(got, want, what):
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(mine, theirs), f"{what}: tensor {index} differs"


@pytest.mark.parametrize("tokens", [1, 4])
def test_the_chain_with_pdl_is_bit_exact_under_graph_replay(tokens):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs an sm90+ GPU")
    from hyperqwen.bench.pdl_chain import Chain, make_weights, random_step
    from hyperqwen.checkpoint.geometry import PRESETS

    geometry = PRESETS["27b"]
    weights = make_weights(geometry, LAYERS)
    on, off, eager = (Chain(geometry, weights, tokens, pdl) for pdl in (True, False, False))
    graphs = {id(chain): captured(chain) for chain in (on, off)}
    for replay in range(REPLAYS):
        step = random_step(geometry, LAYERS, tokens, seed=replay)
        for chain in (on, off):
            chain.load(*step)
            graphs[id(chain)].replay()
        if replay % 10 == 0:
            eager.load(*step)
            eager.run()
        torch.cuda.synchronize()
        want = bits(off)
        assert all(not torch.isnan(x.float()).any() for x in off.x), "the chain overflowed"
        assert_same(bits(on), want, f"replay {replay}, PDL on against off")
        if replay % 10 == 0:
            assert_same(bits(eager), want, f"replay {replay}, eager against the graph")
