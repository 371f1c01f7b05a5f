"""GDN replay under prefix caching's `align` mode: which folds stand in for vLLM's state copies.

vLLM 0.26 keeps the state after every verified token in a block of its own, and in `align`
mode copies two of them (engine/quoting.md, "GDN replay", item 4): after a step, the state at
a block boundary inside the accepted tokens into the block ending there, for the prefix cache
(`postprocess_mamba_fused_kernel`, v1/worker/mamba_utils.py); before a step, the running
state into the request's new block when the step's tokens reach into it (`preprocess_mamba`).
Under the replay verify the running block holds the state at its last verify's start and that
verify's inputs, so each copy becomes `gdn_replay_fold` of the source block's saved tokens
into the destination block (kernels/gdn_replay.py). This module computes those folds from
the same inputs vLLM's copies decide on, with tensor ops on the device (no host sync, as
vLLM's fused kernel), and runs them at the V1 runner's two copies (engine/gdn_replay.py's
`runner_align_copies` / `runner_align_copied`).

vLLM's copies take a layer's state tensors position by position against the model's copy
functions, which under the replay page are the conv state's alone (gdn_replay_state.py): so
the conv copies stay vLLM's, each replay layer shows them its conv state only (`align_states`;
the fused postprocess sizes and indexes its state list by those functions), and the folds
write the recurrent state, a move's from the source block's state whatever its count. Every
fold leaves its destination whole: its `saved` record clears there, as vLLM resets the
accepted count to 1. The saved inputs are never copied: a fold consumes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hyperqwen.engine.gdn_replay_state import saved_inputs
from hyperqwen.kernels.gdn_replay import ReplayBuffer, gdn_replay_fold


@dataclass(frozen=True)
class AlignFolds:
    """gdn_replay_fold's arguments for one step's requests (int32, one entry per request):
    sources (0, vLLM's null block: nothing to do), dests, counts; and `clears`, the requests
    whose running block itself received the boundary state, so their saved tokens are folded
    and the block's `saved` record must clear (vLLM resets their accepted count to 1)."""

    sources: torch.Tensor
    dests: torch.Tensor
    counts: torch.Tensor
    clears: torch.Tensor


def boundary_folds(
    num_accepted: torch.Tensor,
    state_idx: torch.Tensor,
    num_scheduled: torch.Tensor,
    num_computed: torch.Tensor,
    num_draft: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> AlignFolds:
    """The folds that replace the temporal-state copies of vLLM's `align` postprocess after a
    step, from its inputs: per request its accepted tokens, its running block's column in its
    block table row (vLLM's mamba_state_idx), the step's scheduled, computed-before and draft
    tokens. vLLM copies the state after token `bias` of the step (column state_idx + bias)
    into the block that ends at the last block boundary the accepted tokens reach, where that
    boundary is not before the step's first token; here that is the running block's first
    bias + 1 saved tokens folded into it, where the row verified (it has drafts: its inputs are
    saved), else its state as it is (a prefill row, whose state is whole). A copy of a block
    onto itself with nothing to fold is skipped, as vLLM skips it."""
    running = num_computed + num_scheduled - num_draft
    new_computed = running + num_accepted - 1
    aligned = torch.div(new_computed, block_size, rounding_mode="floor") * block_size
    reached = aligned >= running
    dest_column = torch.div(aligned, block_size, rounding_mode="floor") - 1
    counts = torch.where(num_draft > 0, aligned - running + 1, 0)
    in_place = dest_column == state_idx
    acts = reached & ~(in_place & (counts == 0))
    rows = torch.arange(block_table.shape[0], device=block_table.device)
    last = block_table.shape[1] - 1
    sources = block_table[rows, state_idx.clamp(0, last).long()]
    dests = block_table[rows, dest_column.clamp(0, last).long()]
    int32 = torch.int32
    return AlignFolds(
        sources=torch.where(acts, sources, 0).to(int32),
        dests=torch.where(acts, dests, 0).to(int32),
        counts=torch.where(acts, counts, 0).to(int32),
        clears=reached & in_place,
    )


def boundary_reachable(
    computed: np.ndarray, scheduled: np.ndarray, draft: np.ndarray, block_size: int
) -> bool:
    """Whether any request's step can reach a block boundary (boundary_folds' `reached`) at the
    most tokens it can accept (1 + its drafts), from the host's copies of the step's counts: a
    request crosses one every block_size tokens, so most steps need no fold and launch none."""
    most = computed.astype(np.int64) + scheduled  # running + (1 + drafts) - 1
    running = most - draft
    return bool(((most // block_size) * block_size >= running).any())


@dataclass(frozen=True)
class StateList:
    """What vLLM's align copies read of a layer: its `kv_cache` list."""

    kv_cache: list[torch.Tensor]


def is_replay_layer(layer: Any) -> bool:
    return getattr(layer, "hyperqwen_replay", False)


def align_states(forward_context: dict[str, Any]) -> dict[str, Any]:
    """The runner's forward context with each replay layer's state list cut to its conv state
    (the one the model's copy functions name); other layers as they are."""
    return {
        name: StateList(layer.kv_cache[:1]) if is_replay_layer(layer) else layer
        for name, layer in forward_context.items()
    }


@dataclass(frozen=True)
class Group:
    """One mamba KV-cache group of the runner: its id, its replay layers, its builders' slot
    records (one builder per micro-batch)."""

    group_id: int
    layers: list[Any]
    records: list[torch.Tensor]


def replay_groups(runner: Any) -> list[Group]:
    """The runner's mamba groups with replay layers (none without speculation)."""
    from vllm.v1.worker.mamba_utils import get_mamba_groups

    from hyperqwen.engine.gdn_replay_backend import ReplayMetadataBuilder

    group_ids, _ = get_mamba_groups(runner.kv_cache_config)
    context = runner.compilation_config.static_forward_context
    groups = []
    for group_id in group_ids:
        names = runner.kv_cache_config.kv_cache_groups[group_id].layer_names
        layers = [context[name] for name in names if is_replay_layer(context[name])]
        builders = [
            builder
            for attention_group in runner.attn_groups[group_id]
            for builder in attention_group.metadata_builders
            if isinstance(builder, ReplayMetadataBuilder)
        ]
        if layers and not builders:
            raise RuntimeError("GDN replay: replay layers without the replay builder's record")
        if layers:
            groups.append(Group(group_id, layers, [b.slot_record() for b in builders]))
    return groups


def fold(group: Group, sources: torch.Tensor, dests: torch.Tensor, counts: torch.Tensor) -> None:
    """gdn_replay_fold over the group's layers (source 0: nothing), then every destination
    whole in its records."""
    for layer in group.layers:
        saved = ReplayBuffer(*saved_inputs(layer.kv_cache))
        gdn_replay_fold(
            layer.A_log, layer.dt_bias, layer.kv_cache[1], sources, counts, saved, dest_slots=dests
        )
    for record in group.records:
        record[dests.long()] = False  # 0, vLLM's null block, is never read as saved


@dataclass(frozen=True)
class BeforeMoves:
    """What preprocess_mamba decides its moves from and then overwrites: the running block's
    column per request (its stale entries dropped, as it drops them) and the accepted counts
    per batch row (it resets a moved row's to 1)."""

    state_idx: dict[str, int]
    accepted: list[int]


def before_moves(runner: Any, scheduler_output: Any) -> BeforeMoves:
    from vllm.v1.worker.mamba_utils import cleanup_mamba_state_idx

    state_idx = dict(runner.mamba_state_idx)
    cleanup_mamba_state_idx(scheduler_output, state_idx)
    rows = len(runner.input_batch.req_ids)
    return BeforeMoves(state_idx, runner.input_batch.num_accepted_tokens_cpu[:rows].tolist())


def fold_moves(runner: Any, before: BeforeMoves, groups: list[Group]) -> None:
    """After preprocess_mamba: each request it moved (its column changed) gets its source
    block's state, with its accepted saved tokens folded in where that block is saved, in
    its new block."""
    from vllm.v1.worker.mamba_utils import get_mamba_groups

    block_size = get_mamba_groups(runner.kv_cache_config)[1].block_size
    moves = []  # (request, source column, destination column, accepted)
    for row, req_id in enumerate(runner.input_batch.req_ids):
        request = runner.requests[req_id]
        # a new or resumed request starts from the block of its computed tokens (vLLM's rule)
        source = before.state_idx.get(req_id, (request.num_computed_tokens - 1) // block_size)
        dest = runner.mamba_state_idx[req_id]
        if source != -1 and source != dest:
            moves.append((request, source, dest, before.accepted[row]))
    # vLLM copied one conv state per move and layer: a differing count means its rule changed
    copies = runner._get_mamba_bufs().preprocess.offset
    if copies != len(moves) * sum(len(g.layers) for g in groups):
        raise RuntimeError(f"GDN replay: vLLM made {copies} align copies for {len(moves)} moves")
    if not moves:
        return
    device = groups[0].layers[0].kv_cache[1].device
    accepted = torch.tensor([m[3] for m in moves], dtype=torch.int32, device=device)
    for group in groups:
        blocks = [(m[0].block_ids[group.group_id][m[1]], m[0].block_ids[group.group_id][m[2]])
                  for m in moves]  # fmt: skip
        sources, dests = torch.tensor(blocks, dtype=torch.int32, device=device).unbind(1)
        counts = torch.where(group.records[0][sources.long()], accepted, 0).to(torch.int32)
        fold(group, sources, dests, counts)


def fold_boundaries(runner: Any, num_reqs: int, groups: list[Group]) -> None:
    """After the fused postprocess: `boundary_folds` of its own staged inputs, per group."""
    context = runner._get_mamba_bufs().postprocess_align
    if context is None or num_reqs == 0:
        return
    rows = slice(0, num_reqs)
    counts = (context.num_computed_tokens_buf, context.num_scheduled_tokens_buf,
              context.num_draft_tokens_buf)  # fmt: skip
    if not boundary_reachable(*(buffer.np[rows] for buffer in counts), context.block_size):
        return
    inputs = (
        runner.num_accepted_tokens.gpu[rows],
        context.mamba_state_idx_buf.gpu[rows],
        context.num_scheduled_tokens_buf.gpu[rows],
        context.num_computed_tokens_buf.gpu[rows],
        context.num_draft_tokens_buf.gpu[rows],
    )
    for group in groups:
        table = runner.input_batch.block_table[group.group_id].get_device_tensor(num_reqs)
        folds = boundary_folds(*inputs, table, context.block_size)
        fold(group, folds.sources, folds.dests, folds.counts)
