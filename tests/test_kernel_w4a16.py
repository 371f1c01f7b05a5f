"""The skinny W4A16 kernel against a float64 reference, run by Triton's interpreter on the CPU.

Small shapes that reach every branch of the kernel: M from 1 to beyond one M tile, N and K that
are not multiples of the tile, split-K with empty slices, bf16 and fp16, weights in the
checkpoint's own packed format. Full 27B shapes run on the GPU in test_kernel_w4a16_gpu.py.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hyperqwen.bench.kernels import relative_error
from hyperqwen.checkpoint import w4a16 as checkpoint_format

GROUP = 128


@pytest.fixture(scope="module")
def kernel(interpreted):
    """The kernel module, interpreted: conftest turns TRITON_INTERPRET on without a GPU."""
    return importlib.import_module("hyperqwen.kernels.w4a16")


def random_weights(n: int, k: int, seed: int, dtype=torch.bfloat16):
    """Codes and scales in the stored layout, and the float64 weights they stand for."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale = (torch.rand((n, k // GROUP), generator=gen) * 0.02 + 0.001).to(dtype)
    dense = (codes.double() - 8) * scale.double().repeat_interleave(GROUP, dim=1)
    return codes, scale, dense


def run(kernel, x, packed, scale, config, pdl=False):
    """The kernel's output, written over NaN so an unwritten element cannot pass; pdl: its
    programmatic-dependent-launch code (kernels/pdl.py) switched on."""
    out = torch.full((x.shape[0], packed.shape[0] * kernel.TILE_ROWS), float("nan"), dtype=x.dtype)
    result = kernel.w4a16_matmul(x, packed, scale, GROUP, config, out=out, pdl=pdl)
    assert result is out
    assert not out.isnan().any(), "some outputs were never written"
    return out


CASES = [
    # m, n, k, (block_n, block_k, split_k[, num_warps, num_stages, programs_per_sm, block_m])
    (1, 64, 256, (16, 128, 1)),
    (1, 80, 384, (64, 256, 1)),  # N and K beyond the last full tile
    (3, 96, 512, (32, 256, 2)),
    (4, 64, 384, (16, 128, 4)),  # 3 K blocks over 4 slices: one slice is empty
    (5, 48, 640, (16, 128, 3)),
    (16, 32, 256, (16, 256, 2)),
    (17, 64, 512, (32, 256, 1)),  # BLOCK_M 32
    (70, 48, 256, (16, 128, 2)),  # two M tiles of 64
    (1, 80, 384, (16, 128, 2, 1, 3)),
    (5, 64, 640, (32, 256, 3, 2, 3)),
    (1, 64, 512, (32, 256, 1, 2, 3)),  # whole tiles: loads without masks
    (4, 128, 768, (64, 256, 3, 2, 4)),
    (5, 80, 384, (32, 256, 2, 1, 3)),
    (17, 64, 256, (64, 128, 1, 4, 3)),
    (3, 128, 1024, (64, 512, 2, 4, 3)),  # a K block of 4 groups
    (3, 256, 512, (128, 256, 2, 8, 3)),  # the widest swept tile
    # persistent grids (2 "SMs" under the interpreter): each program walks several work items
    (1, 256, 512, (32, 256, 1, 2, 3, 1)),  # 8 tiles over 2 programs
    (4, 192, 1024, (32, 256, 3, 4, 3, 2)),  # 6 tiles x 3 slices (one short) over 4 programs
    (70, 64, 256, (16, 128, 2, 4, 3, 3)),  # two M tiles, split-K, over 6 programs
    (2, 48, 384, (16, 128, 1, 4, 3, 64)),  # more programs allowed than work items
    # block_m asked for (prefill's tiles): several M tiles launched M first, one part-full
    (70, 64, 256, (16, 128, 1, 4, 3, 0, 32)),  # three M tiles of 32
    (130, 48, 384, (32, 128, 2, 4, 3, 0, 128)),  # two M tiles of 128, split-K
    (70, 96, 512, (32, 256, 2, 4, 3, 2, 16)),  # five M tiles of 16, persistent
]


def tiled(kernel, codes, scale):
    """Codes and scales as the kernel reads them: pair planes, in tiles."""
    return kernel.tiles_from_checkpoint(kernel.pack_codes(codes), scale)


@pytest.mark.parametrize(("m", "n", "k", "tile"), CASES)
def test_matches_float64_reference(kernel, m, n, k, tile):
    codes, scale, dense = random_weights(n, k, seed=m * 1000 + n)
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(m), dtype=torch.float32)
    x = x.to(torch.bfloat16)
    weights = tiled(kernel, codes, scale)
    out = run(kernel, x, *weights, kernel.TileConfig(*tile))
    # bf16 output rounding alone is ~3e-3 relative
    assert relative_error(out, x.double() @ dense.T) < 6e-3
    assert torch.equal(run(kernel, x, *weights, kernel.TileConfig(*tile), pdl=True), out)


def test_fp16_activations(kernel):
    codes, scale, dense = random_weights(64, 512, seed=7, dtype=torch.float16)
    x = torch.randn((5, 512), generator=torch.Generator().manual_seed(7)).to(torch.float16)
    out = run(kernel, x, *tiled(kernel, codes, scale), kernel.TileConfig(32, 256, 2))
    assert relative_error(out, x.double() @ dense.T) < 1e-3  # fp16 keeps 3 more bits


def test_pair_plane_layout_puts_two_neighbouring_columns_in_nibbles_j_and_j_plus_4(kernel):
    k = 256
    order = kernel.pair_plane_order(k)
    assert sorted(order.tolist()) == list(range(k))  # a permutation, group by group
    codes = torch.arange(k)[None, :] % 16 + torch.zeros((3, 1), dtype=torch.int64)
    codes[1] = torch.randint(0, 16, (k,), generator=torch.Generator().manual_seed(2))
    words = kernel.unpack_codes(kernel.repack_pairs(kernel.pack_codes(codes)))
    for group in range(k // 128):
        for word in range(16):
            for j in range(4):
                column = group * 128 + 32 * j + 2 * word
                position = group * 128 + 8 * word
                assert words[1, position + j] == codes[1, column]
                assert words[1, position + j + 4] == codes[1, column + 1]


def test_tiles_hold_each_slabs_groups_in_a_run(kernel):
    """tile_rows moves words and scales only: slab s, group g, row r, word w is row 16s + r's
    word 16g + w; refuses an N of part slabs, naming it."""
    codes, scale, _ = random_weights(48, 384, seed=5)
    packed = kernel.repack_pairs(kernel.pack_codes(codes))
    words, scales = kernel.tile_rows(packed, scale)
    assert words.shape == (3, 3, 16, 16) and scales.shape == (3, 3, 16)
    assert words.is_contiguous() and scales.is_contiguous()
    for slab, group, row in [(0, 0, 0), (1, 2, 5), (2, 1, 15)]:
        n = 16 * slab + row
        assert torch.equal(words[slab, group, row], packed[n, 16 * group : 16 * group + 16])
        assert scales[slab, group, row] == scale[n, group]
    with pytest.raises(ValueError, match="N=40 must be a multiple of 16"):
        kernel.tile_rows(packed[:40], scale[:40])


def test_reads_the_checkpoint_format(kernel):
    """Weights quantized and packed by the checkpoint module (compressed-tensors' packer)."""
    weight = torch.randn((64, 512), generator=torch.Generator().manual_seed(3)) * 0.05
    stored = checkpoint_format.pack(weight.to(torch.bfloat16))
    codes = kernel.unpack_codes(stored["weight_packed"])
    assert torch.equal(kernel.pack_codes(codes), stored["weight_packed"])
    assert torch.equal(
        ((codes - 8) * stored["weight_scale"].float().repeat_interleave(GROUP, dim=1)).to(
            torch.bfloat16
        ),
        checkpoint_format.unpack(stored),
    )
    dense = (codes.double() - 8) * stored["weight_scale"].double().repeat_interleave(GROUP, 1)
    x = torch.randn((4, 512), generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    words, scales = kernel.tiles_from_checkpoint(stored["weight_packed"], stored["weight_scale"])
    out = run(kernel, x, words, scales, kernel.TileConfig(16, 256, 2))
    assert relative_error(out, x.double() @ dense.T) < 6e-3


def test_split_k_is_deterministic_and_rearms_its_counters(kernel):
    codes, scale, _ = random_weights(64, 1024, seed=11)
    words, scales = tiled(kernel, codes, scale)
    x = torch.randn((4, 1024), generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    config = kernel.TileConfig(16, 128, 4)
    first = run(kernel, x, words, scales, config)
    second = run(kernel, x, words, scales, config)
    assert torch.equal(first, second)
    _, counters = kernel.WORKSPACE.get(x.device, *kernel.workspace_size(4, 64, config))
    assert not counters.any(), "a split-K launch left an arrival counter armed"


def test_zero_rows_writes_nothing_and_returns(kernel):
    codes, scale, _ = random_weights(32, 256, seed=1)
    x = torch.empty((0, 256), dtype=torch.bfloat16)
    out = kernel.w4a16_matmul(x, *tiled(kernel, codes, scale), GROUP, kernel.TileConfig(16, 128, 1))
    assert out.shape == (0, 32)


@pytest.mark.parametrize(
    ("config", "group", "k", "message"),
    [
        ((16, 192, 1), 128, 512, "block_k=192 must be a multiple of group_size=128"),
        ((24, 128, 1), 128, 512, "block_n=24 must be a power of two"),
        ((16, 128, 0), 128, 512, "split_k=0 must be >= 1"),
        ((16, 128, 1), 128, 320, "K=320 must be a multiple of group_size=128"),
        ((16, 128, 1), 64, 512, "group_size=64: the pair-plane layout takes 128"),
        ((16, 512, 1), 256, 1024, "group_size=256: the pair-plane layout takes 128"),
        ((16, 128, 1, 4, 3, 0, 24), 128, 512, "block_m=24 must be 0 .from M. or a power of two"),
        ((16, 128, 1, 4, 3, 0, 512), 128, 512, "block_m=512 must be 0 .from M. or a power"),
    ],
)
def test_refuses_bad_configs_naming_the_value(kernel, config, group, k, message):
    with pytest.raises(ValueError, match=message):
        kernel.check_config(kernel.TileConfig(*config), group, k)


def test_refuses_mismatched_tensors(kernel):
    codes, scale, _ = random_weights(32, 256, seed=2)
    words, scales = tiled(kernel, codes, scale)
    x = torch.randn((1, 256)).to(torch.bfloat16)
    config = kernel.TileConfig(16, 128, 1)
    tiles = r"tiles \[N/16, K/G, 16\] = \[2, 2, 16\]"
    with pytest.raises(ValueError, match=rf"weight_scale must be torch.bfloat16 {tiles}"):
        kernel.w4a16_matmul(x, words, scales.half(), GROUP, config)
    with pytest.raises(ValueError, match=r"weight_packed must be int32 tiles .*tile_rows makes"):
        kernel.w4a16_matmul(x, kernel.pack_codes(codes), scales, GROUP, config)  # still in rows
    with pytest.raises(ValueError, match="x must be bfloat16 or float16"):
        kernel.w4a16_matmul(x.float(), words, scales, GROUP, config)
    with pytest.raises(ValueError, match=rf"weight_scale must be torch.bfloat16 {tiles}"):
        kernel.w4a16_matmul(x, words, scale, GROUP, config)  # scales left in rows


def test_int8_packing_is_the_checkpoints_too(kernel):
    """The 8-bit heads prepare writes (uint8b128) use the same word order at 4 codes per word."""
    weight = torch.randn((32, 256), generator=torch.Generator().manual_seed(8)) * 0.05
    stored = checkpoint_format.pack(weight.to(torch.bfloat16), num_bits=8)
    codes = kernel.unpack_codes(stored["weight_packed"], bits=8)
    assert int(codes.max()) > 200 and int(codes.min()) < 50  # the whole 0..255 range in use
    assert torch.equal(kernel.pack_codes(codes, bits=8), stored["weight_packed"])
    dense = (codes - 128) * stored["weight_scale"].float().repeat_interleave(GROUP, dim=1)
    assert torch.equal(dense.to(torch.bfloat16), checkpoint_format.unpack(stored))
