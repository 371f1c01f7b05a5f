"""The GDN recurrent update of decode and verify steps (kernels/gdn_recurrent.py) against a
float64 reference and against vLLM 0.26's own kernel on the same inputs.

Random inputs (never all zeros) at the 27B's head counts (16 key / 48 value heads of 128) at
tensor-parallel 1 and 2, and a small one; verify batches (2-D state indices, accepted counts from
1 to all, a sequence vLLM skips for its null initial slot, a token whose slot is 0 and so not
stored, sequences of unequal length and longer than one pass) and decode batches (1-D indices).
Outputs and every state slot start poisoned; what must not be written must stay poisoned. On the
CPU the kernels run in Triton's interpreter (conftest); on a GPU compiled.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hyperqwen.kernels import pdl
from hyperqwen.kernels.gdn_recurrent import default_block_v, gdn_recurrent_update

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = float("nan")
# (key heads, value heads, head dim): the 27B (one GPU per server, as HyperQwen serves it) and
# a small one with a head group of 2
GEOMETRIES = [(16, 48, 128), (2, 4, 32)]


def make_batch(geometry, lengths, seed, verify=True):
    """Inputs of one step: lengths[n] tokens of sequence n, state slots numbered from 1."""
    heads, v_heads, dim = geometry
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator) * scale

    total, sequences = sum(lengths), len(lengths)
    width = max(lengths) if verify else 1
    slots = 1 + sequences * width
    batch = {
        "A_log": rand(v_heads, scale=0.5),
        "a": rand(total, v_heads).to(torch.bfloat16),
        "b": rand(total, v_heads).to(torch.bfloat16),
        "dt_bias": rand(v_heads, scale=0.5),
        "q": rand(1, total, heads, dim).to(torch.bfloat16),
        "k": rand(1, total, heads, dim).to(torch.bfloat16),
        "v": rand(1, total, v_heads, dim).to(torch.bfloat16),
        "state": rand(slots, v_heads, dim, dim, scale=0.3),
        "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
    }
    order = torch.randperm(slots - 1, generator=generator) + 1  # slots in no particular order
    if verify:
        batch["state_indices"] = order.reshape(sequences, width).to(torch.int32)
        accepted = [1 + (n * 7 + seed) % length for n, length in enumerate(lengths)]
        batch["num_accepted_tokens"] = torch.tensor(accepted, dtype=torch.int32)
    else:
        batch["state_indices"] = order[:sequences].to(torch.int32)
        batch["num_accepted_tokens"] = None
    return batch


def reference(batch):
    """(outputs, states) in float64: the update token by token, head by head."""
    heads, v_heads = batch["q"].shape[2], batch["v"].shape[2]
    q, k, v = (batch[name][0].double() for name in "qkv")
    a, b = batch["a"].double(), batch["b"].double()
    decay_rate = -torch.exp(batch["A_log"].double())
    state = batch["state"].double().clone()
    out = torch.full(batch["v"].shape, math.nan, dtype=torch.float64)[0]
    indices, accepted = batch["state_indices"], batch["num_accepted_tokens"]
    rows = indices if indices.dim() == 2 else indices[:, None]
    group = v_heads // heads
    scale = q.shape[-1] ** -0.5
    cu = batch["cu_seqlens"].tolist()
    for n in range(len(cu) - 1):
        first = int(rows[n, int(accepted[n]) - 1] if accepted is not None else rows[n, 0])
        if cu[n + 1] == cu[n] or first <= 0:
            continue
        h = state[first].clone()  # [HV, V, K]
        for t, token in enumerate(range(cu[n], cu[n + 1])):
            x = a[token] + batch["dt_bias"].double()
            softplus = torch.where(x <= 20, torch.log1p(torch.exp(x)), x)
            decay = torch.exp(decay_rate * softplus)  # [HV]
            beta = torch.sigmoid(b[token])
            qn = q[token] / torch.sqrt((q[token] ** 2).sum(-1, keepdim=True) + 1e-6) * scale
            kn = k[token] / torch.sqrt((k[token] ** 2).sum(-1, keepdim=True) + 1e-6)
            qn, kn = qn.repeat_interleave(group, 0), kn.repeat_interleave(group, 0)  # [HV, K]
            h = h * decay[:, None, None]
            value = (v[token] - torch.einsum("hvk,hk->hv", h, kn)) * beta[:, None]
            h = h + value[:, :, None] * kn[:, None, :]
            out[token] = torch.einsum("hvk,hk->hv", h, qn)
            slot = int(rows[n, t])
            if slot > 0:
                state[slot] = h
    return out, state


def on_device(batch):
    return {name: None if value is None else value.to(DEVICE) for name, value in batch.items()}


def run_ours(batch, **options):
    batch = on_device(batch)
    state = batch.pop("state").clone()
    out = torch.full(batch["v"].shape, POISON, dtype=batch["v"].dtype, device=DEVICE)
    gdn_recurrent_update(state=state, out=out, **batch, **options)
    return out[0].cpu(), state.cpu()


def assert_same_with_pdl(ours, batch, **options):
    """The kernel with its programmatic-dependent-launch code (kernels/pdl.py) writes the same
    bits, poison included, where it can run."""
    if not pdl.runs_here(torch.device(DEVICE)):
        return
    out, state = run_ours(batch, pdl=True, **options)
    assert torch.equal(out.view(torch.int16), ours[0].view(torch.int16))
    assert torch.equal(state.view(torch.int32), ours[1].view(torch.int32))


def vllms_kernel():
    """vLLM's fused_sigmoid_gating_delta_rule_update from the installed tree. Without a GPU,
    vllm.triton_utils hands out placeholders instead of Triton, so there the module's own source
    is run with Triton itself (the interpreter), unchanged otherwise."""
    from vllm.third_party.flash_linear_attention.ops import fused_sigmoid_gating as module

    if DEVICE == "cuda":
        return module.fused_sigmoid_gating_delta_rule_update
    source = Path(module.__file__).read_text()
    vllms_import = "from vllm.triton_utils import tl, triton"
    assert vllms_import in source
    namespace = {"__name__": "vllm_fused_sigmoid_gating_on_triton"}
    exec(compile(source.replace(vllms_import, "import triton\nimport triton.language as tl"),
                 module.__file__, "exec"), namespace)  # fmt: skip
    return namespace["fused_sigmoid_gating_delta_rule_update"]


def run_vllms(batch):
    fused_sigmoid_gating_delta_rule_update = vllms_kernel()
    batch = on_device(batch)
    state = batch.pop("state").clone()
    out, _ = fused_sigmoid_gating_delta_rule_update(
        initial_state=state, inplace_final_state=True, use_qk_l2norm_in_kernel=True,
        ssm_state_indices=batch.pop("state_indices"), **batch,
    )  # fmt: skip
    return out[0].cpu(), state.cpu()


def written(want, batch):
    """(token rows with outputs, state slots written) of the reference `want`."""
    out, state = want
    kept = torch.isclose(state, batch["state"].double()).flatten(1).all(dim=1)
    return ~torch.isnan(out[:, 0, 0]), ~kept


def assert_matches(got, want, tokens, out_tol, poisoned=True):
    """got against the reference; with poisoned outputs (ours: vLLM's kernel allocates its own)
    skipped sequences' rows must still be poison."""
    out, state = got
    ref_out, ref_state = want
    if poisoned:
        assert torch.isnan(out[~tokens].float()).all(), "rows of skipped sequences were written"
    assert not torch.isnan(out[tokens].float()).any(), "rows left unwritten"
    scale = ref_out[tokens].abs().max()
    assert (out[tokens].double() - ref_out[tokens]).abs().max() <= out_tol * scale
    assert torch.allclose(state.double(), ref_state, rtol=1e-4, atol=1e-5)


VERIFY_CASES = {
    # lengths per sequence: uniform MTP k=3 blocks, unequal blocks (trimmed drafts), one long
    "uniform": [4, 4, 4],
    "unequal": [4, 1, 3, 2],
    "long": [7, 16],
}


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "h{}v{}d{}".format(*g))
@pytest.mark.parametrize("case", sorted(VERIFY_CASES))
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's, per scalar
def test_verify_matches_the_float64_reference_and_vllms_kernel(geometry, case) -> None:
    lengths = VERIFY_CASES[case]
    if geometry[1] == 48 and case == "long" and DEVICE == "cpu":
        lengths = [7, 2]  # the interpreter walks 16 tokens of 48 heads slowly
    batch = make_batch(geometry, lengths, seed=len(lengths) + geometry[1])
    batch["state_indices"][0, int(batch["num_accepted_tokens"][0]) - 1] = 0  # vLLM skips it
    if len(lengths) > 1:
        batch["state_indices"][1, 0] = 0  # token 0 of sequence 1: its state is not kept
    want = reference(batch)
    tokens, slots = written(want, batch)
    assert tokens.any() and (~tokens).any() and slots.any() and (~slots).any()
    ours, vllms = run_ours(batch, tokens_per_pass=4), run_vllms(batch)
    assert_matches(ours, want, tokens, out_tol=8e-3)
    assert_matches(vllms, want, tokens, out_tol=8e-3, poisoned=False)
    # against vLLM's own kernel: the same fp32 arithmetic, so the bf16 outputs differ by at
    # most a rounding step and the states by fp32 rounding
    assert torch.allclose(ours[0][tokens].float(), vllms[0][tokens].float(), rtol=8e-3, atol=1e-3)
    assert torch.allclose(ours[1], vllms[1], rtol=1e-5, atol=1e-6)
    assert_same_with_pdl(ours, batch, tokens_per_pass=4)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "h{}v{}d{}".format(*g))
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's, per scalar
def test_decode_with_one_dimensional_indices(geometry) -> None:
    batch = make_batch(geometry, [1] * 5, seed=geometry[0], verify=False)
    batch["state_indices"][3] = 0
    want = reference(batch)
    tokens, _ = written(want, batch)
    assert tokens.sum() == 4
    # every block size on the GPU and the small geometry; the interpreter takes the 27B's at
    # the size this batch gets by default
    blocks = (8, 16, 32) if DEVICE == "cuda" or geometry[2] <= 32 else (None,)
    for block_v in blocks:
        ours = run_ours(batch, block_v=block_v and min(block_v, geometry[2]), tokens_per_pass=1)
        assert_matches(ours, want, tokens, out_tol=8e-3)
    assert_same_with_pdl(
        ours, batch, block_v=block_v and min(block_v, geometry[2]), tokens_per_pass=1
    )
    assert_matches(run_vllms(batch), want, tokens, out_tol=8e-3, poisoned=False)


def test_block_choice_keeps_the_card_busy_and_bad_shapes_are_refused() -> None:
    assert default_block_v(1, 48, 128) == 8  # one sequence: 48 heads x 16 blocks of 8 rows
    assert default_block_v(64, 48, 128) == 32  # a batch fills the card at vLLM's 32 rows
    batch = on_device(make_batch((2, 4, 32), [2], seed=1))
    with pytest.raises(ValueError, match="powers of 2"):
        gdn_recurrent_update(**{**batch, "q": batch["q"][..., :24], "k": batch["k"][..., :24]})
    with pytest.raises(ValueError, match="tokens_per_pass=3"):
        gdn_recurrent_update(**batch, tokens_per_pass=3)
    with pytest.raises(ValueError, match="state \\[slots"):
        gdn_recurrent_update(**{**batch, "state": batch["state"][:, :2]})


def test_the_engine_choice_runs_ours_where_it_can_and_vllms_otherwise(monkeypatch) -> None:
    from hyperqwen.engine import seams
    from hyperqwen.engine.features import GDN_RECURRENT
    from hyperqwen.engine.gdn_recurrent import VLLMS_UPDATE, tokens_per_pass

    vllms = vllms_kernel()
    namespace = {VLLMS_UPDATE: vllms}
    monkeypatch.delenv(GDN_RECURRENT.env, raising=False)
    seams.gdn_module_loaded(namespace)  # the gdn_module_loaded seam, as the layer module calls it
    assert namespace[VLLMS_UPDATE] is vllms
    monkeypatch.setenv(GDN_RECURRENT.env, "1")
    seams.gdn_module_loaded(namespace)
    update = namespace[VLLMS_UPDATE]
    assert update is not vllms
    assert (tokens_per_pass(12, 3), tokens_per_pass(5, 5), tokens_per_pass(9, 3)) == (4, 1, 4)
    assert tokens_per_pass(48, 1) == 16  # a longer block takes several passes

    batch = make_batch((2, 4, 32), [4, 3], seed=5)
    want = reference(batch)
    tokens, _ = written(want, batch)
    for l2norm in (True, False):
        ours, theirs = on_device(batch), on_device(batch)
        ours_state, theirs_state = ours.pop("state").clone(), theirs.pop("state").clone()
        common = {"initial_state": None, "inplace_final_state": True,
                  "use_qk_l2norm_in_kernel": l2norm}  # fmt: skip
        ours["ssm_state_indices"] = ours.pop("state_indices")
        theirs["ssm_state_indices"] = theirs.pop("state_indices")
        out, state = update(**ours, **{**common, "initial_state": ours_state})
        expected, _ = vllms(**theirs, **{**common, "initial_state": theirs_state})
        assert state is ours_state
        assert torch.allclose(ours_state.cpu(), theirs_state.cpu(), rtol=1e-5, atol=1e-6)
        assert torch.allclose(out[0][tokens].float().cpu(), expected[0][tokens].float().cpu(),
                              rtol=8e-3, atol=1e-3)  # fmt: skip
        if l2norm:  # ours: compared with the float64 reference too
            assert_matches((out[0].cpu(), state.cpu()), want, tokens, out_tol=8e-3,
                           poisoned=False)  # fmt: skip


def test_the_engine_choice_leaves_batches_and_plain_decode_to_vllm() -> None:
    """Where the kernel was not timed faster (more than MAX_SEQUENCES sequences, decode steps
    without drafts), vLLM's kernel runs."""
    from hyperqwen.engine.gdn_recurrent import MAX_SEQUENCES, chosen

    vllms, calls = vllms_kernel(), []

    def counted(**kwargs):
        calls.append(kwargs["cu_seqlens"].numel() - 1)
        return vllms(**kwargs)

    update = chosen(counted)
    cases = (([4] * MAX_SEQUENCES, True), ([4] * (MAX_SEQUENCES + 1), True), ([1, 1], False))
    for lengths, verify in cases:
        batch = on_device(make_batch((2, 4, 32), lengths, seed=7, verify=verify))
        state = batch.pop("state").clone()
        batch["ssm_state_indices"] = batch.pop("state_indices")
        update(**batch, initial_state=state, inplace_final_state=True,
               use_qk_l2norm_in_kernel=True)  # fmt: skip
    assert calls == [MAX_SEQUENCES + 1, 2]  # ours took only the verify of MAX_SEQUENCES


def test_the_choice_says_so_in_the_server_log(engine_log) -> None:
    from hyperqwen.engine import gdn_recurrent

    namespace = {gdn_recurrent.VLLMS_UPDATE: print}
    gdn_recurrent.gdn_module_loaded(namespace)
    assert namespace[gdn_recurrent.VLLMS_UPDATE] is not print
    assert "GDN recurrent update: HyperQwen's kernel for verify steps" in engine_log.text


def test_the_patched_layer_module_binds_the_choice_when_it_loads() -> None:
    probe = (
        "from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as m; "
        "print(m.fused_sigmoid_gating_delta_rule_update.__module__)"
    )
    for value, module in (("1", "hyperqwen.engine.gdn_recurrent"), ("0", "fused_sigmoid_gating")):
        env = {**os.environ, "HYPERQWEN_GDN_RECURRENT": value}
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              text=True, check=True, timeout=300)  # fmt: skip
        assert done.stdout.strip().endswith(module), done.stdout
