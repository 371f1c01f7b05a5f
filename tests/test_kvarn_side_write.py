"""kvarn/side_write.py against torch's indexed assignment, under Triton's interpreter: K and V
as column slices of one fused projection (as vLLM hands them over), the side cache poisoned
first, padding tokens onto the padding row, every head layout the backend serves."""

from __future__ import annotations

import pytest
import torch

from hyperqwen.kvarn.side_write import write_side_rows

POISON = float("nan")


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(
    ("kv_heads", "d", "dtype"),
    [
        (4, 256, torch.bfloat16),  # the 27B
        (3, 64, torch.float16),  # SmolLM2: a width that is not a power of two
        (2, 128, torch.bfloat16),
        (1, 64, torch.float16),
    ],
)
def test_rows_land_where_an_indexed_assignment_puts_them(kv_heads, d, dtype) -> None:
    g = torch.Generator().manual_seed(kv_heads * d)
    n, heads, side_rows = 7, 2 * kv_heads, 5 * 128 + 1
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    _, key, value = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    key, value = key.reshape(n, kv_heads, d), value.reshape(n, kv_heads, d)
    # distinct rows of the slots, then two padding tokens onto the last (padding) row
    rows = torch.randperm(side_rows - 1, generator=g)[: n - 2].tolist() + [side_rows - 1] * 2
    rows = torch.tensor(rows, dtype=torch.int64)
    side_key = torch.full((side_rows, kv_heads, d), POISON, dtype=dtype)
    side_value = torch.full((side_rows, kv_heads, d), POISON, dtype=dtype)
    write_side_rows(side_key, side_value, rows, key, value)
    assert torch.equal(side_key[rows[:-2]], key[:-2])
    assert torch.equal(side_value[rows[:-2]], value[:-2])
    untouched = torch.ones(side_rows, dtype=torch.bool)
    untouched[rows] = False
    assert side_key[untouched].isnan().all() and side_value[untouched].isnan().all()
    # the padding row holds one of the two padding tokens' K and V (which one: unordered)
    assert any(torch.equal(side_key[-1], key[i]) for i in (n - 2, n - 1))


@pytest.mark.usefixtures("interpreted")
def test_shapes_the_kernel_does_not_take_are_refused() -> None:
    side = torch.zeros(10, 2, 64)
    rows = torch.arange(3)
    key = torch.zeros(3, 2, 64)
    with pytest.raises(ValueError, match=r"key and value must both be \[3, Hkv, D\]"):
        write_side_rows(side, side, rows, key, torch.zeros(3, 2, 32))
    with pytest.raises(ValueError, match=r"side cache must be \[rows, 2, 64\]"):
        write_side_rows(torch.zeros(10, 4, 32), torch.zeros(10, 4, 32), rows, key, key)
    with pytest.raises(ValueError, match="key must be contiguous within a row"):
        write_side_rows(side, side, rows, torch.zeros(3, 64, 2).transpose(1, 2), key)
    with pytest.raises(ValueError, match="rows must be int64"):
        write_side_rows(side, side, rows.int(), key, key)
    # one KV head: its stride is no matter (PyTorch may give a size-1 dimension any)
    one_head = torch.zeros(3, 64).as_strided((3, 1, 64), (64, 1, 1))
    write_side_rows(torch.zeros(10, 1, 64), torch.zeros(10, 1, 64), rows, one_head, one_head)
