"""A Gated DeltaNet verify step that keeps one recurrent state per request and replays.

vLLM 0.26 verifies a GDN layer under speculative decoding (1 + W tokens per request) by storing
the state after every verified token in a block of its own (MambaSpec.num_speculative_blocks =
W), so the next step can start from whichever token was the last accepted: 1 + W full fp32
states per request and layer, 2 + W under prefix caching (engine/quoting.md, "GDN state").
This verify keeps only the committed state, the one at the step's start, and a small buffer of
the step's own inputs (k, v, a and b of its tokens, as the layer hands them over: q is not
needed, the replayed tokens' outputs were produced when they were verified). The next step
first folds the previous step's accepted tokens into the committed state from those inputs, in
vLLM's order and arithmetic (gdn_delta_rule.py's helpers), writes it back, then runs its own
tokens with the state in registers only. The causal conv window is not concerned: vLLM keeps
it in the request's first block, W columns wider, and shifts it by num_accepted_tokens.

Per request n, with its committed state slot s = state_slots[n] (0, vLLM's null block: the
request is skipped, nothing read or written) and r = replay_counts[n]:

  h = state[s];  h <- the update over the first r saved tokens of slot s;  state[s] = h (r > 0)
  o_t = h_t q_t over this step's tokens t, h_t the update through t (registers only)
  saved[s][t] = (k_t, v_t, a_t, b_t) for this step's tokens

r is the number of the previous verify's tokens that were accepted: vLLM's num_accepted_tokens
(the first verified token, which is always kept, plus the accepted drafts; at most that step's
token count), and 0 where the committed state already holds everything (a new or resumed
request, the first verify after a prefill or plain decode, where vLLM's count reads 1 but
nothing was saved). That difference, and clearing r after a step that did not save, is the
caller's: this module does not see vLLM's scheduler.

The saved inputs live per state slot ([slots, 1 + W, ...], ReplayBuffer; a slot's rows
contiguous, slots any stride apart, as vLLM lays its state tensors a page apart), so they follow the
request as its state does, whatever order the batch takes, and a request skipped by a step
(a budget-starved decode) replays them one step later. Two launches, one fixed grid each, no
host synchronisation (CUDA-graph safe): the verify, then the save, which must not overwrite an
input another program of the verify may still read (a key head serves HV / H value heads).

Memory, computed by capacity.py (`gdn_verify_state_bytes`, `replay_buffer_bytes`), not
measured, for the 27B (48 GDN layers, 16 key and 48 value heads of 128, fp32 state, bf16
inputs, one GPU) at W = 15 drafts per request: the saved inputs take 16 tokens x (16 x 128 +
48 x 128 + 2 x 48) x 2 bytes = 259 KiB per layer, against a state block of 3.35 MiB (the
3 MiB recurrent state and the conv window, 360 KiB at W = 15). Per request over the 48 layers,
unpadded: with prefix caching vLLM's 17 state blocks take 2,735 MiB, the replay verify's 2
blocks and buffer 334 MiB; without, 16 blocks (2,574 MiB) against 1 and the buffer (173 MiB).

Status: agrees with a float64 reference of vLLM's semantics and with vLLM's own kernel run with
per-token state slots, over multi-step runs with random acceptance (tests/test_kernel_gdn
_replay.py, Triton's CPU interpreter only), and through the layer's verify seam on a page laid
out as vLLM binds it (tests/test_engine_gdn_replay_seam.py); gdn_replay_fold into another
slot, prefix caching's `align` moves and boundary copies, against vLLM's per-token states amid
a run (wired into vLLM's align path by engine/gdn_replay_align.py). Served on the H200
(lossless) and timed on the H100, where 15 slots with it took a 27B chat step from 12.9 to 29.5
ms, across two runs (engine/quoting.md, "GDN replay", says what is wired, what was measured
and what is left).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class ReplayBuffer:
    """One GDN layer's saved verify inputs, per state slot: k [slots, tokens, H, K], v [slots,
    tokens, HV, V], a and b [slots, tokens, HV], in the inputs' dtype (bf16 in vLLM's layer)."""

    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor

    @classmethod
    def allocate(
        cls,
        slots: int,
        tokens: int,
        heads: int,
        v_heads: int,
        k_dim: int,
        v_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> ReplayBuffer:
        """Uninitialised: a slot's inputs are read only after a verify saved them. tokens: the
        most a verify step gives one request, 1 + W."""
        return cls(
            k=torch.empty((slots, tokens, heads, k_dim), dtype=dtype, device=device),
            v=torch.empty((slots, tokens, v_heads, v_dim), dtype=dtype, device=device),
            a=torch.empty((slots, tokens, v_heads), dtype=dtype, device=device),
            b=torch.empty((slots, tokens, v_heads), dtype=dtype, device=device),
        )

    @property
    def tokens(self) -> int:
        return self.k.shape[1]

    def bytes_per_slot(self) -> int:
        return sum(part[0].nbytes for part in (self.k, self.v, self.a, self.b))

    def problems(self, q: torch.Tensor, v: torch.Tensor, state: torch.Tensor) -> list[str]:
        """What about this buffer does not fit the step's inputs and state pool."""
        slots, tokens = state.shape[0], self.tokens
        _, _, heads, k_dim = q.shape
        v_heads, v_dim = v.shape[2], v.shape[3]
        wanted = {
            "k": ((slots, tokens, heads, k_dim), q.dtype),
            "v": ((slots, tokens, v_heads, v_dim), v.dtype),
            "a": ((slots, tokens, v_heads), v.dtype),
            "b": ((slots, tokens, v_heads), v.dtype),
        }
        problems = []
        for name, (shape, dtype) in wanted.items():
            part = getattr(self, name)
            # a slot's rows contiguous; slots may lie a page apart (vLLM's state tensors)
            if tuple(part.shape) != shape or part.dtype != dtype or not part[0].is_contiguous():
                problems.append(
                    f"saved {name} contiguous per slot {list(shape)} {dtype}, got "
                    f"{list(part.shape)} {part.dtype}"
                )
        if self.a.stride(0) != self.b.stride(0):
            problems.append("saved a and b with one slot stride")
        return problems


@triton.jit(do_not_specialize=["softplus_beta", "softplus_threshold", "scale"])
def _gdn_replay_kernel(
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
    state_slots,
    dest_slots,
    replay_counts,
    saved_k,
    saved_v,
    saved_a,
    saved_b,
    softplus_beta,
    softplus_threshold,
    scale,
    state_stride,
    saved_k_stride,
    saved_v_stride,
    saved_gates_stride,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    SAVED: tl.constexpr,
    TOKENS: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    slot = tl.load(state_slots + i_n).to(tl.int64)
    if slot <= 0:  # vLLM's null block: a padded or skipped request
        return
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    seq_len = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    # never past what a step can have saved, whatever the caller passes
    replayed = tl.minimum(tl.load(replay_counts + i_n), SAVED)

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, TOKENS)
    head_state = i_hv * V * K + o_v[:, None] * K + o_k[None, :]
    committed = state + slot * state_stride + head_state
    # where the folded state goes: the slot itself, but for a move (gdn_replay_fold)
    dest = tl.load(dest_slots + i_n).to(tl.int64)
    h = tl.load(committed).to(tl.float32)
    decay_rate = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    bias = tl.load(dt_bias + i_hv).to(tl.float32)

    if replayed > 0:
        # the previous verify's accepted tokens, from this slot's saved inputs
        live = o_t < replayed
        gates = slot * saved_gates_stride
        k_t, v_t, a_t, b_t = _token_inputs(
            saved_k + slot * saved_k_stride,
            saved_v + slot * saved_v_stride,
            saved_a + gates,
            saved_b + gates,
            o_t, live, i_h, i_hv, o_k, o_v, H, HV, K, V,
        )  # fmt: skip
        decay, beta = _gates(a_t, b_t, decay_rate, bias, softplus_beta, softplus_threshold)
        k_t = _l2_normalised(k_t)
        for t in tl.static_range(TOKENS):
            if t < replayed:
                key, value = _row(k_t, o_t, t), _row(v_t, o_t, t)
                h = _delta_rule(h, key, value, _entry(decay, o_t, t), _entry(beta, o_t, t))
    if replayed > 0 or dest != slot:
        tl.store(state + dest * state_stride + head_state, h.to(state.dtype.element_ty))

    for start in range(0, seq_len, TOKENS):
        tokens = bos + start + o_t
        live = start + o_t < seq_len
        q_offsets = (tokens[:, None] * H + i_h) * K + o_k[None, :]
        q_t = tl.load(q + q_offsets, mask=live[:, None], other=0.0).to(tl.float32)
        k_t, v_t, a_t, b_t = _token_inputs(
            k, v, a, b, tokens, live, i_h, i_hv, o_k, o_v, H, HV, K, V
        )
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


@triton.jit
def _save_inputs_kernel(
    a,
    b,
    k,
    v,
    cu_seqlens,
    state_slots,
    saved_k,
    saved_v,
    saved_a,
    saved_b,
    saved_k_stride,
    saved_v_stride,
    saved_gates_stride,
    KEYS: tl.constexpr,  # H * K of one token
    VALUES: tl.constexpr,  # HV * V
    GATES: tl.constexpr,  # HV
    BLOCK_KEYS: tl.constexpr,
    BLOCK_VALUES: tl.constexpr,
    BLOCK_GATES: tl.constexpr,
):
    """One program per request and saved position: token t of request n into slot s's row t
    (the grid's second dimension is the buffer's rows, so no later token is saved)."""
    i_n = tl.program_id(0)
    t = tl.program_id(1)
    slot = tl.load(state_slots + i_n).to(tl.int64)
    if slot <= 0:
        return
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    if t >= tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos:
        return
    token = bos + t
    o_keys = tl.arange(0, BLOCK_KEYS)
    o_values = tl.arange(0, BLOCK_VALUES)
    o_gates = tl.arange(0, BLOCK_GATES)
    keys, values, gates = o_keys < KEYS, o_values < VALUES, o_gates < GATES
    to_k = saved_k + slot * saved_k_stride + t * KEYS + o_keys
    to_v = saved_v + slot * saved_v_stride + t * VALUES + o_values
    to_gate = slot * saved_gates_stride + t * GATES + o_gates
    tl.store(to_k, tl.load(k + token * KEYS + o_keys, keys), keys)
    tl.store(to_v, tl.load(v + token * VALUES + o_values, values), values)
    tl.store(saved_a + to_gate, tl.load(a + token * GATES + o_gates, gates), gates)
    tl.store(saved_b + to_gate, tl.load(b + token * GATES + o_gates, gates), gates)


def gdn_replay_verify(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    replay_counts: torch.Tensor,
    saved: ReplayBuffer,
    *,
    scale: float | None = None,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    block_v: int | None = None,
    num_warps: int = 1,  # not timed: one warp, as the decode kernels of this shape
    out: torch.Tensor | None = None,
    dest_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The outputs [1, T, HV, V] of a verify step; `state` (vLLM's pool [slots, HV, V, K]) and
    `saved` updated in place as the module docstring says. q, k [1, T, H, K], v [1, T, HV, V],
    a, b [T, HV] as vLLM's spec branch passes them to its recurrent kernel; cu_seqlens [N + 1]
    (its spec_query_start_loc: a request's count may be 0); state_slots [N] (its block table's
    first column, the committed block); replay_counts [N]. A request's token count must not
    exceed saved.tokens: its later tokens are verified but not saved. out: where the outputs
    go (else a new tensor); a skipped request's rows are left as they are. dest_slots: where
    each request's folded state is written (gdn_replay_fold's moves; default state_slots), for
    requests of no tokens only: a request with tokens must fold and verify in one slot."""
    problems = unsupported(q, k, v, state) + saved.problems(q, v, state)
    if problems:
        raise ValueError("gdn_replay_verify: needs " + "; ".join(problems))
    _, total, heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2], v.shape[3]
    requests = cu_seqlens.numel() - 1
    if out is None:
        out = torch.empty((1, total, v_heads, v_dim), dtype=q.dtype, device=q.device)
    elif out.shape != (1, total, v_heads, v_dim) or not out.is_contiguous():
        wanted = f"[1, {total}, {v_heads}, {v_dim}]"
        raise ValueError(f"gdn_replay_verify: needs out contiguous {wanted}")
    if requests == 0:
        return out
    a, b, q, k, v = (x.contiguous() for x in (a, b, q, k, v))
    # the kernel reads the per-request entries a unit stride apart (a table's column is not)
    cu_seqlens, state_slots, replay_counts = (
        x.contiguous() for x in (cu_seqlens, state_slots, replay_counts)
    )
    dest_slots = state_slots if dest_slots is None else dest_slots.contiguous()
    block = block_v or default_block_v(requests, v_heads, v_dim)
    slot_strides = (saved.k.stride(0), saved.v.stride(0), saved.a.stride(0))
    _gdn_replay_kernel[(triton.cdiv(v_dim, block), requests * v_heads)](
        A_log,
        a,
        b,
        dt_bias,
        q,
        k,
        v,
        out,
        state,
        cu_seqlens,
        state_slots,
        dest_slots,
        replay_counts,
        saved.k,
        saved.v,
        saved.a,
        saved.b,
        softplus_beta,
        softplus_threshold,
        scale if scale is not None else k_dim**-0.5,
        state.stride(0),
        *slot_strides,
        H=heads,
        HV=v_heads,
        K=k_dim,
        V=v_dim,
        BV=block,
        SAVED=saved.tokens,
        TOKENS=triton.next_power_of_2(saved.tokens),
        num_warps=num_warps,
    )
    # after the verify on the stream: it may still read the inputs this overwrites
    keys, values = heads * k_dim, v_heads * v_dim
    _save_inputs_kernel[(requests, saved.tokens)](
        a,
        b,
        k,
        v,
        cu_seqlens,
        state_slots,
        saved.k,
        saved.v,
        saved.a,
        saved.b,
        *slot_strides,
        KEYS=keys,
        VALUES=values,
        GATES=v_heads,
        BLOCK_KEYS=triton.next_power_of_2(keys),
        BLOCK_VALUES=triton.next_power_of_2(values),
        BLOCK_GATES=triton.next_power_of_2(v_heads),
    )
    return out


def gdn_replay_fold(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    replay_counts: torch.Tensor,
    saved: ReplayBuffer,
    *,
    dest_slots: torch.Tensor | None = None,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> None:
    """Folds the first replay_counts[n] saved tokens of slot state_slots[n] into its state,
    and nothing else: for a request that runs vLLM's prefill or decode kernels this step after
    a verify (engine/gdn_replay.py `unreplayed`). With dest_slots, the folded state goes to
    slot dest_slots[n] instead (a count of 0: the state as it is), and state_slots[n]'s state
    and saved inputs are left as they were: the move of a request's state to another block,
    and the state at a block boundary copied for the prefix cache, under prefix caching's
    `align` mode (engine/quoting.md, item 4). The verify kernel over requests of no tokens
    (it saves none either); a request on slot 0 (vLLM's null block), or with a count of 0 and
    no other destination, is not read."""
    requests = state_slots.numel()
    if requests == 0:
        return
    heads, k_dim = saved.k.shape[2], saved.k.shape[3]
    v_heads, v_dim = saved.v.shape[2], saved.v.shape[3]
    device, dtype = state.device, saved.k.dtype
    dest_slots = state_slots if dest_slots is None else dest_slots
    if dest_slots.shape != state_slots.shape:
        raise ValueError("gdn_replay_fold: needs one destination slot per source slot")
    # one placeholder token: the kernel's argument checks want a step's shapes; none is read
    q = torch.zeros((1, 1, heads, k_dim), dtype=dtype, device=device)
    v = torch.zeros((1, 1, v_heads, v_dim), dtype=dtype, device=device)
    gates = torch.zeros((1, v_heads), dtype=dtype, device=device)
    reads = (replay_counts > 0) | (dest_slots != state_slots)
    gdn_replay_verify(
        A_log, gates, gates, dt_bias, q, q, v, state,
        torch.zeros(requests + 1, dtype=torch.int32, device=device),
        torch.where(reads, state_slots, 0).to(torch.int32),
        replay_counts, saved, softplus_beta=softplus_beta, softplus_threshold=softplus_threshold,
        dest_slots=dest_slots.to(torch.int32),
    )  # fmt: skip
