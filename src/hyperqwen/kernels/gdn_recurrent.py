"""The Gated DeltaNet recurrent update of decode and verify steps, inputs fetched up front.

vLLM 0.26 runs a GDN layer's decode (one token per sequence) and speculative verify (1 + k tokens
per sequence) through `fused_sigmoid_gating_delta_rule_update` (third_party/flash_linear_attention
/ops/fused_sigmoid_gating.py). On the H200 profile of a 27B MTP k=3 step it takes 11.6 us per
layer, 0.56 ms of a 9.8 ms step (docs/results/2026-12-01-h200-27b-single-overlap.json), moving
about 16 MB per layer (the fp32 state read once, written after each token): about a third of what
the card copies in that time. Its programs walk the tokens one after another and load each
token's q, k, v, a and b inside that walk, so every token adds a memory round trip to a chain
that 192 programs (one sequence: 48 value heads x 4 blocks of 32 state rows) cannot hide.

This kernel computes the same update but loads all of a program's tokens (up to TOKENS at a
time) and its state rows before the walk, so the walk itself touches memory only to store. Per
token, in vLLM's order and in fp32:

  g = -exp(A_log) * softplus(a + dt_bias)         beta = sigmoid(b)
  q, k = l2-normalised q, k (q also times scale)
  h *= exp(g);  v -= h k;  v *= beta;  h += v kᵀ;  o = h q
  h is stored to the state slot state_indices[n, t] (when > 0) after every token t

with the initial state from slot state_indices[n, accepted[n] - 1] (verify) or [n, 0] (decode);
a sequence whose initial slot is 0 (vLLM's null block) is skipped, as vLLM does. Sums may be
formed in another order than vLLM's, so results agree to fp32 rounding, not bit for bit.

Status: agrees with a float64 reference and with vLLM's own kernel (tests/test_kernel_gdn
_recurrent.py, CPU interpreter, and 11 passed compiled on the H200); compiles for sm80/86/89/90
here (no local memory). Timed on the H200 against vLLM's (`hyperqwen bench gdn`, ffcb893,
docs/results/2026-12-01-h200-27b-gdn-recurrent.json: a 4-token verify of the 27B's 48 heads at
one, two and four sequences, each at its best config, one warp at every case; that run's
serving default was 4 warps, slower than vLLM's at every case, and is 1 since). It serves
verify steps of at most two sequences; a whole step is not measured. An engine feature routes
the layer's decode and verify calls here (engine/README.md's feature table).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyperqwen.kernels.gdn_delta_rule import (
    _delta_rule,
    _entry,
    _gates,
    _l2_normalised,
    _row,
    _token_inputs,
    default_block_v,
    unsupported,
)
from hyperqwen.kernels.pdl import launch_with_pdl, release_dependents, wait_for_producers


@triton.jit(do_not_specialize=["softplus_beta", "softplus_threshold", "scale"])
def _gdn_recurrent_kernel(
    A_log,
    a,
    b,
    dt_bias,
    q,
    k,
    v,
    o,
    state,
    cu_seqlens,
    state_indices,
    num_accepted,
    softplus_beta,
    softplus_threshold,
    scale,
    state_stride,
    indices_stride,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    TOKENS: tl.constexpr,
    VERIFY: tl.constexpr,
    PDL: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    # everything it reads but two scalar parameters comes from kernels (the state from the
    # last step's): nothing worth prefetching, so it waits before the metadata, the state and
    # every early return
    wait_for_producers(PDL)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    seq_len = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    if seq_len == 0:
        return
    indices_row = state_indices + i_n * indices_stride
    if VERIFY:
        first_slot = tl.load(indices_row + tl.load(num_accepted + i_n).to(tl.int64) - 1)
    else:
        first_slot = tl.load(indices_row)
    if first_slot <= 0:
        return

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, TOKENS)
    head_state = i_hv * V * K + o_v[:, None] * K + o_k[None, :]
    h = tl.load(state + first_slot.to(tl.int64) * state_stride + head_state).to(tl.float32)
    decay_rate = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    bias = tl.load(dt_bias + i_hv).to(tl.float32)

    for start in range(0, seq_len, TOKENS):
        tokens = bos + start + o_t
        live = start + o_t < seq_len
        # every input of these tokens at once: one memory round trip, not one per token
        q_offsets = (tokens[:, None] * H + i_h) * K + o_k[None, :]
        q_t = tl.load(q + q_offsets, mask=live[:, None], other=0.0).to(tl.float32)
        k_t, v_t, a_t, b_t = _token_inputs(
            k, v, a, b, tokens, live, i_h, i_hv, o_k, o_v, H, HV, K, V
        )
        slots = tl.load(indices_row + start + o_t, mask=live, other=0)
        if start + TOKENS >= seq_len:  # this program's last inputs are loaded
            release_dependents(PDL)
        decay, beta = _gates(a_t, b_t, decay_rate, bias, softplus_beta, softplus_threshold)
        q_t = _l2_normalised(q_t) * scale
        k_t = _l2_normalised(k_t)
        for t in tl.static_range(TOKENS):
            if start + t < seq_len:
                key, value = _row(k_t, o_t, t), _row(v_t, o_t, t)
                h = _delta_rule(h, key, value, _entry(decay, o_t, t), _entry(beta, o_t, t))
                out = tl.sum(h * _row(q_t, o_t, t)[None, :], axis=1)
                token = bos + start + t
                tl.store(o + (token * HV + i_hv) * V + o_v, out.to(o.dtype.element_ty))
                slot = _entry(slots, o_t, t)
                if slot > 0:
                    target = state + slot.to(tl.int64) * state_stride + head_state
                    tl.store(target, h.to(state.dtype.element_ty))


DEFAULT_WARPS = 1  # one warp per program: the fastest at every case `bench gdn` timed


def gdn_recurrent_update(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    *,
    tokens_per_pass: int = 4,
    scale: float | None = None,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    block_v: int | None = None,
    num_warps: int = DEFAULT_WARPS,
    out: torch.Tensor | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """The outputs [1, T, HV, V] of the recurrent update, with `state` updated in place; the
    arguments as vLLM's fused_sigmoid_gating_delta_rule_update takes them for decode
    (num_accepted_tokens None, 1-D or 2-D state_indices) and verify (2-D state_indices [N, >=T],
    num_accepted_tokens [N]), with use_qk_l2norm_in_kernel and inplace_final_state.
    tokens_per_pass: tokens loaded together (a power of two; 1 + drafts fits a verify step);
    longer sequences take several passes. out: where the outputs go (else a new tensor); a
    skipped sequence's rows are left as they are. pdl: programmatic dependent launch
    (kernels/pdl.py); None: as the PDL knob decides for the card."""
    problems = unsupported(q, k, v, state, tokens_per_pass)
    if problems:
        raise ValueError("gdn_recurrent_update: needs " + "; ".join(problems))
    _, total, heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2], v.shape[3]
    sequences = cu_seqlens.numel() - 1
    block = block_v or default_block_v(sequences, v_heads, v_dim)
    if out is None:
        out = torch.empty((1, total, v_heads, v_dim), dtype=q.dtype, device=q.device)
    elif out.shape != (1, total, v_heads, v_dim) or not out.is_contiguous():
        wanted = f"[1, {total}, {v_heads}, {v_dim}]"
        raise ValueError(f"gdn_recurrent_update: needs out contiguous {wanted}")
    if sequences == 0:
        return out
    indices_stride = state_indices.stride(0)
    pdl = launch_with_pdl(q.device, pdl)
    _gdn_recurrent_kernel[(triton.cdiv(v_dim, block), sequences * v_heads)](
        A_log,
        a.contiguous(),
        b.contiguous(),
        dt_bias,
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out,
        state,
        cu_seqlens,
        state_indices,
        num_accepted_tokens if num_accepted_tokens is not None else cu_seqlens,
        softplus_beta,
        softplus_threshold,
        scale if scale is not None else k_dim**-0.5,
        state.stride(0),
        indices_stride,
        H=heads,
        HV=v_heads,
        K=k_dim,
        V=v_dim,
        BV=block,
        TOKENS=tokens_per_pass,
        VERIFY=num_accepted_tokens is not None,
        PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
    )
    return out
