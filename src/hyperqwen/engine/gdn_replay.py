"""What the replay verify (kernels/gdn_replay.py) folds in, per request, from vLLM 0.26's metadata.

The replay verify keeps one committed GDN state per request, the state at the step's start,
and saves the step's inputs in the request's state slot; the next step folds the previous
step's accepted tokens into the state first. How many: vLLM's num_accepted_tokens (in
GDNAttentionMetadata, spec rows only) is that count after a verify, but it also reads 1 where
there is nothing to fold in: a new or resumed request, the first verify after a prefill or a
plain decode (the runner's default, gpu_model_runner.py `num_accepted_tokens.np.fill(1)` and
gpu_input_batch.py `add_request`). The metadata of one step cannot tell these apart: both are
spec rows with count 1. What does is the slot's previous step: a verify (its inputs were saved
and not folded in) or a non-spec row (the prefill or decode kernels wrote the whole state
back). So a record is kept per state slot, `saved`: True after a step ran the slot as a spec
row, False after a step ran it as a non-spec row, unchanged for slots a step did not run.

  replay count of spec row n = num_accepted_tokens[n] if saved[slot n] else 0

Per state slot, not per batch row: vLLM reorders and condenses the batch between steps, while a
request keeps its slot (block table column 0 in mamba_cache_mode "none"; the same slot the
saved inputs are kept under). Every slot a request starts on is first run as a non-spec row
(vLLM prefills a new or resumed request, and a prefill row has no drafts), which clears what a
slot's previous owner left. In mamba_cache_mode "align" a request also moves to a new slot
mid-decode (its block table column is its running block's): the move is a fold whose
destination's record clears (gdn_replay_align.py), so a moved request's slot reads unsaved, as
vLLM resets its count to 1. Rows on vLLM's null block (padding of a CUDA-graph batch) are
neither read nor recorded.

A non-spec row with context whose slot is still `saved` verified last step and now runs
the prefill or decode kernels, which do not replay (a decode scheduled with fewer tokens than
its drafts + 1, scheduler.py's budget cut): `unreplayed` marks it, for the caller to route it
to the verify or refuse the step. vLLM's own per-token-slot path reads block column 0 there
too, whatever it accepted.

Tensor ops on the metadata's device tensors only, no host synchronisation, so a step's counts
can be computed while the GPU is busy and a CUDA graph can read them from a fixed buffer.

This is also the GDN_REPLAY feature's module (features.py). Where vLLM calls it
(engine/quoting.md, "GDN replay: integration plan"): `register` (the vLLM plugin) puts the
metadata builder of gdn_replay_backend.py under vLLM's GDN_ATTN mamba backend and the model
classes of gdn_replay_models.py (the page, gdn_replay_state.py) under the Qwen3.5
architectures; `gdn_layer_built` gives each GDN layer the replay page; `gdn_step_begins`
folds an unreplayed row's saved tokens before vLLM's kernels (its fast decode path included)
read its state; `gdn_verify` runs the layer's verify rows; both with kernels/gdn_replay.py;
`runner_align_copies` and `runner_align_copied`, at the V1 runner's two state copies of
prefix caching's `align` mode, turn their recurrent-state part into folds
(gdn_replay_align.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NULL_SLOT = 0  # vLLM's NULL_BLOCK_ID (v1/attention/backends/utils.py): padding, never a request's


@dataclass(frozen=True)
class ReplayPlan:
    """One step's replay, per spec row (the metadata's spec rows, padding included), and the
    non-spec rows that would skip a replay they need."""

    committed_slots: torch.Tensor  # int32 [spec rows]: the state slot read, folded into, saved to
    replay_counts: torch.Tensor  # int32 [spec rows]: saved tokens to fold in first
    unreplayed: torch.Tensor  # bool [non-spec rows]: saved inputs not folded in before this step


def new_record(num_slots: int, device: torch.device | str) -> torch.Tensor:
    """No slot has saved inputs: bool [num_slots], num_slots the mamba group's block count."""
    return torch.zeros(num_slots, dtype=torch.bool, device=device)


def _row_has_tokens(query_start_loc: torch.Tensor, rows: int) -> torch.Tensor:
    # padded rows repeat the last offset (the builder's CUDA-graph buffers): no tokens
    return query_start_loc[1 : rows + 1] > query_start_loc[:rows]


def _spec_rows(metadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Committed slot and whether the row has tokens, per spec row."""
    slots = metadata.spec_state_indices_tensor[:, 0]
    return slots, _row_has_tokens(metadata.spec_query_start_loc, slots.shape[0])


def _non_spec_rows(metadata) -> tuple[torch.Tensor, torch.Tensor]:
    """State slot and whether the row has tokens, per non-spec row (prefill, chunk or decode)."""
    slots = metadata.non_spec_state_indices_tensor
    if slots is None:  # every row of the step verifies
        empty = torch.empty(0, dtype=torch.int32, device=metadata.spec_state_indices_tensor.device)
        return empty, empty.bool()
    return slots, _row_has_tokens(metadata.non_spec_query_start_loc, slots.shape[0])


def replay_plan(metadata, saved: torch.Tensor) -> ReplayPlan:
    """The step's replay counts from its GDNAttentionMetadata (vLLM's builder, mamba_cache_mode
    "none") and the record the previous steps left (`next_record`)."""
    non_spec_slots, non_spec_live = _non_spec_rows(metadata)
    # a row with no context (a new or recomputed prompt) starts from zeros, whatever its slot
    # holds; with no prefill in the step every non-spec row is a decode, which has context
    continues = metadata.has_initial_state if metadata.num_prefills > 0 else non_spec_live
    unreplayed = non_spec_live & continues & saved[non_spec_slots.long()]
    if metadata.spec_state_indices_tensor is None:  # no verify this step
        none = torch.empty(0, dtype=torch.int32, device=saved.device)
        return ReplayPlan(none, none, unreplayed)
    slots, live = _spec_rows(metadata)
    pending = live & (slots != NULL_SLOT) & saved[slots.long()]
    counts = torch.where(pending, metadata.num_accepted_tokens, 0).to(torch.int32)
    return ReplayPlan(slots, counts, unreplayed)


def next_record(metadata, saved: torch.Tensor) -> torch.Tensor:
    """The record after this step: its spec rows' slots saved, its non-spec rows' slots not,
    others as they were. Call once per step the model runs (not for profile or capture runs,
    whose metadata names slots no request of theirs owns)."""
    after = saved.clone()
    non_spec_slots, non_spec_live = _non_spec_rows(metadata)
    # a row without tokens writes to the null slot, which no request owns: harmless
    after[torch.where(non_spec_live, non_spec_slots, NULL_SLOT).long()] = False
    if metadata.spec_state_indices_tensor is not None:
        slots, live = _spec_rows(metadata)
        # padding rows (on the null slot) all write False there: the null slot never reads saved
        after.index_put_((slots.long(),), live & (slots != NULL_SLOT))
    return after


# vLLM's Qwen3.5 architectures -> the classes with the replay page that replace them
REPLAY_MODELS = {
    "Qwen3_5ForConditionalGeneration": "hyperqwen.engine.gdn_replay_models:ReplayQwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "hyperqwen.engine.gdn_replay_models:ReplayQwen3_5Moe",
}
REPLAY_BACKEND = "hyperqwen.engine.gdn_replay_backend.ReplayGDNBackend"
# the cache modes whose state copies the record's counts hold in: none, and align's two copies
# as folds (gdn_replay_align.py); "all" caches every block's state from per-token states
SUPPORTED_CACHE_MODES = ("none", "align")


def register() -> None:
    """The builder and the model classes into vLLM's registries (each vLLM process)."""
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum, register_backend

    register_backend(MambaAttentionBackendEnum.GDN_ATTN, REPLAY_BACKEND, is_mamba=True)
    for architecture, model in REPLAY_MODELS.items():
        ModelRegistry.register_model(architecture, model)


def gdn_layer_built(layer) -> None:
    """A layer that verifies drafts gets the replay page (gdn_replay_state.py); refused in the
    cache modes the record does not hold in."""
    if not layer.num_spec:  # no speculation: nothing verifies, vLLM's page
        return
    mode = layer.cache_config.mamba_cache_mode
    if mode not in SUPPORTED_CACHE_MODES:
        raise ValueError(
            f"the GDN replay verify runs with mamba_cache_mode {' or '.join(SUPPORTED_CACHE_MODES)}"
            f", not {mode}: it keeps no per-token states to cache every block's from"
        )
    architecture = layer.model_config.architecture
    if architecture not in REPLAY_MODELS:
        # the hybrid page alignment sizes the page from the model class: only these have ours
        raise ValueError(
            f"the GDN replay verify serves {', '.join(REPLAY_MODELS)}, not {architecture}"
        )
    from hyperqwen.engine.gdn_replay_state import replay_layer

    replay_layer(layer)
    layer.hyperqwen_replay = True


def _replay_page(layer, metadata):
    """The layer's state pool and saved inputs, where the layer is a replay layer; refused
    where its metadata has no plan (vLLM's own verify would write past its one block)."""
    if not getattr(layer, "hyperqwen_replay", False):
        return None
    from hyperqwen.engine.gdn_replay_backend import ReplayMetadata
    from hyperqwen.engine.gdn_replay_state import saved_inputs
    from hyperqwen.kernels.gdn_replay import ReplayBuffer

    if not isinstance(metadata, ReplayMetadata) or metadata.replay is None:
        raise RuntimeError(
            "GDN replay: a replay layer got metadata without a replay plan (is the vLLM "
            f"plugin's GDN backend registered?): {type(metadata).__name__}"
        )
    return layer.kv_cache[1], ReplayBuffer(*saved_inputs(layer.kv_cache))


def gdn_step_begins(layer, metadata) -> None:
    """Folds the saved tokens of the step's non-spec rows that skip their replay
    (`unreplayed`: a plain decode or prefill chunk right after a verify) into their states,
    before vLLM's decode or prefill kernels read them."""
    page = _replay_page(layer, metadata)
    if page is None or metadata.fold_counts is None:
        return
    from hyperqwen.kernels.gdn_replay import gdn_replay_fold

    state, saved = page
    slots = metadata.non_spec_state_indices_tensor[: metadata.fold_counts.numel()]
    gdn_replay_fold(layer.A_log, layer.dt_bias, state, slots, metadata.fold_counts, saved)


def gdn_verify(layer, metadata, q, k, v, a, b):
    """The layer's verify rows through the replay verify. Returns their outputs [1, T, HV, V]
    (vLLM's verify kernel does not run), or None where the step has no spec rows. q, k, v: the
    spec rows' [1, T, ...] (vLLM's rearranged query_spec, key_spec, value_spec; None without
    spec rows); a, b: the whole step's [tokens, HV] (vLLM's layer passes those to its verify
    kernel)."""
    page = _replay_page(layer, metadata)
    if page is None or metadata.spec_sequence_masks is None:
        return None
    from hyperqwen.kernels.gdn_replay import gdn_replay_verify

    state, saved = page
    if metadata.num_prefills or metadata.num_decodes:
        # vLLM hands its verify kernel the whole step's a and b, right only while spec rows
        # come first; their own rows whatever the order
        a = a.index_select(0, metadata.spec_token_indx)
        b = b.index_select(0, metadata.spec_token_indx)
    rows = metadata.num_spec_decodes
    plan = metadata.replay
    return gdn_replay_verify(
        layer.A_log, a, b, layer.dt_bias, q, k, v, state,
        metadata.spec_query_start_loc[: rows + 1], plan.committed_slots[:rows],
        plan.replay_counts[:rows], saved,
    )  # fmt: skip


def runner_align_copies(runner, scheduler_output, copies: str, forward_context: dict) -> dict:
    """Before vLLM's `align` copy: a replay layer shows it its conv state alone; before the
    move, what preprocess_mamba decides its moves from is kept for runner_align_copied."""
    from hyperqwen.engine import gdn_replay_align

    if not gdn_replay_align.replay_groups(runner):
        return forward_context
    if copies == "move":
        runner.hyperqwen_before_moves = gdn_replay_align.before_moves(runner, scheduler_output)
    return gdn_replay_align.align_states(forward_context)


def runner_align_copied(runner, copies: str, num_reqs: int) -> None:
    """After vLLM's `align` copy: its recurrent-state part as folds."""
    from hyperqwen.engine import gdn_replay_align

    groups = gdn_replay_align.replay_groups(runner)
    if not groups:
        return
    if copies == "move":
        gdn_replay_align.fold_moves(runner, runner.hyperqwen_before_moves, groups)
    else:
        gdn_replay_align.fold_boundaries(runner, num_reqs, groups)
