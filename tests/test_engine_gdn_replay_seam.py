"""The GDN layer's verify seam under the replay verify (engine/gdn_replay.py `gdn_verify`) over a
run of steps, against vLLM 0.26's per-token-state path and a float64 reference.

Two worlds see the same requests, rows and inputs (random, never zeros). Ours: the replay page
(one block per request: conv, state, saved k, v, a, b) laid out as vLLM's runner binds a
MambaSpec page (gpu_model_runner.py `_reshape_kv_cache_tensors`: one raw buffer, each state a
view with slots a page apart), our builder's metadata, and the seam. vLLM's: its own
GDNAttentionMetadataBuilder on a block table of 1 + W blocks per request and its own
fused_sigmoid_gating_delta_rule_update as its layer calls it for spec rows; the float64
reference (test_kernel_gdn_recurrent.reference) runs beside it on the same slots. A prefill
row writes a fresh random state in both worlds (what the prefill kernel does; its math is not
the seam's). Every spec row's outputs must match vLLM's and the reference; where our step folds
a request's accepted tokens in, its committed state must equal vLLM's state at column
`accepted - 1` (fp32, the same arithmetic) and the reference's. The run has new requests,
reordered rows, all / none / some drafts accepted, a finished request's slot reused, a mixed
step (verifies and a prefill), a verify cut to one token by the budget and a step of plain
decodes only, whose replays the seam folds in before vLLM's kernels would read their states.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_engine_gdn_replay import DRAFTS, SLOTS, Row, metadata, verify
from test_engine_gdn_replay_wire import (
    gdn_layer,
    replay_builder,
    vllm_config,
    vllm_on_cpu,  # noqa: F401 (a fixture this module uses)
)
from test_kernel_gdn_recurrent import POISON, reference, vllms_kernel

from hyperqwen.checkpoint.geometry import PRESETS

HEADS, V_HEADS, DIM = 2, 4, 32
WIDTH = 1 + DRAFTS


def spec(slot: int, computed: int) -> Row:
    """A verify row of all DRAFTS drafts; its runner count is the worlds' (Worlds.accepted)."""
    return verify(slot, computed, 1)


def bound_page(spec, blocks: int) -> list[torch.Tensor]:
    """The state tensors of one layer as vLLM's runner binds a MambaSpec: views of one raw
    buffer, block b's tensors in page b, in spec order (gpu_model_runner.py, MambaSpec)."""
    raw = torch.full((blocks * spec.page_size_bytes,), -1, dtype=torch.int8)  # NaN as floats
    tensors, offset = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        size = torch.empty((), dtype=dtype).element_size()
        contiguous = torch.empty((blocks, *shape), device="meta").stride()
        tensors.append(
            torch.as_strided(
                raw.view(dtype),
                (blocks, *shape),
                (spec.page_size_bytes // size, *contiguous[1:]),
                offset // size,
            )
        )
        offset += contiguous[0] * size
    return tensors


class Worlds:
    def __init__(self, seed: int):
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
        from vllm.v1.kv_cache_interface import MambaSpec

        from hyperqwen.engine import gdn_replay

        self.generator = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        geometry = PRESETS["tiny"].with_overrides(
            [
                f"linear_num_key_heads={HEADS}",
                f"linear_num_value_heads={V_HEADS}",
                f"linear_key_head_dim={DIM}",
                f"linear_value_head_dim={DIM}",
            ]
        )
        config = vllm_config(DRAFTS)
        config.cache_config.mamba_ssm_cache_dtype = "float32"  # as the launcher serves
        layer = gdn_layer(geometry, config)
        gdn_replay.gdn_layer_built(layer)
        self.page = bound_page(layer.get_kv_cache_spec(config), SLOTS)
        self.layer = layer
        layer.A_log = self.rand(V_HEADS, scale=0.5)
        layer.dt_bias = self.rand(V_HEADS, scale=0.5)
        layer.kv_cache = self.page
        self.ours = replay_builder("NONE", pool=self.page)
        # vLLM's: column 0 the request's slot, DRAFTS more blocks (test_engine_gdn_replay)
        vllms_spec = MambaSpec(
            shapes=((3 + DRAFTS, 8), (2, 4, 4)),
            dtypes=(torch.bfloat16, torch.float32),
            block_size=16,
            num_speculative_blocks=DRAFTS,
        )
        self.vllms = GDNAttentionMetadataBuilder(
            vllms_spec, ["gdn"], vllm_config(DRAFTS), torch.device("cpu")
        )
        v_slots = SLOTS + SLOTS * DRAFTS
        self.v_state = torch.full((v_slots, V_HEADS, DIM, DIM), POISON)
        self.ref_state = self.v_state.double()
        self.accepted: dict[int, int] = {}  # the runner's count per slot (request)
        self.saved: set[int] = set()  # slots whose last step was a verify

    @property
    def state(self) -> torch.Tensor:
        return self.page[1]

    def rand(self, *shape, scale=1.0):
        return torch.randn(*shape, generator=self.generator) * scale

    def prefill(self, slot: int) -> None:
        """What a prefill leaves: a whole new state, ours in the block, vLLM's in column 0."""
        fresh = self.rand(V_HEADS, DIM, DIM, scale=0.3)
        self.state[slot] = fresh
        self.v_state[slot] = fresh
        self.ref_state[slot] = fresh.double()
        self.accepted[slot] = 1

    def step(self, rows: list[Row], kept: dict[int, int]) -> None:
        accepted = torch.tensor([self.accepted.get(r.slot, 1) for r in rows], dtype=torch.int32)
        ours = metadata(self.ours, rows, state_columns=1, accepted=accepted)
        vllms = metadata(self.vllms, rows, state_columns=WIDTH, accepted=accepted)
        total = sum(r.scheduled for r in rows)
        a = self.rand(total, V_HEADS).to(torch.bfloat16)
        b = self.rand(total, V_HEADS).to(torch.bfloat16)
        spec_rows = [r for r in rows if r.drafts is not None]
        spec_tokens = sum(r.scheduled for r in spec_rows)
        q = self.rand(1, spec_tokens, HEADS, DIM).to(torch.bfloat16)
        k = self.rand(1, spec_tokens, HEADS, DIM).to(torch.bfloat16)
        v = self.rand(1, spec_tokens, V_HEADS, DIM).to(torch.bfloat16)
        # what a request's committed state must become where ours folds: vLLM's column
        # accepted - 1, before this step's verify overwrites it; a new prompt on a slot left
        # saved folds nothing (its prefill starts from zeros)
        pending = {
            r.slot: self.accepted[r.slot] if r.slot in self.saved and r.computed else 0
            for r in rows
        }
        columns = {r.slot: self.v_columns(r.slot) for r in rows}
        committed = {
            slot: (self.v_state[columns[slot][n - 1]].clone(), self.ref_state[columns[slot][n - 1]])
            for slot, n in pending.items()
            if n
        }
        untouched = self.state.clone()

        out = self.seam(ours, q, k, v, a, b)
        for slot, (vllms_state, ref_state) in committed.items():
            assert torch.allclose(self.state[slot], vllms_state, rtol=1e-5, atol=1e-6), slot
            assert torch.allclose(self.state[slot].double(), ref_state, rtol=1e-4, atol=1e-5)
        for r in rows:
            if r.slot not in committed:  # nothing folded in: the seam left the state alone
                same = torch.isclose(self.state[r.slot], untouched[r.slot], 0, 0, equal_nan=True)
                assert same.all(), r.slot
        if spec_rows:
            spec_a, spec_b = (x.index_select(0, vllms.spec_token_indx) for x in (a, b))
            v_out = self.run_vllms(vllms, q, k, v, spec_a, spec_b)
            scale = v_out[1].abs().max()
            assert (out[0].double() - v_out[1]).abs().max() <= 8e-3 * scale
            assert torch.allclose(out[0].float(), v_out[0].float(), rtol=8e-3, atol=1e-3)
        else:
            assert out is None
        for r in rows:
            if r.drafts is None:
                self.prefill(r.slot)  # a prefill, or the cut decode after its fold
                self.saved.discard(r.slot)
            else:
                self.accepted[r.slot] = kept.get(r.slot, self.rng.randint(1, r.scheduled))
                self.saved.add(r.slot)

    def v_columns(self, slot: int) -> list[int]:
        return [slot, *(SLOTS + slot * DRAFTS + j for j in range(DRAFTS))]

    def seam(self, metadata, q, k, v, a, b):
        from hyperqwen.engine import gdn_replay

        # as the patched layer calls them: at the step's start, then at its recurrent step
        gdn_replay.gdn_step_begins(self.layer, metadata)
        return gdn_replay.gdn_verify(self.layer, metadata, q, k, v, a, b)

    def run_vllms(self, vllms, q, k, v, a, b):
        rows = vllms.num_spec_decodes
        batch = {
            "A_log": self.layer.A_log,
            "dt_bias": self.layer.dt_bias,
            "a": a,
            "b": b,
            "q": q,
            "k": k,
            "v": v,
            "cu_seqlens": vllms.spec_query_start_loc[: rows + 1],
            "state_indices": vllms.spec_state_indices_tensor,
            "num_accepted_tokens": vllms.num_accepted_tokens,
        }
        ref_out, self.ref_state = reference({**batch, "state": self.ref_state})
        out, _ = vllms_kernel()(
            initial_state=self.v_state, inplace_final_state=True, use_qk_l2norm_in_kernel=True,
            ssm_state_indices=batch.pop("state_indices"), **batch,
        )  # fmt: skip
        return out[0], ref_out


@pytest.mark.usefixtures("vllm_on_cpu")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's, per scalar
def test_the_seam_matches_vllms_per_token_path_over_a_run():
    worlds = Worlds(seed=5)
    worlds.prefill(3)
    worlds.prefill(5)
    steps = [
        # A (3) and B (5): first verifies after their prefills (nothing to fold)
        ([spec(3, 20), spec(5, 9)], {3: WIDTH, 5: 2}),
        # reordered; C new on 9 in the same step (a mixed step)
        ([spec(5, 11), spec(3, 24), Row(9, 0, 6)], {5: 1, 3: 3}),
        ([spec(9, 6), spec(3, 27), spec(5, 12)], {9: WIDTH, 3: 1}),
        # B finished; D new on B's slot; A: none of its drafts were accepted last step
        ([spec(3, 28), spec(9, 10), Row(5, 0, 4)], {3: WIDTH, 9: 2}),
        # D's first verify: B's saved inputs on slot 5 must not count
        ([spec(5, 4), spec(9, 12), spec(3, 32)], {5: 3, 9: WIDTH}),
        # A cut to one token by the budget: its 4 accepted tokens folded in by the seam
        ([spec(9, 16), spec(5, 7), Row(3, 36, 1)], {}),
        ([spec(5, 10), spec(9, 18), spec(3, 37)], {}),
        # no drafts anywhere (a lookup step without a match): plain decodes only, which vLLM
        # runs on its fast decode path; each one's accepted tokens folded in first
        ([Row(3, 41, 1), Row(5, 14, 1), Row(9, 22, 1)], {}),
    ]
    for rows, kept in steps:
        worlds.step(rows, kept)
    assert not worlds.saved
    # every slot of the run still in use, and nothing written outside them
    used = torch.zeros(SLOTS, dtype=torch.bool)
    used[[3, 5, 9]] = True
    for tensor in worlds.page[1:]:  # the state and the saved inputs (the conv is not ours)
        assert torch.isnan(tensor[~used].float()).all()
