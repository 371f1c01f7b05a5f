"""The Gated DeltaNet update's per-token math and launch checks, shared by the decode and verify
kernels of this folder (one recurrent step, in vLLM's order and in fp32):

  g = -exp(A_log) * softplus(a + dt_bias)         beta = sigmoid(b)
  q, k = l2-normalised q, k (q also times scale)
  h *= exp(g);  v -= h k;  v *= beta;  h += v kᵀ;  o = h q

with h a program's state rows [BV, K] (vLLM's state layout [slots, HV, V, K]) and a step's
tokens held in register tiles [TOKENS, X].
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row(tile, offsets, t):
    """Row t of a register tile [TOKENS, X] (a masked sum: tiles cannot be indexed)."""
    return tl.sum(tl.where(offsets[:, None] == t, tile, 0.0), axis=0)


@triton.jit
def _entry(vector, offsets, t):
    """Entry t of a register vector [TOKENS], of its own dtype."""
    return tl.sum(tl.where(offsets == t, vector, 0), axis=0)


@triton.jit
def _token_inputs(k, v, a, b, rows, live, i_h, i_hv, o_k, o_v, H, HV, K, V):
    """k [TOKENS, K], v [TOKENS, BV], a and b [TOKENS] of `rows` (token indices of a step's
    inputs, or rows of a saved copy of them laid out alike) for key head i_h and value head
    i_hv, in fp32, zero where not `live`: every row at once, one memory round trip."""
    k_offsets = (rows[:, None] * H + i_h) * K + o_k[None, :]
    v_offsets = (rows[:, None] * HV + i_hv) * V + o_v[None, :]
    k_rows = tl.load(k + k_offsets, mask=live[:, None], other=0.0).to(tl.float32)
    v_rows = tl.load(v + v_offsets, mask=live[:, None], other=0.0).to(tl.float32)
    a_rows = tl.load(a + rows * HV + i_hv, mask=live, other=0.0).to(tl.float32)
    b_rows = tl.load(b + rows * HV + i_hv, mask=live, other=0.0).to(tl.float32)
    return k_rows, v_rows, a_rows, b_rows


@triton.jit
def _gates(a, b, decay_rate, bias, softplus_beta, softplus_threshold):
    """(decay exp(g), beta) of tokens' a and b in fp32: g = -exp(A_log) * softplus(a +
    dt_bias), beta = sigmoid(b); decay_rate is -exp(A_log)."""
    x = a + bias
    softplus = tl.where(
        softplus_beta * x <= softplus_threshold,
        (1 / softplus_beta) * tl.log(1 + tl.exp(softplus_beta * x)),
        x,
    )
    return tl.exp(decay_rate * softplus), tl.sigmoid(b)


@triton.jit
def _l2_normalised(rows):
    """Each row of a tile [TOKENS, K] over its l2 norm, as vLLM's kernel forms it."""
    return rows * tl.rsqrt(tl.sum(rows * rows, axis=1) + 1e-6)[:, None]


@triton.jit
def _delta_rule(h, key, value, decay, beta):
    """State rows h [BV, K] after one token: h *= decay; v -= h k; v *= beta; h += v kᵀ."""
    h *= decay
    value = (value - tl.sum(h * key[None, :], axis=1)) * beta
    return h + value[:, None] * key[None, :]


def default_block_v(sequences: int, v_heads: int, v_dim: int, sm_count: int = 132) -> int:
    """State rows per program: as many as keep every SM busy with a few programs."""
    block = min(triton.next_power_of_2(v_dim), 32)
    while block > 8 and sequences * v_heads * (v_dim // block) < 4 * sm_count:
        block //= 2
    return block


def unsupported(q, k, v, state, tokens_per_pass: int = 4) -> list[str]:
    """What about these inputs the kernel cannot take (empty: it takes them)."""
    problems = []
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        shapes = ", ".join(str(list(tensor.shape)) for tensor in (q, k, v))
        return [f"q, k [1, T, H, K] and v [1, T, HV, V], got {shapes}"]
    _, _, heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2], v.shape[3]
    if q.shape[0] != 1:
        problems.append(f"one packed batch (q.shape[0] = 1), got {q.shape[0]}")
    if v_heads % heads or k_dim & (k_dim - 1) or v_dim & (v_dim - 1):
        problems.append(f"HV={v_heads} a multiple of H={heads}; K={k_dim}, V={v_dim} powers of 2")
    if state.dim() != 4 or tuple(state.shape[1:]) != (v_heads, v_dim, k_dim):
        problems.append(f"state [slots, {v_heads}, {v_dim}, {k_dim}], got {list(state.shape)}")
    elif state[0].stride() != (v_dim * k_dim, k_dim, 1):
        problems.append("each state slot contiguous")
    if tokens_per_pass < 1 or tokens_per_pass & (tokens_per_pass - 1):
        problems.append(f"tokens_per_pass={tokens_per_pass} a power of two")
    return problems
