"""GDN replay under `align` prefix caching (engine/gdn_replay_align.py): the folds that stand in
for vLLM 0.26's boundary copies, against the copies vLLM's own fused postprocess kernel makes.

vLLM's `postprocess_mamba_fused_kernel` (v1/worker/mamba_utils.py) runs here in Triton's
interpreter, its module's source unchanged but for where Triton comes from (as
test_kernel_gdn_recurrent.vllms_kernel does), on a temporal state whose every block holds its
own id, so what it copied where can be read back. For random steps (prefills and decodes
without drafts, verifies of 1-3 drafts with any acceptance, contexts around block boundaries)
our folds must name the copy vLLM made: its destination block, and the column it read as the
running block's state after `count` tokens (a prefill row: the running block itself).
"""

from __future__ import annotations

import random
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from hyperqwen.engine.gdn_replay_align import boundary_folds, boundary_reachable

BLOCK_SIZE = 4
MAX_DRAFTS = 3


def vllms_postprocess_kernel():
    return vllms_mamba_utils().postprocess_mamba_fused_kernel


def vllms_mamba_utils() -> types.ModuleType:
    """vLLM's v1/worker/mamba_utils.py, its kernels run by Triton itself: without a GPU
    vllm.triton_utils hands out placeholders instead."""
    import vllm.v1.worker.mamba_utils as module

    source = Path(module.__file__).read_text()
    vllms_import = "from vllm.triton_utils import tl, triton"
    assert vllms_import in source
    # a module of its own, registered: the source's dataclasses look their module up
    on_triton = sys.modules.setdefault(
        "vllm_mamba_utils_on_triton", types.ModuleType("vllm_mamba_utils_on_triton")
    )
    exec(compile(source.replace(vllms_import, "import triton\nimport triton.language as tl"),
                 module.__file__, "exec"), on_triton.__dict__)  # fmt: skip
    return on_triton


def random_step(rng: random.Random, requests: int) -> dict[str, list[int]]:
    """vLLM's inputs for one step: per request its computed tokens, the step's scheduled and
    draft tokens, the accepted count after it and its running block's column
    (preprocess_mamba's: the block of the last scheduled token)."""
    step = {name: [] for name in ("computed", "scheduled", "draft", "accepted", "state_idx")}
    for _ in range(requests):
        computed = rng.randint(0, 5 * BLOCK_SIZE)
        drafts = rng.choice([0, 0, *range(1, MAX_DRAFTS + 1)])
        if drafts:
            scheduled, accepted = 1 + drafts, rng.randint(1, 1 + drafts)
        else:  # a decode or a prefill chunk: one token comes out
            scheduled, accepted = rng.choice([1, rng.randint(2, 3 * BLOCK_SIZE)]), 1
        step["computed"].append(computed)
        step["scheduled"].append(scheduled)
        step["draft"].append(drafts)
        step["accepted"].append(accepted)
        step["state_idx"].append(-(-(computed + scheduled) // BLOCK_SIZE) - 1)
    return step


def step_kinds(seed: int, requests: int) -> set[str]:
    """One random step through vLLM's kernel and boundary_folds, checked request by request;
    the kinds of copy it had."""
    rng = random.Random(seed)
    step = random_step(rng, requests)
    # each request's blocks: as many as its tokens need plus vLLM's speculative ones, all
    # distinct; block 0 is the null block
    width = 5 + 3 + MAX_DRAFTS
    ids = torch.randperm(requests * width, generator=torch.Generator().manual_seed(seed)) + 1
    block_table = ids.reshape(requests, width).to(torch.int32)
    blocks = requests * width + 1
    state = torch.arange(blocks, dtype=torch.float32)[:, None].repeat(1, 8).contiguous()
    i32 = {name: torch.tensor(values, dtype=torch.int32) for name, values in step.items()}
    accepted_out = torch.full((requests,), -7, dtype=torch.int32)

    def int64(value: int) -> torch.Tensor:
        return torch.tensor([value], dtype=torch.int64)

    vllms_postprocess_kernel()[(requests, 1)](
        i32["accepted"], i32["state_idx"], i32["scheduled"], i32["computed"], i32["draft"],
        int64(block_table.data_ptr()), block_table.stride(0),
        int64(state.data_ptr()), int64(state.stride(0) * state.element_size()),
        torch.tensor([state.element_size()], dtype=torch.int32), int64(state.shape[1]),
        torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32), int64(0),
        accepted_out, None, requests,
        block_size=BLOCK_SIZE, COPY_BLOCK_SIZE=64, CONV_STATE_DIM_FIRST=False,
    )  # fmt: skip
    copied = {int(b): int(state[b, 0]) for b in range(blocks) if int(state[b, 0]) != b}

    folds = boundary_folds(
        i32["accepted"], i32["state_idx"], i32["scheduled"], i32["computed"], i32["draft"],
        block_table, BLOCK_SIZE,
    )  # fmt: skip
    kinds = set()
    for r in range(requests):
        row, source = block_table[r].tolist(), int(folds.sources[r])
        dest, count = int(folds.dests[r]), int(folds.counts[r])
        vllms = {to: frm for to, frm in copied.items() if to in row}
        assert bool(folds.clears[r]) == (int(accepted_out[r]) == 1)
        if not source:
            assert not vllms, f"request {r}: vLLM copied {vllms}, no fold"
            # a row without drafts whose tokens end on a boundary: its running block is the
            # one ending there, already whole (vLLM skips the copy onto itself)
            kinds.add("on a boundary, nothing to fold" if folds.clears[r] else "none")
            continue
        assert source == row[step["state_idx"][r]]
        if step["draft"][r] == 0:  # a prefill's state is whole: copied as it is
            assert count == 0 and vllms == {dest: source}
            kinds.add("prefill")
        elif not vllms:  # vLLM's own column already holds it; the replay block must fold
            assert dest == source and count == 1 and folds.clears[r]
            kinds.add("verify, in place")
        else:  # vLLM read the state after `count` tokens of this verify
            assert vllms == {dest: row[step["state_idx"][r] + count - 1]}
            kinds.add("verify, into another block" if dest != source else "verify, in place")
    return kinds


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's, per scalar
def test_boundary_folds_name_the_copies_vllms_postprocess_makes() -> None:
    kinds = set()
    for seed in range(6):
        kinds |= step_kinds(seed, requests=24)
    assert kinds == {
        "none",
        "on a boundary, nothing to fold",
        "verify, in place",
        "verify, into another block",
    }


def test_a_step_no_boundary_can_reach_skips_the_folds() -> None:
    """boundary_reachable (host counts only) is False only where boundary_folds folds nothing
    and clears nothing, whatever was accepted; and it is False on most decode steps."""
    rng = random.Random(0)
    skipped = 0
    for _ in range(400):
        step = random_step(rng, requests=1)
        counts = [np.array(step[name], dtype=np.int32) for name in ("computed", "scheduled")]
        draft = np.array(step["draft"], dtype=np.int32)
        if boundary_reachable(*counts, draft, BLOCK_SIZE):
            continue
        skipped += 1
        i32 = {k: torch.tensor(v, dtype=torch.int32) for k, v in step.items()}
        for accepted in range(1, 2 + int(draft[0])):  # every count the step could accept
            folds = boundary_folds(
                torch.tensor([accepted], dtype=torch.int32), i32["state_idx"],
                i32["scheduled"], i32["computed"], i32["draft"],
                torch.arange(1, 12, dtype=torch.int32)[None], BLOCK_SIZE,
            )  # fmt: skip
            assert int(folds.sources[0]) == 0 and not bool(folds.clears[0]), step
    assert skipped > 100
