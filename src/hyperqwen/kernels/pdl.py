"""Programmatic dependent launch (PDL) for HyperQwen's decode-step kernels, sm90 and newer.

A kernel launched with PDL (Triton's `launch_pdl=True`) may start while the kernel before it
on the stream still runs, once every program of that one has called `gdc_launch_dependents`
or exited. So each kernel here, with its PDL switch (a constexpr) on, keeps to one rule:

- before `wait_for_producers` it reads only what no kernel writes (weights, parameters) and
  writes nothing: it computes its indices and asks L2 for its weights (`prefetch_to_l2`), which
  is the work that overlaps the previous kernel's tail;
- every program calls `wait_for_producers` on every path, before its first read of anything a
  kernel may have written (activations, state, metadata) and before any early return, so its
  own end comes after its predecessor's and a kernel after it that waits for it waits for all
  before it too;
- it calls `release_dependents` after its last read of such inputs (its main loop), before its
  epilogue. That only lets the next kernel start its own prologue: the next kernel's wait still
  waits for this one to finish and its writes to be visible, so the placement is about speed
  (a waiting program holds an SM slot), never about results.

A kernel of someone else launched with PDL after one of these must wait likewise (vLLM's Triton
LoRA kernels do; nothing on the Qwen3.5 path launches with PDL). With the switch off the
helpers emit nothing: the kernel compiles as it did before it had them. Under Triton's CPU
interpreter they emit nothing either (it runs no PTX, and runs each launch to its end before
the next: what the wait guarantees), so CPU tests check everything the switch changes but the
three instructions.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from hyperqwen.engine import pdl as knob
from hyperqwen.engine.features import ON

_GDC = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
# one thread asks L2 for [start rounded down to 16 bytes, end rounded up) in one bulk prefetch
# (sm90+; the size must be a multiple of 16); $0 is a dummy output, as in Triton's gdc helpers
_BULK_PREFETCH = tl.constexpr(
    "{ .reg .pred p; .reg .u32 t, n; .reg .b64 a, e;"
    " mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;"
    " and.b64 a, $1, -16; cvt.u64.u32 e, $2; add.u64 e, e, $1; add.u64 e, e, 15;"
    " and.b64 e, e, -16; sub.u64 e, e, a; cvt.u32.u64 n, e;"
    " @p cp.async.bulk.prefetch.L2.global [a], n; } // dummy $0"
)


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """Wait for the previous kernel to finish, its writes visible (griddepcontrol.wait)."""
    if PDL and _GDC:
        gdc_wait()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """Let the next kernel launch (griddepcontrol.launch_dependents); it still waits for us."""
    if PDL and _GDC:
        gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(ptr, count, PDL: tl.constexpr):
    """Ask L2 for `count` elements from the scalar pointer `ptr` (a weight, which no kernel
    writes), from one thread of the program; nothing without PDL."""
    if PDL and _GDC:
        nbytes = (count * (ptr.dtype.element_ty.primitive_bitwidth // 8)).to(tl.int32)
        tl.inline_asm_elementwise(
            _BULK_PREFETCH, "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1
        )


def runs_here(device: torch.device) -> bool:
    """Whether the kernels can launch with PDL on `device`: a CUDA card of sm90 or newer, or
    the CPU interpreter (which runs their PDL code and ignores the launch attribute)."""
    return device.type != "cuda" or knob.decide(ON, torch.cuda.get_device_capability(device))


def launch_with_pdl(device: torch.device, pdl: bool | None) -> bool:
    """Whether a launch on `device` uses PDL: `pdl` as given (True refused where it cannot
    run), or None: the PDL knob's decision for the card (engine/pdl.py); so never on a CUDA
    card below sm90."""
    if pdl is None:
        return device.type == "cuda" and knob.for_capability(
            torch.cuda.get_device_capability(device)
        )
    if pdl and not runs_here(device):
        raise ValueError(
            f"pdl=True: programmatic dependent launch needs sm90 or newer; {device} is "
            f"sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
        )
    return pdl
