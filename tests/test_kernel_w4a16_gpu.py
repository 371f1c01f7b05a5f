"""The skinny W4A16 kernel at the 27B's own shapes on the GPU, against a float64 reference.

Every quantized linear shape the 27B runs, plus the full-vocabulary head and the draft head
(the largest row counts, for index arithmetic), at every M a decode or verify step uses, with
every tile config `hyperqwen bench kernels` sweeps. Outputs are poisoned with NaN first.
"""

from __future__ import annotations

import pytest

from hyperqwen.bench.kernels import layer_shapes, relative_error, sweep_configs
from hyperqwen.checkpoint.geometry import PRESETS

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

GROUP = 128
G27 = PRESETS["27b"]
SHAPES = [(s.name, s.n, s.k) for s in layer_shapes(G27)] + [
    ("lm_head", G27.vocab_size, G27.hidden_size),
    ("draft_head", 40_960, G27.hidden_size),
]


@pytest.mark.parametrize(("name", "n", "k"), SHAPES, ids=[s[0] for s in SHAPES])
def test_full_shapes_match_float64(name, n, k):
    from hyperqwen.kernels.w4a16 import pack_codes, tiles_from_checkpoint, w4a16_matmul

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), device="cuda", generator=gen)
    scale = (torch.rand((n, k // GROUP), device="cuda", generator=gen) * 0.02 + 0.001).to(
        torch.bfloat16
    )
    words, scales = tiles_from_checkpoint(pack_codes(codes), scale)
    dense = (codes.double() - 8) * scale.double().repeat_interleave(GROUP, dim=1)
    del codes
    failures = []
    for m in (1, 2, 4, 5, 8, 16, 64):
        x = torch.randn((m, k), device="cuda", generator=gen).to(torch.bfloat16)
        ref = x.double() @ dense.T
        for config in sweep_configs():
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            w4a16_matmul(x, words, scales, GROUP, config, out=out)
            torch.cuda.synchronize()
            error = relative_error(out, ref)
            if out.isnan().any() or not error < 6e-3:
                failures.append(f"{name} m={m} {config.label()}: rel err {error:.2e}")
    assert not failures, "\n".join(failures)


def test_the_layer_path_matches_float64_at_every_m():
    """The kernel as LINEAR_BACKEND=hyperqwen serves it: vLLM's layer repacked by
    engine/w4a16_linear.py, its launch shapes (prefill's tiles at 65 and 300 rows), the op."""
    from hyperqwen.bench.kernels import LAYER_BACKEND, Weights, init_vllm_single_rank, vllm_layers

    init_vllm_single_rank()
    failures = []
    for shape in layer_shapes(PRESETS["27b"]):
        weights = Weights(shape.n, shape.k, copies=1, seed=shape.n + 7)
        built, reason = vllm_layers(LAYER_BACKEND, weights)
        assert built, reason
        kernel, layer = built[0]
        for m in (1, 4, 16, 64, 65, 300):
            x = torch.randn((m, shape.k), device="cuda").to(torch.bfloat16)
            out = kernel.apply_weights(layer, x)
            ref = x.double() @ weights.dense.double().T
            error = relative_error(out, ref)
            if out.isnan().any() or not error < 6e-3:
                failures.append(f"{shape.name} m={m}: rel err {error:.2e}")
    assert not failures, "\n".join(failures)
