"""KVarN's store and dequantize kernels (kvarn/store.py, kvarn/dequant.py) against the float64
reference (kvarn/quantize.py, layout.py) on the CPU under Triton's interpreter: the 27B's
4 KV heads of head_dim 256 on outlier data (tests/kvarn_data.py), other head dims, strided
inputs, outputs poisoned first, pool bytes outside the named blocks left alone, a pool past
2^32 bytes, and tiles of 3-bit values (layout.py's v_high plane; KVARN_V_BITS=3) at a small
shape.

Bounds: the kernel works in fp32 where the reference works in float64, and the encoding is
discontinuous at ties, so stored tiles are judged by tests/kvarn_encoding.py's criterion:
exactly the reference's away from ties, a valid encoding of the reference's quality near them
(a test below shows it catches broken encodings). Decoding is then compared as a whole: against
the reference's own decoding of the same bytes only bf16's output rounding remains (2^-9
relative per element, under 4e-3 in the norm).
"""

from __future__ import annotations

import pytest
import torch
from kvarn_data import outlier_keys, outlier_values
from kvarn_encoding import TIE_MARGIN, encoding_faults, stored_tiles

from hyperqwen.bench.kernels import relative_error
from hyperqwen.kvarn import quantize
from hyperqwen.kvarn.dequant import dequantize_tiles
from hyperqwen.kvarn.hadamard import rotate_reference
from hyperqwen.kvarn.layout import TileLayout
from hyperqwen.kvarn.packing import pack_tile, unpack_tile
from hyperqwen.kvarn.store import store_tiles

HEADS_27B, D_27B = 4, 256
POISON = 0xFF  # as fp16 pairs: NaN


def tiles(n: int, heads: int, d: int, seed: int):
    """Key and value tiles [n, 128, heads, D], bf16, with outliers."""
    return tuple(
        x.reshape(n, 128, heads, d)
        for x in (
            outlier_keys(n * 128, heads, d, seed),
            outlier_values(n * 128, heads, d, seed + 1),
        )
    )


def assert_pool_holds_the_reference(pool, block_ids, key, value, layout):
    """pool[block_ids[i]] encodes tile i of key and value by kvarn_encoding's criterion; a
    failure lists each violation with the numbers of its first and worst places."""
    faults = _faults(pool, block_ids, key, value, layout)
    assert not faults, "\n".join(faults)


def _faults(pool, block_ids, key, value, layout=None):
    layout = layout or TileLayout(head_dim=key.shape[-1])
    ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else range(block_ids)
    return encoding_faults(stored_tiles(pool, ids, layout), key, value, layout.v_levels)


def _away_from_ties(margin: torch.Tensor) -> tuple[int, ...]:
    """The last index whose margin is at least the criterion's TIE_MARGIN."""
    return tuple(int(i) for i in (margin >= TIE_MARGIN).nonzero()[-1])


def test_the_criterion_catches_broken_encodings():
    """The reference's own tiles pass; each way a kernel can be wrong is caught: scales off by
    a factor, by one fp16 step in one group, one code off, one token scale off, codes that do
    not match their grid, a NaN scale."""
    layout = TileLayout(head_dim=D_27B)
    key, value = tiles(2, HEADS_27B, D_27B, seed=61)
    reference = quantize.quantize_tile(key.transpose(1, 2), value.transpose(1, 2))
    fields = reference.__dict__

    def pool_of(tile):
        return torch.stack(
            [torch.stack([pack_tile(quantize.QuantizedTile(**{n: f[i, h] for n, f in
             tile.__dict__.items()}), layout) for h in range(HEADS_27B)]) for i in range(2)]
        )  # fmt: skip

    assert not _faults(pool_of(reference), 2, key, value)

    # single changes go where the reference is away from ties, so exact agreement is due
    k_rot, v_rot = (rotate_reference(x.transpose(1, 2).double()) for x in (key, value))
    y = k_rot / fields["k_token_scale"][..., None]
    k_group = _away_from_ties(quantize.fit_grid_margin(y, quantize.K_LEVELS, -2)[..., 0, :])
    v_group = _away_from_ties(quantize.fit_grid_margin(v_rot, quantize.V_LEVELS, -1)[..., 0])
    r = quantize.balance_token_scales(k_rot)
    token = _away_from_ties(quantize.fp16_rounding_gap(r) / r)

    def changed(name, at, how):
        x = fields[name].clone()
        x[at] = how(x[at])
        return {name: x}

    def one_step_up(x):
        return torch.nextafter(x.half(), torch.tensor(torch.inf).half()).double()

    def off_by_one(code):
        return code - 1 if code > 0 else code + 1

    broken = {
        "v_scale times 1.01": {"v_scale": quantize.to_fp16_values(fields["v_scale"] * 1.01)},
        "k_scale times 0.99": {"k_scale": quantize.to_fp16_values(fields["k_scale"] * 0.99)},
        "one v_scale one step up": changed("v_scale", v_group, one_step_up),
        "one k_zero one step up": changed("k_zero", k_group, one_step_up),
        "one token scale one step up": changed("k_token_scale", token, one_step_up),
        "one v code off": changed("v_codes", (*v_group, 100), off_by_one),
        "one k code off": changed("k_codes", (*k_group[:2], 64, k_group[2]), off_by_one),
        "v codes of another token": {"v_codes": fields["v_codes"].roll(1, dims=2)},
        "a NaN zero": changed("v_zero", (0, 0, 0), lambda x: x * torch.nan),
    }  # fmt: skip
    missed = [
        what
        for what, change in broken.items()
        if not _faults(pool_of(quantize.QuantizedTile(**{**fields, **change})), 2, key, value)
    ]
    assert not missed, f"the criterion passes broken tiles: {missed}"


@pytest.mark.usefixtures("interpreted")
def test_27b_tiles_match_float64_and_nothing_else_is_written():
    layout = TileLayout(head_dim=D_27B)
    key, value = tiles(3, HEADS_27B, D_27B, seed=11)
    g = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, layout.pool_shape(8, HEADS_27B), dtype=torch.uint8, generator=g)
    before = pool.clone()
    block_ids = torch.tensor([6, 0, 3], dtype=torch.int32)
    store_tiles(key, value, pool, block_ids, layout)
    assert_pool_holds_the_reference(pool, block_ids, key, value, layout)
    # blocks not named (live blocks of other requests under prefix caching) keep every byte
    untouched = [b for b in range(8) if b not in block_ids.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.usefixtures("interpreted")
def test_a_negative_block_id_skips_its_tile():
    """The backend's candidates the device did not fill come as -1
    (step_tensors.write_step_tensors): that tile writes nothing, the others exactly what a
    store of them alone writes."""
    layout = TileLayout(head_dim=64)
    key, value = tiles(3, 2, 64, seed=17)
    g = torch.Generator().manual_seed(1)
    pool = torch.randint(0, 256, layout.pool_shape(6, 2), dtype=torch.uint8, generator=g)
    alone = pool.clone()
    store_tiles(key, value, pool, torch.tensor([4, -1, 1], dtype=torch.int32), layout)
    store_tiles(key[[0, 2]], value[[0, 2]], alone, torch.tensor([4, 1]), layout)
    assert torch.equal(pool, alone)


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(("heads", "d"), [(1, 64), (2, 128), (1, 512)])
def test_other_head_dims_and_strided_fp16_inputs(heads, d):
    layout = TileLayout(head_dim=d)
    key, value = tiles(2, heads, d, seed=d)
    wide = torch.zeros(2, 128, heads, d + 32, dtype=torch.float16)  # rows d + 32 apart
    wide[..., 16 : 16 + d] = key.half()
    pool = torch.full(layout.pool_shape(3, heads), POISON, dtype=torch.uint8)
    block_ids = torch.tensor([2, 1])
    tokens_outer = value.transpose(0, 1).contiguous().transpose(0, 1)  # tiles 1 token apart
    store_tiles(wide[..., 16 : 16 + d], tokens_outer, pool, block_ids, layout)
    assert_pool_holds_the_reference(pool, block_ids, key.half(), value, layout)
    assert (pool[0] == POISON).all()


@pytest.mark.usefixtures("interpreted")
def test_3_bit_values_match_float64_and_decode_as_it_does():
    """Tiles of 3-bit values (2 KV heads of 64) stored into a poisoned pool: by the criterion
    with codes up to 7, a code of every value 0-7 in the stored tiles, blocks not named left
    poisoned; dequantized (poisoned output, both bases) as the float64 decoding of the bytes;
    and nearer the input than the same tiles at 2 bits."""
    heads, d = 2, 64
    layout = TileLayout(head_dim=d, v_bits=3)
    key, value = tiles(2, heads, d, seed=71)
    pool = torch.full(layout.pool_shape(4, heads), POISON, dtype=torch.uint8)
    block_ids = torch.tensor([3, 0], dtype=torch.int32)
    store_tiles(key, value, pool, block_ids, layout)
    assert_pool_holds_the_reference(pool, block_ids, key, value, layout)
    assert (pool[[1, 2]] == POISON).all()
    codes = stored_tiles(pool, block_ids.tolist(), layout).v_codes
    assert set(codes.unique().tolist()) == set(range(8))
    for unrotate in (True, False):
        out = tuple(torch.full((2, 128, heads, d), float("nan")) for _ in range(2))
        k, v = dequantize_tiles(pool, block_ids, layout, out=out, unrotate=unrotate)
        assert_decodes_as_the_reference(k, v, pool, block_ids, layout, unrotate, bound=1e-5)
    two_bit = TileLayout(head_dim=d)
    pool_2 = torch.empty(two_bit.pool_shape(4, heads), dtype=torch.uint8)
    store_tiles(key, value, pool_2, block_ids, two_bit)
    _, v_2 = dequantize_tiles(pool_2, block_ids, two_bit, unrotate=True)
    _, v_3 = dequantize_tiles(pool, block_ids, layout, unrotate=True)
    assert relative_error(v_3, value.double()) < 0.65 * relative_error(v_2, value.double())


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("unrotate", [True, False])
def test_dequantize_matches_float64_decoding_and_writes_every_element(unrotate):
    layout = TileLayout(head_dim=D_27B)
    key, value = tiles(2, HEADS_27B, D_27B, seed=21)
    pool = torch.full(layout.pool_shape(4, HEADS_27B), POISON, dtype=torch.uint8)
    block_ids = torch.tensor([3, 1], dtype=torch.int64)
    store_tiles(key, value, pool, block_ids, layout)
    out = tuple(
        torch.full((2, 128, HEADS_27B, D_27B), float("nan"), dtype=torch.bfloat16) for _ in range(2)
    )
    k, v = dequantize_tiles(pool, block_ids, layout, out=out, unrotate=unrotate)
    assert k is out[0] and v is out[1] and not (k.isnan().any() or v.isnan().any())
    assert_decodes_as_the_reference(k, v, pool, block_ids, layout, unrotate, bound=4e-3)


def assert_decodes_as_the_reference(k, v, pool, block_ids, layout, unrotate, bound):
    """Every dequantized tile of every head within bound of quantize.py's float decoding of
    the same stored bytes."""
    decode = quantize.dequantize_tile if unrotate else quantize.dequantize_rotated
    for i, block in enumerate(block_ids.tolist()):
        for head in range(pool.shape[1]):
            want_k, want_v = decode(unpack_tile(pool[block, head], layout))
            assert relative_error(k[i, :, head], want_k) < bound
            assert relative_error(v[i, :, head], want_v) < bound


@pytest.mark.usefixtures("interpreted")
def test_the_kernels_round_trip_within_the_references_error():
    """Store then dequantize, against the original K and V: the reference's own error on this
    data (tests/test_kvarn_quantize.py) plus bf16 rounding."""
    layout = TileLayout(head_dim=D_27B)
    key, value = tiles(2, HEADS_27B, D_27B, seed=31)
    pool = torch.empty(layout.pool_shape(2, HEADS_27B), dtype=torch.uint8)
    block_ids = torch.tensor([1, 0])
    store_tiles(key, value, pool, block_ids, layout)
    k, v = dequantize_tiles(pool, block_ids, layout)
    assert relative_error(k, key.double()) < 0.08
    assert relative_error(v, value.double()) < 0.37


@pytest.mark.usefixtures("interpreted")
def test_a_block_past_2_32_bytes_is_addressed_in_int64():
    """A pool of 4 GiB reserved (torch.empty touches no page; the interpreter hands kernels
    the tensor's own memory), the vLLM block table's int32 block ids: the last block's tile
    starts a few KB past 2^32 bytes, where an offset computed in int32 wraps to block 0. The
    tile must land in the last block, equal to the same tile stored into a small pool, and
    block 0 must keep its poison."""
    layout = TileLayout(head_dim=D_27B)
    blocks = 2**32 // layout.tile_bytes + 2
    try:
        big = torch.empty(layout.pool_shape(blocks, 1), dtype=torch.uint8)
    except RuntimeError as refused:
        pytest.skip(f"this machine refuses to reserve 4 GiB of address space: {refused}")
    big[:2] = POISON
    last = torch.tensor([blocks - 1], dtype=torch.int32)
    key, value = tiles(1, 1, D_27B, seed=41)
    small = torch.empty(layout.pool_shape(1, 1), dtype=torch.uint8)
    store_tiles(key, value, small, torch.tensor([0], dtype=torch.int32), layout)
    store_tiles(key, value, big, last, layout)
    assert (big[:2] == POISON).all(), "a write wrapped around 2^32"
    assert torch.equal(big[blocks - 1], small[0])
    big_k, big_v = dequantize_tiles(big, last, layout)
    small_k, small_v = dequantize_tiles(small, torch.tensor([0], dtype=torch.int32), layout)
    assert torch.equal(big_k, small_k) and torch.equal(big_v, small_v)


def test_the_launchers_refuse_what_they_cannot_take():
    layout = TileLayout(head_dim=D_27B)
    pool = torch.empty(layout.pool_shape(2, HEADS_27B), dtype=torch.uint8)
    key = torch.zeros(1, 128, HEADS_27B, D_27B, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"key must be bf16 or fp16 \[1, 128, 4, 256\]"):
        store_tiles(key[:, :64], key, pool, torch.tensor([0]), layout)
    with pytest.raises(ValueError, match=r"value must be bf16 or fp16"):
        store_tiles(key, key.float(), pool, torch.tensor([0]), layout)
    with pytest.raises(ValueError, match=r"block_ids must be int32 or int64 \[1\]"):
        store_tiles(key, key, pool, torch.tensor([0.0]), layout)
    with pytest.raises(ValueError, match=r"a KVarN pool for head_dim 256 is uint8"):
        dequantize_tiles(pool.view(torch.int16), torch.tensor([0]), layout)
