"""vLLM's GDN attention backend with the replay verify's counts (engine/quoting.md's plan, item 2).

The builder runs vLLM's GDNAttentionMetadataBuilder.build, then gdn_replay.replay_plan on the
slot record the previous steps left, and advances the record (gdn_replay.next_record). The
metadata it returns is vLLM's with the plan beside it (ReplayMetadata.replay), which the
layer's verify seam reads. The vLLM plugin registers the backend under vLLM's GDN_ATTN mamba
backend (gdn_replay.register); every GDN layer then gets this builder, one per KV-cache group.

The record advances once per step the model runs for requests. Not in a CUDA-graph capture
(build_for_cudagraph_capture: its rows name no request's slots) and harmless in vLLM's dummy
runs (profile, warm-up, an idle data-parallel rank): the runner clears the block-table rows of
those before it builds their metadata (gpu_model_runner.py `commit_block_table`, "stale block
IDs from finished requests can corrupt Mamba state"), so every row sits on the null block,
which the record never marks saved and the plan never counts.

The counts live in buffers of the builder's, at fixed addresses: the layer's verify (and the
fold of a decode-only step) under a FULL CUDA graph reads the buffer its capture saw (the slots
are vLLM's own persistent `spec_state_indices_tensor` / `non_spec_state_indices_tensor`
there). Tensor ops only, no host synchronisation.
Runs inside vLLM; imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from vllm.v1.attention.backends.gdn_attn import (
    GDNAttentionBackend,
    GDNAttentionMetadata,
    GDNAttentionMetadataBuilder,
)

from hyperqwen.engine.gdn_replay import ReplayPlan, new_record, next_record, replay_plan


@dataclass
class ReplayMetadata(GDNAttentionMetadata):
    """vLLM's GDN metadata and the step's replay plan."""

    replay: ReplayPlan | None = None
    # int32 [non-spec rows]: saved tokens to fold into a non-spec row's state before vLLM's
    # prefill or decode kernels run it (gdn_replay.py `unreplayed`), 0 elsewhere
    fold_counts: torch.Tensor | None = None


def _with_plan(metadata: GDNAttentionMetadata, **plan) -> ReplayMetadata:
    return ReplayMetadata(**{f.name: getattr(metadata, f.name) for f in fields(metadata)}, **plan)


class ReplayMetadataBuilder(GDNAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.layer_names = layer_names  # vLLM's GDN builder keeps none; the record's size needs one
        rows = max(self.decode_cudagraph_max_bs, vllm_config.scheduler_config.max_num_seqs)
        self.replay_counts = torch.zeros(rows, dtype=torch.int32, device=device)
        self.fold_counts = torch.zeros(rows, dtype=torch.int32, device=device)
        self.record: torch.Tensor | None = None  # made at the first step: see slot_record
        self._capturing = False

    def slot_record(self) -> torch.Tensor:
        """The slot record over the group's blocks; its size is the bound state pool's (the
        builder is made before anything tells it the block count)."""
        if self.record is None:
            context = self.vllm_config.compilation_config.static_forward_context
            pool = context[self.layer_names[0]].kv_cache[0]
            self.record = new_record(pool.shape[0], self.replay_counts.device)
        return self.record

    def build(  # type: ignore[override]
        self,
        common_prefix_len,
        common_attn_metadata,
        num_accepted_tokens=None,
        num_decode_draft_tokens_cpu=None,
        fast_build=False,
    ) -> ReplayMetadata:
        metadata = super().build(
            common_prefix_len,
            common_attn_metadata,
            num_accepted_tokens,
            num_decode_draft_tokens_cpu,
            fast_build,
        )
        record = self.slot_record()
        plan = replay_plan(metadata, record)
        rows = plan.replay_counts.numel()
        self.replay_counts[:rows].copy_(plan.replay_counts, non_blocking=True)
        plan = ReplayPlan(plan.committed_slots, self.replay_counts[:rows], plan.unreplayed)
        fold = _fold_counts(metadata, plan, num_accepted_tokens, num_decode_draft_tokens_cpu)
        if fold is not None:  # a decode-only step's FULL graph folds too: a fixed buffer
            self.fold_counts[: fold.numel()].copy_(fold, non_blocking=True)
            fold = self.fold_counts[: fold.numel()]
        if not self._capturing:
            self.record = next_record(metadata, record)
        return _with_plan(metadata, replay=plan, fold_counts=fold)

    def build_for_cudagraph_capture(self, common_attn_metadata) -> ReplayMetadata:
        self._capturing = True
        try:
            return super().build_for_cudagraph_capture(common_attn_metadata)
        finally:
            self._capturing = False


def _fold_counts(metadata, plan: ReplayPlan, accepted, drafts_cpu) -> torch.Tensor | None:
    """Per non-spec row, the accepted count of its slot's saved verify where `unreplayed`, else
    0; None when the step has no non-spec row. vLLM's num_accepted_tokens holds every row's
    count, spec row or not; the non-spec rows are those vLLM's build did not take as spec rows
    (none of them where it took none), in batch order."""
    rows = plan.unreplayed.numel()
    if rows == 0:
        return None
    if accepted is None:  # no speculation configured: nothing was ever saved
        return torch.zeros(rows, dtype=torch.int32, device=plan.unreplayed.device)
    if metadata.num_spec_decodes > 0:
        accepted = accepted[: drafts_cpu.numel()][~(drafts_cpu >= 0)]
    return torch.where(plan.unreplayed, accepted[:rows], 0).to(torch.int32)


class ReplayGDNBackend(GDNAttentionBackend):
    @staticmethod
    def get_builder_cls() -> type[ReplayMetadataBuilder]:
        return ReplayMetadataBuilder
