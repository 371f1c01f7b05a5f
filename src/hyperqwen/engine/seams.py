"""The seams: what the hooks in patches/ call, one function per place in vLLM (features.Seam).

Each function here calls the function of the same name in the module of every feature declared
on that seam (features.py) whose variable switches it on, in FEATURES' order; with none on, it
returns what leaves vLLM's own path (the value it was given, None, False) and imports no
feature module. A patch names the seam, never a feature, so a feature on an existing seam needs
no patch of its own.

Runs inside vLLM: it imports the standard library and features.py only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from hyperqwen.engine.features import (
    ATTENTION_KV_SPEC,
    COMPILE_CACHE_INITIALIZED,
    FEATURES,
    GDN_LAYER_BUILT,
    GDN_MIXED_QKV,
    GDN_MODULE_LOADED,
    GDN_STEP_BEGINS,
    GDN_VERIFY,
    LINEAR_KERNELS,
    NGRAM_DRAFTS,
    PROPOSER_LOADED,
    RUNNER_ALIGN_COPIED,
    RUNNER_ALIGN_COPIES,
    RUNNER_COPIES_SCHEDULER_OUTPUT,
    RUNNER_COUNTS_ON_GPU,
    RUNNER_CUT_DRAFTS,
    RUNNER_DRAFT_COUNT,
    RUNNER_DRAFTED,
    RUNNER_DRAFTER_BUILT,
    RUNNER_GRAPHS_DISPATCHED,
    RUNNER_KEEPS_NGRAM_BUFFER,
    RUNNER_STEP_BEGINS,
    SCHEDULER_MAMBA_SPLIT,
    Seam,
    switched_on,
)


def hooks(seam: Seam) -> Iterator[Callable[..., Any]]:
    """The seam's function in each switched-on feature's module (imported on first use)."""
    for feature in FEATURES:
        if seam in feature.seams and switched_on(feature):
            yield getattr(feature.code(), seam.name)


def gdn_module_loaded(namespace: dict[str, Any]) -> None:
    """The GDN layer module's globals, once it has imported its kernels: a feature may rebind
    the functions the layer calls."""
    for hook in hooks(GDN_MODULE_LOADED):
        hook(namespace)


def gdn_layer_built(layer: Any) -> None:
    """A GatedDeltaNet layer after its projections are built. `hyperqwen_ba_projection` is
    None (vLLM's in_proj_ba GEMM, split and copies) unless a feature gives the (hidden_states,
    weight) -> (b, a) function the CUDA forward calls instead; decided here, once, so
    torch.compile sees a constant."""
    layer.hyperqwen_ba_projection = None
    for hook in hooks(GDN_LAYER_BUILT):
        hook(layer)


def gdn_mixed_qkv(mixed_qkv: Any, q_dim: int, k_dim: int, v_dim: int) -> Any | None:
    """The contiguous q|k|v buffer of one step, from the first feature that builds it; None:
    vLLM's split, copies and cat."""
    for hook in hooks(GDN_MIXED_QKV):
        fused = hook(mixed_qkv, q_dim, k_dim, v_dim)
        if fused is not None:
            return fused
    return None


def gdn_step_begins(layer: Any, metadata: Any) -> None:
    """A GDN layer's step with its metadata, before its conv and recurrent kernels (vLLM's fast
    decode path included) read any state."""
    for hook in hooks(GDN_STEP_BEGINS):
        hook(layer, metadata)


def gdn_verify(layer: Any, metadata: Any, q: Any, k: Any, v: Any, a: Any, b: Any) -> Any | None:
    """The GDN layer's recurrent step before its kernels run (the step's metadata, its spec
    rows' q, k, v, None without spec rows, and the step's a, b): the spec rows' outputs from
    the first feature that verifies them, vLLM's verify kernel then not called; None: vLLM's."""
    for hook in hooks(GDN_VERIFY):
        out = hook(layer, metadata, q, k, v, a, b)
        if out is not None:
            return out
    return None


def attention_kv_spec(backend: Any, block_size: int, num_kv_heads: int, head_size: int) -> Any:
    """The KV cache spec of an attention layer on this backend (block_size 1: the hybrid page
    alignment's bytes per token), from the first feature that declares one; None: vLLM's."""
    for hook in hooks(ATTENTION_KV_SPEC):
        spec = hook(backend, block_size, num_kv_heads, head_size)
        if spec is not None:
            return spec
    return None


def linear_kernels(kernels: list, on_cuda: bool) -> list:
    """vLLM's mixed-precision linear kernels in the order it tries them, as the features on
    reorder or extend them."""
    for hook in hooks(LINEAR_KERNELS):
        kernels = hook(kernels, on_cuda)
    return kernels


def proposer_loaded(proposer: Any) -> None:
    """A speculative proposer (V1's, or the V2 runner's speculator) whose draft model is loaded
    and shares the target's embeddings and lm_head."""
    for hook in hooks(PROPOSER_LOADED):
        hook(proposer)


def ngram_drafts(
    proposer: Any,
    num_requests: int,
    valid_ngram_requests: list,
    num_tokens_no_spec: Any,
    token_ids_cpu: Any,
    k: int,
) -> list[list[int]] | None:
    """One draft list per request from the first feature that drafts for vLLM's CPU n-gram
    proposer (batch_propose's arguments); None: vLLM's numba search."""
    for hook in hooks(NGRAM_DRAFTS):
        drafts = hook(proposer, num_requests, valid_ngram_requests, num_tokens_no_spec,
                      token_ids_cpu, k)  # fmt: skip
        if drafts is not None:
            return drafts
    return None


def runner_drafter_built(runner: Any) -> None:
    """The V1 GPU model runner right after it built an EAGLE-family drafter (MTP's included)."""
    for hook in hooks(RUNNER_DRAFTER_BUILT):
        hook(runner)


def runner_graphs_dispatched(runner: Any) -> None:
    """The V1 runner right after it built its CUDA graph dispatcher (its uniform decode width)."""
    for hook in hooks(RUNNER_GRAPHS_DISPATCHED):
        hook(runner)


def runner_keeps_ngram_buffer(speculative_config: Any) -> bool:
    """Whether the V1 runner keeps vLLM's `ngram_gpu` token buffer beyond that method."""
    return any(hook(speculative_config) for hook in hooks(RUNNER_KEEPS_NGRAM_BUFFER))


def runner_cut_drafts(runner: Any, scheduler_output: Any) -> dict[str, int]:
    """In _update_states, after vLLM's own n-gram cut: the features cut the step's scheduled
    drafts (and token counts) on the runner's private copy of the scheduler output; returns each
    cut request's scheduled count, which vLLM keeps for its rejection correction."""
    scheduled: dict[str, int] = {}
    for hook in hooks(RUNNER_CUT_DRAFTS):
        scheduled.update(hook(runner, scheduler_output))
    return scheduled


def runner_copies_scheduler_output(runner: Any) -> bool:
    """Whether the step works on a private copy of the scheduler output (a feature cuts it), as
    vLLM's runner does for its GPU n-gram drafter."""
    return any(hook(runner) for hook in hooks(RUNNER_COPIES_SCHEDULER_OUTPUT))


def runner_step_begins(runner: Any, scheduler_output: Any) -> bool:
    """The V1 runner's step after _update_states: whether the step skips vLLM's wait for the
    previous step's accepted counts (they are then taken on the GPU: runner_counts_on_gpu)."""
    return any(hook(runner, scheduler_output) for hook in hooks(RUNNER_STEP_BEGINS))


def runner_counts_on_gpu(runner: Any, num_reqs: int) -> None:
    """In a step that skipped the wait: set the runner's accepted counts from the GPU."""
    for hook in hooks(RUNNER_COUNTS_ON_GPU):
        hook(runner, num_reqs)


def runner_draft_count(runner: Any, scheduled: int) -> int:
    """How many drafts the V1 runner's drafter proposes this step (vLLM's: the scheduled)."""
    for hook in hooks(RUNNER_DRAFT_COUNT):
        scheduled = hook(runner, scheduled)
    return scheduled


def runner_drafted(runner: Any, draft_token_ids: Any, sampled_token_ids: Any) -> Any:
    """The V1 runner's drafts of this step, as the features on amend them."""
    for hook in hooks(RUNNER_DRAFTED):
        draft_token_ids = hook(runner, draft_token_ids, sampled_token_ids)
    return draft_token_ids


def runner_align_copies(
    runner: Any, scheduler_output: Any, copies: str, forward_context: dict[str, Any]
) -> dict[str, Any]:
    """Right before one of the V1 runner's two state copies of prefix caching's mamba `align`
    mode (`copies`: "move", preprocess_mamba's move of a request's state to a new block before
    the step; "boundary", the fused postprocess's copy of a block-boundary state for the cache
    after it): the layer name -> layer map whose `kv_cache` lists the copy reads, as the
    features on give it (vLLM's: the runner's static forward context)."""
    for hook in hooks(RUNNER_ALIGN_COPIES):
        forward_context = hook(runner, scheduler_output, copies, forward_context)
    return forward_context


def runner_align_copied(runner: Any, copies: str, num_reqs: int) -> None:
    """Right after that copy (its launch, in stream order) for the step's num_reqs rows."""
    for hook in hooks(RUNNER_ALIGN_COPIED):
        hook(runner, copies, num_reqs)


def scheduler_mamba_split(request: Any, start: int, wanted: int, split: int) -> int:
    """The tokens a request's chunk schedules under prefix caching's mamba `align` mode: vLLM's
    `split` of the `wanted` tokens from `start` (its chunk ends where a state can be cached), or
    a longer chunk, at most `wanted`, that a feature keeps."""
    for hook in hooks(SCHEDULER_MAMBA_SPLIT):
        split = hook(request, start, wanted, split)
    return split


def compile_cache_initialized() -> None:
    """vLLM's Inductor adaptor has set the cache directories of this configuration's compile
    (its compile cache on): a feature may move them."""
    for hook in hooks(COMPILE_CACHE_INITIALIZED):
        hook()
