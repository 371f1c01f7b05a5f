"""Is a stored KVarN tile the float64 reference's encoding (kvarn/quantize.py) of its input?

Not bit for bit everywhere: the encoding is discontinuous (a code on a grid midpoint flips, and
the least-squares refit of the grid then jumps: a token's 2-bit v_scale by several fp16 steps),
so the kernels' fp32 and the reference's float64 may take different branches where a decision
lies within float error of its flip point. The criterion, per (tile, head):

- token scales r: the reference's fp16 value; where r is within TIE_MARGIN of an fp16 rounding
  flip (quantize.fp16_rounding_gap), either fp16 neighbour;
- K per channel (on K·H / r with the stored r, so a flipped r is not counted twice) and V per
  token: in each group whose reference decisions all lie further than TIE_MARGIN from their flip
  points (quantize.fit_grid_margin), scale, zero and every code exactly the reference's;
- in every group: scale finite and at least MIN_STEP, zero finite, each code the nearest on
  the stored grid (codes_on_grid) unless within TIE_MARGIN of a midpoint, and the group's
  squared error in the rotated basis at most GROUP_SLACK times the reference's;
- the tile's squared error (K and V each) at most TILE_SLACK times the full reference's.
"""

from __future__ import annotations

import torch

from hyperqwen.kvarn import quantize as q
from hyperqwen.kvarn.hadamard import rotate_reference
from hyperqwen.kvarn.layout import TileLayout
from hyperqwen.kvarn.packing import unpack_tile

# fp32's error in the margins' quantities is a few ulps (2^-24 each) per operation and grows
# with a 256-term sum's length, far below this (a fp32 emulation's differing groups lie well
# inside it); it exempts a minority of the groups from exact agreement on the 27B test data
TIE_MARGIN = 2.0**-18
# a branch taken differently at a tie ends at another local optimum of the alternating fit:
# nearly as good for its group, and the tile (hundreds of groups) barely moves
GROUP_SLACK, TILE_SLACK = 1.10, 1.001


def stored_tiles(pool: torch.Tensor, block_ids, layout: TileLayout) -> q.QuantizedTile:
    """The tiles of pool[block_ids] (all heads) unpacked, fields [tiles, heads, ...]."""
    tiles = [[unpack_tile(pool[b, h], layout) for h in range(pool.shape[1])] for b in block_ids]
    return q.QuantizedTile(
        **{
            name: torch.stack([torch.stack([getattr(t, name) for t in row]) for row in tiles])
            for name in q.QuantizedTile.__dataclass_fields__
        }
    )


def _where(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _token_scale_faults(have, k_rot) -> list[str]:
    exact = q.balance_token_scales(k_rot)
    want = q.to_fp16_values(exact)
    want16 = want.to(torch.float16)
    neighbours = [
        torch.nextafter(want16, torch.full_like(want16, sign * torch.inf)).to(torch.float64)
        for sign in (1, -1)
    ]
    near_tie = q.fp16_rounding_gap(exact) / exact < TIE_MARGIN
    ok = (have == want) | (near_tie & ((have == neighbours[0]) | (have == neighbours[1])))
    if ok.all():
        return []
    at = _where(~ok)
    return [f"k_token_scale: {int((~ok).sum())} wrong, first at {at}: {have[at]} want {want[at]}"]


def _grid_faults(name, y, weight, dim, levels, scale, zero, codes):
    """Faults of the groups of y [tiles, heads, T, D] along dim (grids scale, zero keepdim,
    codes), and each tile's squared error in the rotated basis (y times weight)."""
    want_scale, want_zero = q.fit_grid(y, levels, dim)
    want_codes = q.codes_on_grid(y, want_scale, want_zero, levels)
    stable = q.fit_grid_margin(y, levels, dim) >= TIE_MARGIN
    same = (scale == want_scale) & (zero == want_zero) & (codes == want_codes).all(dim, True)
    faults = []
    if not (~stable | same).all():
        at = _where(stable & ~same)
        faults.append(
            f"{name}: {int((stable & ~same).sum())} groups away from ties differ, first at "
            f"{at}: scale {scale[at]} want {want_scale[at]}, zero {zero[at]} want {want_zero[at]}"
        )
    valid = scale.isfinite() & (scale >= q.MIN_STEP) & zero.isfinite()
    if not valid.all():
        at = _where(~valid)
        faults.append(f"{name}: scale {scale[at]} or zero {zero[at]} invalid at {at}")
        return faults, torch.full(y.shape[:2], torch.inf, dtype=y.dtype)
    nearest = q.codes_on_grid(y, scale, zero, levels)
    off_grid = (codes != nearest) & (q.code_margin(y, scale, zero, levels) >= TIE_MARGIN)
    if off_grid.any():
        at = _where(off_grid)
        faults.append(
            f"{name}: {int(off_grid.sum())} codes not the nearest on their grid, first at {at}: "
            f"{codes[at]} want {nearest[at]}"
        )
    error = ((codes * scale + zero - y) * weight).square().sum(dim, True)
    want_error = ((want_codes * want_scale + want_zero - y) * weight).square().sum(dim, True)
    worse = error > GROUP_SLACK * want_error + 1e-30
    if worse.any():
        at = _where(worse)
        ratio = float((error[at] / want_error[at]).item())
        faults.append(
            f"{name}: {int(worse.sum())} groups' squared error over {GROUP_SLACK} times the "
            f"reference's, first at {at}: ratio {ratio:.4f}"
        )
    return faults, error.sum((-2, -1))


def encoding_faults(got: q.QuantizedTile, key, value, v_levels: int = q.V_LEVELS) -> list[str]:
    """Every violation of the criterion above by stored tiles `got` (stored_tiles, [tiles,
    heads]) of key and value [tiles, 128, heads, D], values of codes 0 .. v_levels, with the
    numbers that show how far off; empty when they hold."""
    k_rot = rotate_reference(key.transpose(1, 2).to(torch.float64))
    v_rot = rotate_reference(value.transpose(1, 2).to(torch.float64))
    r = got.k_token_scale[..., None]
    reference = q.quantize_rotated(k_rot, v_rot, v_levels=v_levels)
    want_k, want_v = q.dequantize_rotated(reference)
    faults = _token_scale_faults(got.k_token_scale, k_rot)
    errors = {}
    for name, y, weight, dim, levels, scale, zero, codes in (
        ("k", k_rot / r, r, -2, q.K_LEVELS, got.k_scale[..., None, :], got.k_zero[..., None, :],
         got.k_codes),
        ("v", v_rot, 1.0, -1, v_levels, got.v_scale[..., None], got.v_zero[..., None],
         got.v_codes),
    ):  # fmt: skip
        found, errors[name] = _grid_faults(name, y, weight, dim, levels, scale, zero, codes)
        faults += found
    for name, want, x in (("k", want_k, k_rot), ("v", want_v, v_rot)):
        ratio = (errors[name] / (want - x).square().sum((-2, -1))).nan_to_num(torch.inf)
        worst = _where(ratio == ratio.max())
        if not ratio[worst] <= TILE_SLACK:
            faults.append(
                f"{name}: tile {worst} (tile, head) has {float(ratio[worst]):.6f} times the "
                f"reference's squared error; {int((ratio > TILE_SLACK).sum())} tiles over "
                f"{TILE_SLACK}"
            )
    return faults
