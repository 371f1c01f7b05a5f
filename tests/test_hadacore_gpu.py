"""vLLM 0.26's hadacore Hadamard kernel, which int4_per_token_head rotates q, k, v and the
output with, against the exact transform in float64, on the 27B's head layouts (24 query / 4
KV heads of 256, at one GPU and split over two) and SmolLM2's (9 query / 3 KV heads of 64),
each right after a large unrelated kernel, at decode, verify and prefill lengths:
- the kernel alone, on odd counts of 256-element chunks: wrong somewhere, as
  vllm-project/vllm#53167 reads it (the warp left with one chunk skips its wait). When this
  fails, the pin's kernel waits on every warp and patches/int4-hadamard-even-chunks.patch can go;
- the patched rotation (fast_hadamard_transform, which pads to even counts): exact on every
  layout, SmolLM2's included; the precondition for lifting kv_choices.head_layout_refusal.
The errors go to the test log."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.ops.int4_per_token_head import (  # noqa: E402
    _hadacore_available,
    fast_hadamard_transform,
)

TOKENS = (1, 3, 4, 149, 1001, 9001)  # decode, odd, MTP verify (1 + 3), prefill lengths
BOUND = 2e-2  # bf16 in and out: a chunk read before it landed is off by order 1
LAYOUTS = {  # heads per GPU and head_dim of each rotated tensor
    "27b-tp1": ((24, 256), (4, 256)),
    "27b-tp2": ((12, 256), (2, 256)),
    "smollm2": ((9, 64), (3, 64)),
}


def exact(x: torch.Tensor) -> torch.Tensor:
    """H_d x in float64 with Sylvester's matrix (fast_hadamard_transform's unnormalised sign)."""
    d = x.shape[-1]
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return x.double().cpu() @ h.T


def rotation_errors(layout: str, rotate) -> dict[str, float]:
    errors = {}
    for heads, head_dim in LAYOUTS[layout]:
        for seed, tokens in enumerate(TOKENS):
            generator = torch.Generator(device="cuda").manual_seed(seed)
            x = torch.randn(tokens, heads, head_dim, device="cuda", generator=generator)
            x = x.to(torch.bfloat16)
            big = torch.randn(4096, 4096, device="cuda", generator=generator)
            (big @ big).sum()  # an unrelated kernel just before, as in a served step
            got, want = rotate(x).double().cpu(), exact(x)
            scale = want.abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
            errors[f"{heads}x{head_dim} T={tokens}"] = float(((got - want).abs() / scale).max())
    logs = Path(os.environ.get("HYPERQWEN_TEST_LOGS", "/tmp"))
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"hadacore-{layout}-{rotate.__name__}.json").write_text(json.dumps(errors, indent=1))
    return errors


def kernel_alone(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    return ops.hadacore_transform(x.reshape(-1, d).clone(), inplace=True).reshape(x.shape) * d**0.5


def test_hadacore_is_the_rotation_here():
    assert _hadacore_available(), "vLLM's _C has no hadacore_transform: the rotation is Triton's"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_patched_rotation_is_exact_on_every_layout(layout):
    errors = rotation_errors(layout, fast_hadamard_transform)
    assert max(errors.values()) < BOUND, errors


def test_the_kernel_alone_is_wrong_on_odd_chunk_counts():
    errors = rotation_errors("smollm2", kernel_alone)
    assert max(errors.values()) >= BOUND, errors
