"""SPEC=lookup on the GPU (LOOKUP_DEVICE=gpu, HYPERQWEN_LOOKUP=gpu): vLLM's `ngram_gpu` runner
path, whose bookkeeping keeps each request's tokens in a GPU buffer under async scheduling, with
HyperQwen's search and policy in place of vLLM's n-gram kernel and quoting's one-step-late cut in
place of vLLM's, which waits for the GPU every step (quoting.md, "Lookup alone").

At the runner's `runner_graphs_dispatched` seam (after it built the drafter and its CUDA graph
dispatcher), `attach`:
- full CUDA graphs for a uniform batch of 1-token decodes: a step where no request verifies
  drafts is a plain decode and keeps its FULL graph; a step with drafts runs piecewise;
- `runner.drafter.propose` (vLLM's NgramProposerGPU, called with the buffer, its counts and the
  step's sampled tokens) becomes `propose` here, bound to the runner;
- vLLM's synchronous cut (`update_scheduler_for_invalid_drafts`, called by its global name in
  the runner's `_update_states`, which only an `ngram_gpu` runner reaches) is skipped in this
  process while HYPERQWEN_LOOKUP is gpu: `propose` returns no valid-draft counts, so vLLM
  copies none and has none to wait for, and the runner's `runner_cut_drafts` seam cuts with
  the counts published one step earlier (`ProposedCounts`), 0 for a request without one. The
  decision is the variable's, not the runner's: the runner sets the event and host buffer that
  cut reads after this seam, in its constructor.

Each drafting step, tensor ops only (no host sync, no per-request Python): the step's accepted
tokens go into the buffer (vLLM's `update_token_ids_ngram` writes none; its `propose`, replaced
here, would have), the suffix search with the speculative config's windows (LOOKUP_MATCH), and
the counts: a match proposes all W drafts, none (or a row that sampled nothing) 0, never past
max_model_len. The drafts are the match's continuation, the last token repeated without a
match: every id is valid.
Verification is vLLM's rejection sampler, so the output is the model's.

CPU-tested (tests/test_engine_lookup_gpu.py); lossless on the H100, and slower than SPEC=lookup
on the CPU proposer (quoting.md, "Lookup alone, on the GPU").
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from hyperqwen.engine.features import LOOKUP, LOOKUP_ON_GPU, env_value
from hyperqwen.engine.lookup import write_accepted
from hyperqwen.kernels.lookup import find_suffix_match

VLLMS_CUT = "update_scheduler_for_invalid_drafts"


def on_gpu() -> bool:
    """The launcher asked for lookup's search on vLLM's `ngram_gpu` path (in this process)."""
    return env_value(LOOKUP) == LOOKUP_ON_GPU


def applies(speculative_config: Any) -> bool:
    """vLLM drafts with `ngram_gpu` and the launcher asked for lookup's search on it."""
    return speculative_config is not None and speculative_config.method == "ngram_gpu" and on_gpu()


def proposed_counts(
    match_length: torch.Tensor,
    sampled: torch.Tensor,
    lengths: torch.Tensor,
    width: int,
    max_model_len: int,
) -> torch.Tensor:
    """[B] int32: width for a match, 0 without one or where the row sampled nothing this step;
    never past max_model_len (lengths: each row's tokens with this step's)."""
    counts = torch.where((match_length > 0) & (sampled > 0), width, 0)
    return torch.minimum(counts, (max_model_len - lengths).clamp(min=0)).to(torch.int32)


def propose(
    runner: Any,
    num_speculative_tokens: int,
    num_tokens_no_spec: torch.Tensor,
    token_ids_gpu: torch.Tensor,
    valid_sampled_token_ids_gpu: torch.Tensor,
    valid_sampled_tokens_count: torch.Tensor,
) -> tuple[torch.Tensor, None]:
    """NgramProposerGPU.propose's place (its arguments: the runner's buffer rows and counts for
    the batch, the step's sampled tokens, -1 where rejected or discarded): the drafts [B, W]
    (int32), and no valid-draft counts, so vLLM copies none (ours are published)."""
    spec = runner.speculative_config
    width = spec.num_speculative_tokens
    lengths = write_accepted(
        valid_sampled_token_ids_gpu,
        runner.discard_request_mask.gpu,
        token_ids_gpu,
        num_tokens_no_spec,
        runner.input_batch.vocab_size,
    )
    match = find_suffix_match(
        token_ids_gpu, lengths, spec.prompt_lookup_min, spec.prompt_lookup_max, width
    )
    counts = proposed_counts(
        match.length, valid_sampled_tokens_count, lengths, width, runner.max_model_len
    )
    runner.hq_proposed.publish(counts, runner.input_batch.req_ids)
    return match.drafts, None


def _skipping_vllms_cut(cut: Any) -> Any:
    """vLLM's cut, except on this path (every `ngram_gpu` runner of the process is on it)."""

    @functools.wraps(cut)
    def skip_or_cut(*args: Any, **kwargs: Any) -> None:
        if on_gpu():
            return None
        return cut(*args, **kwargs)

    skip_or_cut.hq_vllms_cut = cut  # type: ignore[attr-defined]
    return skip_or_cut


def _updating_class(runner: Any) -> type:
    """The class whose `_update_states` the runner runs (vLLM's GPUModelRunner, or the runner's
    own class where none defines it): its module's namespace is where that method finds the
    cut."""
    classes = type(runner).__mro__
    return next((c for c in classes if "_update_states" in vars(c)), type(runner))


def attach(runner: Any) -> None:
    """Once, at `runner_graphs_dispatched`, for a runner `applies` to (quoting.attach asks)."""
    from hyperqwen.engine.quoting import ProposedCounts  # here: quoting.py imports this module

    runner.uniform_decode_query_len = 1
    runner.cudagraph_dispatcher.uniform_decode_query_len = 1
    runner.hq_proposed = ProposedCounts(runner.max_num_reqs, runner.device)
    runner.hq_no_count = 0
    runner.drafter.propose = functools.partial(propose, runner)
    module = sys.modules[_updating_class(runner).__module__]
    cut = getattr(module, VLLMS_CUT)
    if not hasattr(cut, "hq_vllms_cut"):
        setattr(module, VLLMS_CUT, _skipping_vllms_cut(cut))
