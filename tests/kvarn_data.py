"""Random K and V shaped like real KV caches for the KVarN tests: never zero, with outliers.

Keys: Gaussian entries, 8 channels with 4-12x the spread and 4 of them with large offsets
(what per-channel key quantizers exist for), a lognormal magnitude per token, and a few
spiky entries (massive activations). Values: Gaussian, 6 outlier channels with 4-10x the
spread, a milder per-token magnitude. Every tensor is [tokens, heads, D] in bf16.
"""

from __future__ import annotations

import torch


def _outlier_channels(generator, heads, d, spreads):
    scale = torch.ones(heads, d, dtype=torch.float64)
    channels = torch.stack(
        [torch.randperm(d, generator=generator)[: len(spreads)] for _ in range(heads)]
    )
    scale.scatter_(1, channels, torch.tensor(spreads, dtype=torch.float64).expand(heads, -1))
    return scale, channels


def outlier_keys(tokens: int, heads: int, d: int, seed: int, spikes: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale, channels = _outlier_channels(g, heads, d, [12.0, 10, 8, 8, 6, 6, 5, 4])
    offset = torch.zeros(heads, d, dtype=torch.float64)
    offset.scatter_(
        1, channels[:, :4], torch.tensor([20.0, -15, 10, -8], dtype=torch.float64).expand(heads, -1)
    )
    magnitude = torch.exp(0.5 * torch.randn(tokens, heads, 1, generator=g, dtype=torch.float64))
    k = torch.randn(tokens, heads, d, generator=g, dtype=torch.float64) * scale * magnitude + offset
    for _ in range(spikes * max(1, tokens // 128)):
        t, h, j = (int(torch.randint(n, (1,), generator=g)) for n in (tokens, heads, d))
        k[t, h, j] += 80.0 if torch.rand(1, generator=g) < 0.5 else -80.0
    return k.to(torch.bfloat16)


def outlier_values(tokens: int, heads: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale, _ = _outlier_channels(g, heads, d, [10.0, 8, 6, 6, 5, 4])
    magnitude = torch.exp(0.3 * torch.randn(tokens, heads, 1, generator=g, dtype=torch.float64))
    return (torch.randn(tokens, heads, d, generator=g, dtype=torch.float64) * scale * magnitude).to(
        torch.bfloat16
    )
