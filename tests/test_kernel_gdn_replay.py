"""The replay verify (kernels/gdn_replay.py) against vLLM 0.26's semantics over several steps.

Each simulated run keeps the same requests in two worlds: ours, one committed state slot per
request and the replay buffer, and vLLM's, 1 + W state slots per request written after every
verified token. Each step gives requests random inputs (never zeros) and token counts, then
random acceptances (1 + 0..drafts tokens kept, both ends forced), which the next step sees as
vLLM's num_accepted_tokens and as our replay count. Every step's outputs must match the float64
reference of vLLM's semantics (test_kernel_gdn_recurrent.reference, fed vLLM's per-token slots)
and vLLM's own kernel; our committed state must equal the reference's state after exactly the
accepted prefix of the request's last verify. Outputs, unused state slots and unused replay
rows start poisoned (NaN) and must stay so; requests on vLLM's null block are skipped.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from test_kernel_gdn_recurrent import DEVICE, POISON, reference, vllms_kernel

from hyperqwen.capacity import (
    gdn_verify_state_bytes,
    recurrent_state_bytes,
    replay_buffer_bytes,
)
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.kernels.gdn_replay import ReplayBuffer, gdn_replay_fold, gdn_replay_verify

NULL = None  # a batch row on vLLM's null block (a padded or skipped request)


def spans(rows, batch):
    """(request or NULL, first token, end) of each row of a step."""
    cu = batch["cu_seqlens"].tolist()
    return zip([r for r, _ in rows], cu[:-1], cu[1:], strict=True)


class Run:
    """Both worlds' pools for `requests` requests of one geometry, drafts up to width - 1."""

    def __init__(self, geometry, requests: int, width: int, seed: int, spare: int = 2):
        self.heads, self.v_heads, self.dim = geometry
        self.width = width
        self.generator = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        v_heads, dim = self.v_heads, self.dim
        # ours: a slot per request in no particular order, spare slots unused but by moves
        slots = 1 + requests + spare
        self.kept: set[int] = set()  # slots a move left or a boundary copy filled
        self.slot = (torch.randperm(slots - 1, generator=self.generator)[:requests] + 1).tolist()
        self.state = torch.full((slots, v_heads, dim, dim), POISON)
        self.saved = ReplayBuffer.allocate(
            slots, width, self.heads, v_heads, dim, dim, device=DEVICE
        )
        for part in (self.saved.k, self.saved.v, self.saved.a, self.saved.b):
            part.fill_(POISON)
        # vLLM's: width slots per request, spare slots never used
        v_slots = 1 + requests * width + 3
        order = torch.randperm(v_slots - 1, generator=self.generator)[: requests * width] + 1
        self.v_slots = order.reshape(requests, width).to(torch.int32)
        self.v_state = torch.full((v_slots, v_heads, dim, dim), POISON)
        self.ref_state = self.v_state.double()
        self.A_log = self.rand(v_heads, scale=0.5)
        self.dt_bias = self.rand(v_heads, scale=0.5)
        # a prefill's state: ours committed, vLLM's in the first slot with num_accepted 1
        for r in range(requests):
            initial = self.rand(v_heads, dim, dim, scale=0.3)
            self.state[self.slot[r]] = initial
            self.v_state[int(self.v_slots[r, 0])] = initial
            self.ref_state[int(self.v_slots[r, 0])] = initial.double()
        self.replay = [0] * requests  # our replay counts: nothing saved yet
        self.accepted = [1] * requests  # vLLM's num_accepted_tokens of a new request

    def rand(self, *shape, scale=1.0):
        return torch.randn(*shape, generator=self.generator) * scale

    def step(self, rows, kept=None):
        """One verify step of rows (request, tokens) or (NULL, tokens); checks both worlds,
        then accepts `kept` tokens of the requests it names, a random count of the others."""
        lengths = [tokens for _, tokens in rows]
        total = sum(lengths)
        batch = {
            "A_log": self.A_log,
            "dt_bias": self.dt_bias,
            "a": self.rand(total, self.v_heads).to(torch.bfloat16),
            "b": self.rand(total, self.v_heads).to(torch.bfloat16),
            "q": self.rand(1, total, self.heads, self.dim).to(torch.bfloat16),
            "k": self.rand(1, total, self.heads, self.dim).to(torch.bfloat16),
            "v": self.rand(1, total, self.v_heads, self.dim).to(torch.bfloat16),
            "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
        }
        live = [r for r, _ in rows if r is not NULL]
        null_row = torch.zeros(self.width, dtype=torch.int32)
        vllm_batch = {
            **batch,
            "state_indices": torch.stack(
                [null_row if r is NULL else self.v_slots[r] for r, _ in rows]
            ),
            "num_accepted_tokens": torch.tensor(
                [1 if r is NULL else self.accepted[r] for r, _ in rows], dtype=torch.int32
            ),
        }
        # what our committed state must become: the reference's after the accepted prefix
        committed = {r: self.ref_state[int(self.v_slots[r, self.accepted[r] - 1])] for r in live}
        vllms_committed = {
            r: self.v_state[int(self.v_slots[r, self.accepted[r] - 1])].clone() for r in live
        }
        untouched = self.state.clone()

        ref_out, self.ref_state = reference({**vllm_batch, "state": self.ref_state})
        vllms_out = self.run_vllms(vllm_batch)
        ours = self.run_ours(batch, rows)

        tokens = torch.zeros(total, dtype=torch.bool)
        for r, start, end in spans(rows, batch):
            tokens[start:end] = r is not NULL
        assert torch.isnan(ours[~tokens].float()).all(), "rows of skipped requests were written"
        assert not torch.isnan(ours[tokens].float()).any(), "rows left unwritten"
        if tokens.any():
            scale = ref_out[tokens].abs().max()
            assert (ours[tokens].double() - ref_out[tokens]).abs().max() <= 8e-3 * scale
            assert torch.allclose(
                ours[tokens].float(), vllms_out[tokens].float(), rtol=8e-3, atol=1e-3
            )
        for r, slot in enumerate(self.slot):
            if r in live and self.replay[r] > 0:
                assert torch.allclose(self.state[slot].double(), committed[r], rtol=1e-4, atol=1e-5)
                # vLLM's kernel's own state there: the same fp32 arithmetic
                assert torch.allclose(self.state[slot], vllms_committed[r], rtol=1e-5, atol=1e-6)
            else:  # nothing to fold in, or not in this step: not rewritten
                assert torch.equal(self.state[slot], untouched[slot])
        self.assert_saved(rows, batch)
        self.assert_unused_slots_poisoned()
        self.accept(rows, kept or {})

    def run_ours(self, batch, rows):
        on = {name: value.to(DEVICE) for name, value in batch.items()}
        state = self.state.to(DEVICE)
        out = torch.full(batch["v"].shape, POISON, dtype=torch.bfloat16, device=DEVICE)
        state_slots = [0 if r is NULL else self.slot[r] for r, _ in rows]
        replay = [0 if r is NULL else self.replay[r] for r, _ in rows]
        gdn_replay_verify(
            **on,
            state=state,
            state_slots=torch.tensor(state_slots, dtype=torch.int32, device=DEVICE),
            replay_counts=torch.tensor(replay, dtype=torch.int32, device=DEVICE),
            saved=self.saved,
            out=out,
        )
        self.state = state.cpu()
        return out[0].cpu()

    def run_vllms(self, vllm_batch):
        on = {name: value.to(DEVICE) for name, value in vllm_batch.items()}
        state = self.v_state.to(DEVICE)
        out, _ = vllms_kernel()(
            initial_state=state, inplace_final_state=True, use_qk_l2norm_in_kernel=True,
            ssm_state_indices=on.pop("state_indices"), **on,
        )  # fmt: skip
        self.v_state = state.cpu()
        return out[0].cpu()

    def accept(self, rows, kept):
        """vLLM's count: the first token plus 0..drafts accepted drafts."""
        for r, tokens in rows:
            if r is NULL:
                continue
            if tokens == 0:  # nothing verified: ours folded everything in, vLLM kept its count
                self.replay[r] = 0
                continue
            count = kept.get(r, 1 + self.rng.randint(0, tokens - 1))
            assert 1 <= count <= tokens
            self.replay[r] = self.accepted[r] = count

    def fold_into_spare(self, r: int, count: int | None = None) -> None:
        """Prefix caching's `align` copies under the replay verify (gdn_replay_fold with a
        destination slot), into a spare slot. count None, the move to a new block: request r's
        state with its pending tokens folded in, where r then runs (vLLM's world copies the
        state at its count to its first slot and counts 1). A count, the boundary copy for the
        cache: the state after that many tokens of r's last verify, r staying where it was with
        its tokens pending. The spare slot must hold the reference's state (vLLM's kernel's
        too), every other slot, the source's included, and the saved inputs stay as they were."""
        source = self.slot[r]
        spare = next(
            slot
            for slot in range(1, self.state.shape[0])
            if slot not in self.slot and slot not in self.kept
        )
        folded = self.replay[r] if count is None else count
        assert 0 <= folded <= self.replay[r]
        if folded:
            column = int(self.v_slots[r, folded - 1])
            expected, vllms = self.ref_state[column], self.v_state[column]
        else:
            expected = vllms = self.state[source].clone()
        before = self.state.clone()
        saved_before = [part.clone() for part in (self.saved.k, self.saved.v, self.saved.a)]
        state = self.state.to(DEVICE)
        source_slots = torch.tensor([source], dtype=torch.int32, device=DEVICE)
        spare_slots = torch.tensor([spare], dtype=torch.int32, device=DEVICE)
        counts = torch.tensor([folded], dtype=torch.int32, device=DEVICE)
        gdn_replay_fold(
            self.A_log, self.dt_bias, state, source_slots, counts, self.saved,
            dest_slots=spare_slots,
        )  # fmt: skip
        self.state = state.cpu()
        assert torch.allclose(self.state[spare].double(), expected.double(), rtol=1e-4, atol=1e-5)
        assert torch.allclose(self.state[spare], vllms.float(), rtol=1e-5, atol=1e-6)
        others = torch.ones(self.state.shape[0], dtype=torch.bool)
        others[spare] = False
        # the poisoned slots too: NaN where it was
        unchanged = torch.allclose(self.state[others], before[others], 0, 0, equal_nan=True)
        assert unchanged, "a slot but the spare changed"
        for part, was in zip((self.saved.k, self.saved.v, self.saved.a), saved_before, strict=True):
            assert torch.allclose(part, was, 0, 0, equal_nan=True), "a fold saved inputs"
        if count is not None:  # the boundary copy: the spare holds a cache block's state
            self.kept.add(spare)
        else:  # the move: r runs at the spare; its old slot keeps what it held
            self.kept.add(source)
            self.slot[r], self.replay[r] = spare, 0
            first, last = int(self.v_slots[r, 0]), int(self.v_slots[r, self.accepted[r] - 1])
            self.v_state[first] = self.v_state[last].clone()
            self.ref_state[first] = self.ref_state[last].clone()
            self.accepted[r] = 1

    def assert_unused_slots_poisoned(self):
        used = torch.zeros(self.state.shape[0], dtype=torch.bool)
        used[self.slot] = True
        used[list(self.kept)] = True
        assert torch.isnan(self.state[~used]).all(), "an unused state slot was written"
        for part in (self.saved.k, self.saved.v, self.saved.a, self.saved.b):
            assert torch.isnan(part.cpu()[~used].float()).all(), "an unused replay slot was written"

    def assert_saved(self, rows, batch):
        """Each scheduled request's inputs, as given, in its slot's first rows."""
        saved = {name: getattr(self.saved, name).cpu() for name in "kvab"}
        given = {"k": batch["k"][0], "v": batch["v"][0], "a": batch["a"], "b": batch["b"]}
        for r, start, end in spans(rows, batch):
            if r is not NULL:
                for name in "kvab":
                    assert torch.equal(
                        saved[name][self.slot[r], : end - start], given[name][start:end]
                    )


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's, per scalar
def test_multi_step_run_matches_vllms_semantics_small_heads_fifteen_drafts() -> None:
    run = Run((2, 4, 32), requests=4, width=16, seed=3)
    steps = [  # (rows, acceptances chosen; the others random)
        # new requests (nothing to replay) of unequal lengths, a null-block row between
        ([(0, 16), (1, 5), (NULL, 3), (2, 1)], {0: 16}),  # all 15 drafts accepted
        ([(0, 16), (1, 16), (2, 7), (3, 4)], {0: 1, 1: 16}),  # none of 15; request 3 joins
        ([(1, 9), (0, 16), (3, 16), (NULL, 16)], {3: 16}),  # request 2 not scheduled
        ([(2, 3), (0, 0), (1, 16), (3, 2)], {1: 1, 3: 1}),  # request 0 with no tokens
        ([(0, 16), (1, 1), (2, 12), (3, 16)], {0: 16, 3: 1}),
        ([(0, 1), (1, 1), (2, 1), (3, 1)], {}),  # the last acceptances folded in
    ]
    for rows, kept in steps:
        run.step(rows, kept)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_align_moves_and_boundary_copies_fold_into_another_slot() -> None:
    """Under prefix caching's `align` mode a request's state moves to a new block between two
    verifies, and the state at a block boundary inside a verify's accepted tokens is copied
    into a cache block: with the replay verify both are folds into another slot. The run goes
    on from the moved states and must still follow vLLM's semantics."""
    run = Run((2, 4, 32), requests=3, width=16, seed=5, spare=8)
    run.step([(0, 16), (1, 5), (2, 1)], {0: 9, 1: 5})
    run.fold_into_spare(0, count=4)  # a boundary after 4 of request 0's 9 kept tokens
    run.fold_into_spare(0)  # its 9 pending tokens folded into its new block
    run.fold_into_spare(2)  # a verify of one token: the first token folded
    run.step([(0, 16), (1, 16), (2, 0)], {0: 16})  # request 2 with no tokens: nothing pending
    run.fold_into_spare(2)  # a move with nothing to fold: the state copied as it is
    run.fold_into_spare(0, count=16)  # the boundary at the end of all 16 kept tokens
    run.fold_into_spare(1)
    run.step([(0, 1), (1, 16), (2, 3)], {1: 2})
    run.step([(0, 1), (1, 1), (2, 1)])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_multi_step_run_matches_vllms_semantics_at_the_27b_heads() -> None:
    run = Run((16, 48, 128), requests=2, width=4, seed=11)
    run.step([(0, 4), (NULL, 2), (1, 3)], {0: 4, 1: 1})  # all 3 drafts; none of 2
    run.step([(1, 4), (0, 4)], {0: 1})
    run.step([(0, 1), (1, 1)])


def test_memory_arithmetic_matches_the_buffer_and_vllms_blocks() -> None:
    g = PRESETS["27b"]
    for drafts, tp in ((3, 1), (15, 1), (15, 2)):
        heads, v_heads = g.linear_num_key_heads // tp, g.linear_num_value_heads // tp
        buffer = ReplayBuffer.allocate(1, 1 + drafts, heads, v_heads, 128, 128, device="meta")
        assert replay_buffer_bytes(g, drafts, tp) == buffer.bytes_per_slot()
        block = recurrent_state_bytes(g, "float32", drafts, tp)
        for prefix_caching, kept in ((True, 2), (False, 1)):
            vllms, ours = (
                gdn_verify_state_bytes(g, "float32", drafts, prefix_caching, replay, tp)
                for replay in (False, True)
            )
            assert vllms == (kept + drafts) * block
            assert ours == kept * block + buffer.bytes_per_slot()
    # the numbers gdn_replay.py's docstring states (48 GDN layers, 15 drafts)
    assert replay_buffer_bytes(g, 15) == 16 * (16 * 128 + 48 * 128 + 2 * 48) * 2 == 259 * 1024
    per_request_mib = [
        round(48 * gdn_verify_state_bytes(g, "float32", 15, caching, replay) / 2**20)
        for caching in (True, False)
        for replay in (False, True)
    ]
    assert per_request_mib == [2735, 334, 2574, 173]


def test_mismatched_buffer_is_refused() -> None:
    run = Run((2, 4, 32), requests=1, width=4, seed=1)
    narrow = ReplayBuffer.allocate(run.state.shape[0], 4, 2, 4, 16, 32, device=DEVICE)
    q = torch.ones(1, 2, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    v = torch.ones(1, 2, 4, 32, dtype=torch.bfloat16, device=DEVICE)
    gates = torch.ones(2, 4, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="saved k contiguous"):
        gdn_replay_verify(
            run.A_log, gates, gates, run.dt_bias, q, q, v, run.state.to(DEVICE),
            torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32), narrow,
        )  # fmt: skip
