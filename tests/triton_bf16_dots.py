"""Triton's interpreter computing 16-bit dot operands as a GPU does, for the KVarN kernels'
CPU tests of the operands' rounding.

The stock interpreter (triton 3.6 runtime/interpreter.py) truncates fp32 to bf16 (its
`cast_impl` passes no rounding mode) and multiplies a bf16 tensor's raw uint16 bits in
`create_dot`, which is why the kernels' dots take fp32 operands under it
(decode.dot_operands). With `bf16_dots` (a fixture) casts to bf16 round to nearest even, as
the GPU's cvt.rn.bf16.f32, the dot multiplies the values in fp32 (exact products of 8-bit
significands, fp32 sums as the tensor cores' accumulator), and the kernels take bf16
operands. Only the sums' order differs from a GPU's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter

from hyperqwen.kvarn import decode, prefill

_STOCK_CAST = interpreter.InterpreterBuilder.cast_impl


def _cast(self, src, dst_type):
    if dst_type.scalar == tl.bfloat16 and src.dtype.scalar != tl.bfloat16:
        x = torch.from_numpy(np.ascontiguousarray(src.data).astype(np.float64))
        raw = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return interpreter.TensorHandle(raw, tl.bfloat16)
    return _STOCK_CAST(self, src, dst_type)


def _values(handle) -> np.ndarray:
    if handle.dtype.scalar == tl.bfloat16:  # stored as uint16: bf16 is fp32's high half
        return (handle.data.astype(np.uint32) << 16).view(np.float32)
    return handle.data


def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    product = np.matmul(_values(a), _values(b), dtype=np.float32)
    return interpreter.TensorHandle(product + d.data, d.dtype.scalar)


@pytest.fixture
def bf16_dots(monkeypatch, interpreted):
    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", _cast)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", _dot)
    for module in (decode, prefill):
        monkeypatch.setattr(module, "dot_operands", lambda dtype: tl.bfloat16)
