"""KVarN's Walsh-Hadamard rotation (kvarn/hadamard.py): the torch reference against Sylvester's
matrix, the invariants KVarN relies on (q·k unchanged, output rotated back), and the Triton
form against float64 under the CPU interpreter, outputs poisoned with NaN first."""

from __future__ import annotations

import pytest
import torch

from hyperqwen.bench.kernels import relative_error
from hyperqwen.kvarn.hadamard import hadamard_matrix, rotate_reference, rotate_rows


@pytest.mark.parametrize("n", [1, 2, 16, 128, 256])
def test_reference_is_sylvesters_matrix_orthonormal_and_its_own_inverse(n):
    h = hadamard_matrix(n)
    assert torch.allclose(h @ h, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T) and torch.allclose(
        h.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64)
    )
    x = torch.randn(3, 5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    assert torch.allclose(rotate_reference(x), x @ h, atol=1e-12)
    assert torch.allclose(rotate_reference(rotate_reference(x)), x, atol=1e-12)


def test_rotating_k_and_q_keeps_scores_and_rotating_v_rotates_the_output():
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(shape, dtype=torch.float64, generator=g)
        for shape in ((4, 256), (50, 256), (50, 256))
    )
    scores = q @ k.T
    assert torch.allclose(rotate_reference(q) @ rotate_reference(k).T, scores, atol=1e-10)
    out = scores.softmax(dim=1) @ v
    assert torch.allclose(
        rotate_reference(scores.softmax(dim=1) @ rotate_reference(v)), out, atol=1e-12
    )


def test_it_refuses_a_length_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="head_dim=96: the Hadamard rotation needs a power of two"):
        rotate_reference(torch.ones(2, 96))


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("n", [16, 64, 128, 256, 512])
@pytest.mark.parametrize("rows", [1, 37])
def test_triton_rows_match_float64_and_every_element_is_written(n, rows):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(n + rows)) * 3
    out = torch.full_like(x, float("nan"))
    assert rotate_rows(x, out=out) is out
    assert not out.isnan().any()
    assert relative_error(out, rotate_reference(x.double())) < 1e-6  # fp32 sums of n terms
    back = rotate_rows(out.bfloat16())
    assert relative_error(back, x.double()) < 6e-3  # two bf16 roundings


@pytest.mark.usefixtures("interpreted")
def test_triton_rows_refuse_what_they_cannot_take():
    with pytest.raises(
        ValueError, match="head_dim=8: the Hadamard rotation needs a power of two >= 16"
    ):
        rotate_rows(torch.ones(2, 8))
    with pytest.raises(ValueError, match="contiguous columns"):
        rotate_rows(torch.ones(64, 2).T)
