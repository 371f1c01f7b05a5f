"""KVarN's tile quantizer, the float64 reference the Triton store kernel is tested against.

A tile is one KV head's keys and values for 128 consecutive tokens, K and V each [128, D].
Encoding a tile, in order:

1. Rotation. K and V are multiplied by the normalised Walsh-Hadamard matrix along head_dim
   (hadamard.py); everything below works on the rotated tile X = K·H (or V·H).

2. Per-tile scale normalisation (keys only), `balance_token_scales`. Positive channel scales
   c [D] and token scales r [T] are estimated by alternating root-mean-squares,
   starting from r = 1:
       c_j <- sqrt(mean_i (X_ij / r_i)^2),   then   r_i <- sqrt(mean_j (X_ij / c_j)^2),
   `BALANCE_ROUNDS` times, each floored at `MIN_SCALE`. The token scale r is rounded to fp16
   and stored; the tile is quantized as Y = X / r (row i divided by r_i). Why: keys are
   quantized per channel, so one token of large norm (or one spiky entry, which the rotation
   has spread over the whole row) would set the range of every channel and coarsen the grid
   for the other 127 tokens; dividing rows by r gives every token the same weight. The
   channel scale c is not stored: a per-channel grid absorbs any per-channel factor, so c
   only keeps outlier channels from dominating the token estimate. Values are not
   normalised: their grid is per token, which absorbs any per-token factor, and after the
   rotation every channel has the same variance in expectation, so a stored channel scale
   (4 bytes a token) would buy almost nothing. One round: on the outlier data of
   tests/test_kvarn_quantize.py further rounds do not lower the error (the test measures
   it), so the alternation stops after its first full pass.

3. Asymmetric round-to-nearest with an iteratively fitted grid, `fit_grid`. K per channel
   (each of D channels over the 128 tokens, 4 bits, codes 0..15), V per token (each token
   over D channels, 2 bits, codes 0..3; or 3 bits, codes 0..7, with `v_levels` 7, which
   layout.py's 3-bit tiles store). A group y with L + 1 levels gets scale s and zero z,
   codes q = clamp(floor((y - z) / s + 1/2), 0, L) and reconstruction q·s + z. The grid
   starts at the group's range (z = min, s = (max - min) / L) and is refined `GRID_ROUNDS`
   times by alternating the two exact minimisations of the squared error: the codes for a
   fixed grid (rounding), then s and z for fixed codes (least squares: s = cov(q, y) /
   var(q), z = mean(y) - s·mean(q); kept when var(q) = 0). Neither step can raise the
   error, so up to the final fp16 rounding it never ends above plain min/max RTN; a 2-bit
   grid gains most, because a min/max step spends its four levels on the tails.
   Finally s (floored at fp16's smallest step) and z are rounded to fp16, and the codes are
   computed once more from the rounded values, which are what the pool stores.

Decoding is q·s + z per element, times r_i for keys, in the rotated basis: attention reads it
with a rotated query and rotates its output back (hadamard.py). Bit widths, levels and the
constants above are shared with the kernels (store.py, dequant.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperqwen.kvarn.hadamard import rotate_reference
from hyperqwen.kvarn.layout import K_BITS, V_BITS

K_LEVELS, V_LEVELS = 2**K_BITS - 1, 2**V_BITS - 1
BALANCE_ROUNDS = 1
GRID_ROUNDS = 4
MIN_SCALE = 2.0**-14  # floor of the balance scales: fp16's smallest normal number
MIN_STEP = 2.0**-24  # floor of a grid step: fp16's smallest subnormal, never rounds to 0


@dataclass(frozen=True)
class QuantizedTile:
    """One (block, KV head) tile, decoded to numbers: codes as int64, scales and zeros as
    float64 holding fp16 values exactly (what the packed tile stores, layout.py). Shapes are
    one tile's; a batch of tiles puts its dimensions in front of each."""

    k_codes: torch.Tensor  # [T, D], 0..15
    k_scale: torch.Tensor  # [D], per channel
    k_zero: torch.Tensor  # [D]
    k_token_scale: torch.Tensor  # [T], r
    v_codes: torch.Tensor  # [T, D], 0..3 (0..7 for 3-bit values)
    v_scale: torch.Tensor  # [T], per token
    v_zero: torch.Tensor  # [T]


def to_fp16_values(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float64)


def balance_token_scales(x: torch.Tensor, rounds: int = BALANCE_ROUNDS) -> torch.Tensor:
    """The token scales r [..., T] of step 2 for tiles x [..., T, D] (before fp16 rounding)."""
    r = torch.ones(*x.shape[:-1], 1, dtype=x.dtype)
    for _ in range(rounds):
        c = (x / r).square().mean(dim=-2, keepdim=True).sqrt().clamp_min(MIN_SCALE)
        r = (x / c).square().mean(dim=-1, keepdim=True).sqrt().clamp_min(MIN_SCALE)
    return r[..., 0]


def codes_on_grid(y: torch.Tensor, scale, zero, levels: int) -> torch.Tensor:
    return torch.floor((y - zero) / scale + 0.5).clamp(0, levels)


def fit_grid(y: torch.Tensor, levels: int, dim: int, rounds: int = GRID_ROUNDS):
    """Step 3's scale and zero of each group of y [..., T, D], the groups running along `dim`
    (-2: one grid per channel, -1: one per token), as fp16 values in float64, keepdim shapes."""
    scale, zero, _ = _fitted_grid(y, levels, dim, rounds)
    return to_fp16_values(scale), to_fp16_values(zero)


def _fitted_grid(y: torch.Tensor, levels: int, dim: int, rounds: int):
    """fit_grid before the fp16 rounding, and each group's smallest code margin over its
    rounds (code_margin)."""
    low, high = y.amin(dim=dim, keepdim=True), y.amax(dim=dim, keepdim=True)
    zero = low
    scale = ((high - low) / levels).clamp_min(MIN_STEP)
    margin = torch.full_like(low, torch.inf)
    for _ in range(rounds):
        margin = torch.minimum(margin, code_margin(y, scale, zero, levels).amin(dim, True))
        q = codes_on_grid(y, scale, zero, levels)
        q_dev = q - q.mean(dim=dim, keepdim=True)
        y_mean = y.mean(dim=dim, keepdim=True)
        var = q_dev.square().mean(dim=dim, keepdim=True)
        cov = (q_dev * (y - y_mean)).mean(dim=dim, keepdim=True)
        fitted = cov / torch.where(var > 0, var, 1.0)
        scale = torch.where(var > 0, fitted.clamp_min(MIN_STEP), scale)
        zero = torch.where(var > 0, y_mean - fitted * q.mean(dim=dim, keepdim=True), zero)
    return scale.clamp_min(MIN_STEP), zero, margin


# Tie margins. The encoding is discontinuous: a value on a grid midpoint or an fp16 rounding
# boundary flips a code or a stored step, and the next least-squares refit of the grid then
# jumps (a token's 2-bit v_scale by several fp16 steps for one flipped code). A computation in
# other arithmetic (the kernels' fp32) reaches this reference's result exactly only where
# every decision is further from its flip point than its own error; the margins below are that
# distance, relative to the magnitudes the decision is computed from.


def code_margin(y: torch.Tensor, scale, zero, levels: int) -> torch.Tensor:
    """Per element of y: its distance from the nearest point where codes_on_grid flips, in
    y's units, relative to |y| + |zero| + scale."""
    u = (y - zero) / scale
    flip = u.floor().clamp(0, levels - 1) + 0.5
    return (u - flip).abs() * scale / (y.abs() + zero.abs() + scale)


def fp16_rounding_gap(x: torch.Tensor) -> torch.Tensor:
    """Distance of each x (float64) from the nearest point where its fp16 rounding flips."""
    x16 = x.to(torch.float16)
    up = torch.nextafter(x16, torch.full_like(x16, torch.inf)).to(torch.float64)
    down = torch.nextafter(x16, torch.full_like(x16, -torch.inf)).to(torch.float64)
    x16 = x16.to(torch.float64)
    return torch.minimum((x16 + up) / 2 - x, x - (x16 + down) / 2).abs()


def fit_grid_margin(y: torch.Tensor, levels: int, dim: int, rounds: int = GRID_ROUNDS):
    """Each group's tie margin for fit_grid(y, levels, dim), keepdim: the smallest over its
    rounds' codes, the fp16 rounding of scale (relative to it) and zero (relative to
    |zero| + scale * levels) and the final codes."""
    scale, zero, margin = _fitted_grid(y, levels, dim, rounds)
    final = code_margin(y, to_fp16_values(scale), to_fp16_values(zero), levels)
    return torch.stack(
        (
            margin,
            fp16_rounding_gap(scale) / scale,
            fp16_rounding_gap(zero) / (zero.abs() + scale * levels),
            final.amin(dim=dim, keepdim=True),
        )
    ).amin(dim=0)


def quantize_rotated(
    k: torch.Tensor,
    v: torch.Tensor,
    balance_rounds: int = BALANCE_ROUNDS,
    grid_rounds: int = GRID_ROUNDS,
    v_levels: int = V_LEVELS,
) -> QuantizedTile:
    """Steps 2-3 on already rotated tiles [..., T, D] (or, for the no-rotation baseline,
    plain ones); leading dimensions are independent tiles. `v_levels`: V_LEVELS (2-bit values)
    or 7 (3-bit, TileLayout.v_levels of v_bits=3) as the kernels store them; others only for
    format_sim.py's comparisons."""
    k, v = k.to(torch.float64), v.to(torch.float64)
    if k.dim() < 2 or k.shape != v.shape:
        raise ValueError(
            f"a tile is K and V of one shape [T, D]; got {list(k.shape)} and {list(v.shape)}"
        )
    r = (
        to_fp16_values(balance_token_scales(k, balance_rounds))
        if balance_rounds
        else torch.ones(k.shape[:-1], dtype=k.dtype)
    )
    y = k / r[..., None]
    k_scale, k_zero = fit_grid(y, K_LEVELS, dim=-2, rounds=grid_rounds)
    v_scale, v_zero = fit_grid(v, v_levels, dim=-1, rounds=grid_rounds)
    return QuantizedTile(
        k_codes=codes_on_grid(y, k_scale, k_zero, K_LEVELS).to(torch.int64),
        k_scale=k_scale[..., 0, :],
        k_zero=k_zero[..., 0, :],
        k_token_scale=r,
        v_codes=codes_on_grid(v, v_scale, v_zero, v_levels).to(torch.int64),
        v_scale=v_scale[..., 0],
        v_zero=v_zero[..., 0],
    )


def quantize_tile(k: torch.Tensor, v: torch.Tensor, v_levels: int = V_LEVELS) -> QuantizedTile:
    """KVarN's encoding of tiles' K and V [..., T, D] (any float dtype), in float64."""
    return quantize_rotated(
        rotate_reference(k.to(torch.float64)),
        rotate_reference(v.to(torch.float64)),
        v_levels=v_levels,
    )


def dequantize_rotated(tile: QuantizedTile) -> tuple[torch.Tensor, torch.Tensor]:
    """(K·H, V·H) as the tiles encode them, float64 [..., T, D]: the basis attention reads in."""
    k = tile.k_token_scale[..., None] * (
        tile.k_codes * tile.k_scale[..., None, :] + tile.k_zero[..., None, :]
    )
    v = tile.v_codes * tile.v_scale[..., None] + tile.v_zero[..., None]
    return k, v


def dequantize_tile(tile: QuantizedTile) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) in the model's basis, float64 [..., T, D] (H is its own inverse)."""
    k, v = dequantize_rotated(tile)
    return rotate_reference(k), rotate_reference(v)
