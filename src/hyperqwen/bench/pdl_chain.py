"""HyperQwen's decode-step kernels as a chain of Gated DeltaNet layers, on static buffers a CUDA
graph can replay, with or without programmatic dependent launch (src/hyperqwen/kernels/pdl.py).

Per layer, a verify step of one sequence (T tokens) through the kernels HyperQwen owns, each
reading what one before it wrote:

  x [T, hidden] -w4a16-> q|k|v rows -split_qkv-> q, k, v;  x -ba_proj-> b, a
  q, k, v, b, a, the layer's state -gdn_recurrent-> o [T, value_dim] -w4a16-> y [T, hidden]
  the next layer's x = x + y (a torch add: a kernel launched without PDL, as vLLM's are)

The first layer's x is a copy of the step's input made in the chain (in a graph, a memcpy node
before the first kernel launched with PDL). The layer's own projection also yields z, and its
output goes through vLLM's conv1d and gated norm, left out here: in vLLM's layer fewer of these
kernels follow each other directly. Random weights, the split-K and the persistent W4A16 launch
shapes, fp32 state. Used by `hyperqwen bench pdl` (timing) and tests/test_kernel_pdl_gpu.py (PDL
on against off, bit for bit, under graph replay with changing inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperqwen.kernels import w4a16
from hyperqwen.kernels.ba_proj import ba_projection
from hyperqwen.kernels.gdn_recurrent import gdn_recurrent_update
from hyperqwen.kernels.split_qkv import split_qkv

# the launch shapes the chain's two GEMMs use: split-K through the workspace, and a persistent
# grid (both of `bench kernels`' winning kinds on the H200)
IN_PROJ_TILE = w4a16.TileConfig(64, 256, 4)
OUT_PROJ_TILE = w4a16.TileConfig(64, 256, 4, programs_per_sm=4)


@dataclass
class LayerWeights:
    in_proj: tuple  # w4a16 tiles [q|k|v dims, hidden]
    ba: object  # bf16 [2 * value heads, hidden]
    out_proj: tuple  # w4a16 tiles [hidden, value_dim]
    A_log: object
    dt_bias: object


def _w4a16_tiles(n: int, k: int, generator, device):
    codes = torch.randint(0, 16, (n, k), generator=generator)
    # scales near 1 / (4.6 sqrt(k)): outputs about as large as inputs, through every layer
    scale = (torch.rand((n, k // 128), generator=generator) + 0.5) / (4.6 * k**0.5)
    words, scales = w4a16.tiles_from_checkpoint(w4a16.pack_codes(codes), scale.bfloat16())
    return words.to(device), scales.to(device)


def make_weights(geometry, layers: int, seed: int = 0, device: str = "cuda") -> list:
    generator = torch.Generator().manual_seed(seed)
    hidden, v_heads = geometry.hidden_size, geometry.linear_num_value_heads
    qkv = 2 * geometry.linear_key_dim + geometry.linear_value_dim
    return [
        LayerWeights(
            in_proj=_w4a16_tiles(qkv, hidden, generator, device),
            ba=(torch.randn((2 * v_heads, hidden), generator=generator) * hidden**-0.5)
            .bfloat16()
            .to(device),
            out_proj=_w4a16_tiles(hidden, geometry.linear_value_dim, generator, device),
            A_log=(torch.randn(v_heads, generator=generator) * 0.5).to(device),
            dt_bias=(torch.randn(v_heads, generator=generator) * 0.5).to(device),
        )
        for _ in range(layers)
    ]


class Chain:
    """The layers' kernels on static buffers (a CUDA graph replays them), PDL on or off."""

    def __init__(self, geometry, weights: list, tokens: int, pdl: bool, device: str = "cuda"):
        self.geometry, self.weights, self.tokens, self.pdl = geometry, weights, tokens, pdl
        g = geometry
        self.qkv_dims = (g.linear_key_dim, g.linear_key_dim, g.linear_value_dim)
        v_heads, dim = g.linear_num_value_heads, g.linear_value_head_dim
        empty = {"device": device, "dtype": torch.bfloat16}
        # the step's input, copied into x[0] first (in a graph: a memcpy node before the first
        # kernel launched with PDL); x of every layer and the last layer's output
        self.x_in = torch.empty((tokens, g.hidden_size), **empty)
        self.x = [torch.empty((tokens, g.hidden_size), **empty) for _ in range(len(weights) + 1)]
        self.rows = torch.empty((tokens, sum(self.qkv_dims)), **empty)
        self.qkv = torch.empty(tokens * sum(self.qkv_dims), **empty)
        self.b, self.a = (torch.empty((tokens, v_heads), **empty) for _ in range(2))
        self.o = torch.empty((1, tokens, v_heads, dim), **empty)
        self.y = torch.empty((tokens, g.hidden_size), **empty)
        # one verify sequence: slots 1..T, the initial one at accepted - 1
        self.states = [
            torch.empty((tokens + 1, v_heads, dim, g.linear_key_head_dim), device=device)
            for _ in weights
        ]
        self.cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        self.indices = torch.arange(1, tokens + 1, dtype=torch.int32, device=device)[None]
        self.accepted = torch.ones(1, dtype=torch.int32, device=device)
        for config, n in ((IN_PROJ_TILE, sum(self.qkv_dims)), (OUT_PROJ_TILE, g.hidden_size)):
            w4a16.WORKSPACE.reserve(torch.device(device), *w4a16.workspace_size(tokens, n, config))

    def load(self, x, states, accepted: int) -> None:
        """Inputs of one step: x [T, hidden], each layer's state slots, accepted tokens."""
        self.x_in.copy_(x)
        for mine, state in zip(self.states, states, strict=True):
            mine.copy_(state)
        self.accepted.fill_(accepted)

    def run(self) -> None:
        g, pdl, tokens = self.geometry, self.pdl, self.tokens
        q_size, k_size, _ = (tokens * dim for dim in self.qkv_dims)
        heads, v_heads = g.linear_num_key_heads, g.linear_num_value_heads
        self.x[0].copy_(self.x_in)
        for layer, (weights, state) in enumerate(zip(self.weights, self.states, strict=True)):
            x = self.x[layer]
            w4a16.w4a16_matmul(x, *weights.in_proj, 128, IN_PROJ_TILE, out=self.rows, pdl=pdl)
            split_qkv(self.rows, *self.qkv_dims, out=self.qkv, pdl=pdl)
            ba_projection(x, weights.ba, out=(self.b, self.a), pdl=pdl)
            q, k, v = self.qkv.split([q_size, k_size, tokens * self.qkv_dims[2]])
            gdn_recurrent_update(
                weights.A_log, self.a, self.b, weights.dt_bias,
                q.view(1, tokens, heads, -1), k.view(1, tokens, heads, -1),
                v.view(1, tokens, v_heads, -1), state, self.cu_seqlens, self.indices,
                self.accepted, out=self.o, pdl=pdl,
            )  # fmt: skip
            o = self.o.view(tokens, -1)
            w4a16.w4a16_matmul(o, *weights.out_proj, 128, OUT_PROJ_TILE, out=self.y, pdl=pdl)
            torch.add(x, self.y, out=self.x[layer + 1])


def random_step(geometry, layers: int, tokens: int, seed: int, device: str = "cuda"):
    """(x, states, accepted) of one step, different for every seed."""
    generator = torch.Generator().manual_seed(seed)
    g = geometry
    x = torch.randn((tokens, g.hidden_size), generator=generator).bfloat16().to(device)
    shape = (tokens + 1, g.linear_num_value_heads, g.linear_value_head_dim, g.linear_key_head_dim)
    states = [(torch.randn(shape, generator=generator) * 0.3).to(device) for _ in range(layers)]
    accepted = 1 + seed % tokens
    return x, states, accepted
