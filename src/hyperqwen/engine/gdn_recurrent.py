"""Which kernel runs the GDN layer's decode and verify recurrent update (GDN_RECURRENT).

At the gdn_module_loaded seam (seams.py), the GDN layer module's
fused_sigmoid_gating_delta_rule_update passes through `chosen`. Switched on, the layer gets a
function of the same signature that runs kernels/gdn_recurrent.py for the calls it takes and hands
any other call to vLLM's own. It takes verify steps (l2-normalised q and k, the state updated in
place, per-sequence state slots, not KDA) of at most MAX_SEQUENCES sequences: where the kernel
was timed faster on the H200 (`hyperqwen bench gdn`, 2026-12-01: 0.62x vLLM's time at one
sequence, 0.81x at two, 0.97x at four at its best config); plain decode steps are not timed
yet. Host work only: shapes, never tensor values, so CUDA graphs capture it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger("vllm.hyperqwen.gdn_recurrent")

MAX_TOKENS_PER_PASS = 16
MAX_SEQUENCES = 2  # more go to vLLM's kernel: at four it was no faster (see above)
VLLMS_UPDATE = "fused_sigmoid_gating_delta_rule_update"  # the name the layer module calls
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # CPU tests run the kernel there


def tokens_per_pass(total_tokens: int, sequences: int) -> int:
    """A power of two covering the mean tokens per sequence (all of a uniform verify block)."""
    mean = -(-total_tokens // max(sequences, 1))
    return min(1 << max(mean - 1, 0).bit_length(), MAX_TOKENS_PER_PASS)


def gdn_module_loaded(namespace: dict) -> None:
    """The GDN layer module's recurrent update becomes `chosen`'s."""
    namespace[VLLMS_UPDATE] = chosen(namespace[VLLMS_UPDATE])
    log.info(
        "GDN recurrent update: HyperQwen's kernel for verify steps of up to %d sequences",
        MAX_SEQUENCES,
    )


def chosen(vllms: Callable) -> Callable:
    """A function of vLLM's signature: HyperQwen's kernel where it can run, vLLM's otherwise."""
    from hyperqwen.kernels.gdn_recurrent import gdn_recurrent_update, unsupported

    def fused_sigmoid_gating_delta_rule_update(
        A_log, a, b, dt_bias, q, k, v, beta=1.0, threshold=20.0, scale=None,
        initial_state=None, inplace_final_state=True, cu_seqlens=None, ssm_state_indices=None,
        num_accepted_tokens=None, use_qk_l2norm_in_kernel=False, is_kda=False,
    ):  # fmt: skip
        takes = (
            use_qk_l2norm_in_kernel
            and inplace_final_state
            and not is_kda
            and initial_state is not None
            and initial_state.dim() == 4
            and cu_seqlens is not None
            and cu_seqlens.shape[0] - 1 <= MAX_SEQUENCES
            and ssm_state_indices is not None
            and num_accepted_tokens is not None
            and (q.is_cuda or INTERPRETED)
            and not unsupported(q, k, v, initial_state)
        )
        if not takes:
            return vllms(
                A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v, beta=beta,
                threshold=threshold, scale=scale, initial_state=initial_state,
                inplace_final_state=inplace_final_state, cu_seqlens=cu_seqlens,
                ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, is_kda=is_kda,
            )  # fmt: skip
        out = gdn_recurrent_update(
            A_log, a, b, dt_bias, q, k, v, initial_state, cu_seqlens, ssm_state_indices,
            num_accepted_tokens, scale=scale, softplus_beta=beta, softplus_threshold=threshold,
            tokens_per_pass=tokens_per_pass(q.shape[1], cu_seqlens.shape[0] - 1),
        )  # fmt: skip
        return out, initial_state

    return fused_sigmoid_gating_delta_rule_update
