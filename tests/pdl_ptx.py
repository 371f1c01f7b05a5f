"""The PTX Triton compiles here (no GPU) for HyperQwen's PDL kernels, reduced to the order of
the instructions PDL is about: `prefetch` (an L2 prefetch of weights), `wait`
(griddepcontrol.wait), `read` (the first global load or async copy), `release`
(griddepcontrol.launch_dependents), `store` (the first global store or atomic).

Run as a script without TRITON_INTERPRET (under it Triton compiles nothing and the PDL helpers
emit nothing), with ARCH:PDL arguments (90:1 86:0): prints {"kernel@smARCH@PDL": [markers
in program order, each at its first occurrence]}.
"""

from __future__ import annotations

import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hyperqwen.kernels import ba_proj, gdn_recurrent, split_qkv, w4a16

MARKERS = {
    "prefetch": re.compile(r"prefetch\.L2"),
    "wait": re.compile(r"griddepcontrol\.wait"),
    "release": re.compile(r"griddepcontrol\.launch_dependents"),
    "read": re.compile(r"^\s*(@%p\d+\s+)?(ld\.global|cp\.async\.c[ag]\.shared\.global)"),
    "store": re.compile(r"^\s*(@%p\d+\s+)?(st\.global|atom\.)"),
}
W4A16_POINTERS = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16",
                  "partial_ptr": "*fp32", "counter_ptr": "*i32"}  # fmt: skip


def kernels():
    """(name, kernel, typed arguments, constexprs, num_warps) at 27B shapes."""
    yield "split_qkv", split_qkv._split_rows_kernel, {"src": "*bf16", "out": "*bf16"}, {
        "Q": 2048, "K": 2048, "V": 6144, "BLOCK": 1024}, 4  # fmt: skip
    yield "ba_proj", ba_proj._ba_kernel, dict.fromkeys(("x_ptr", "w_ptr", "b_ptr", "a_ptr"),
        "*bf16"), {"BLOCK_M": 4, "BLOCK_K": 1024}, 4  # fmt: skip
    gdn = {**dict.fromkeys(("a", "b", "q", "k", "v", "o"), "*bf16"),
           **dict.fromkeys(("A_log", "dt_bias", "state"), "*fp32"),
           **dict.fromkeys(("cu_seqlens", "state_indices", "num_accepted"), "*i32"),
           **dict.fromkeys(("softplus_beta", "softplus_threshold", "scale"), "fp32")}  # fmt: skip
    yield "gdn_recurrent", gdn_recurrent._gdn_recurrent_kernel, gdn, {
        "H": 16, "HV": 48, "K": 128, "V": 128, "BV": 8, "TOKENS": 4, "VERIFY": True}, 1  # fmt: skip
    for config in (w4a16.TileConfig(64, 256, 4), w4a16.TileConfig(64, 256, 4, programs_per_sm=4)):
        constants = w4a16.kernel_constants(config, 16, even=True)
        yield f"w4a16_{config.label()}", w4a16._w4a16_kernel, W4A16_POINTERS, constants, 4


def markers(ptx: str) -> list[str]:
    seen: list[str] = []
    for line in ptx.splitlines():
        for name, pattern in MARKERS.items():
            if name not in seen and pattern.search(line):
                seen.append(name)
    return seen


def main(cases: list[tuple[int, bool]]) -> dict[str, list[str]]:
    found = {}
    for name, kernel, typed, constants, warps in kernels():
        for arch, pdl in cases:
            constexprs = {**constants, "PDL": pdl}
            signature = {
                arg: typed.get(arg, "constexpr" if arg in constexprs else "i32")
                for arg in kernel.arg_names
            }
            source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
            compiled = triton.compile(
                source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}
            )
            found[f"{name}@sm{arch}@{int(pdl)}"] = markers(compiled.asm["ptx"])
    return found


if __name__ == "__main__":
    # arguments: ARCH:PDL, e.g. 90:1 86:0
    cases = [(int(arch), pdl == "1") for arch, pdl in (case.split(":") for case in sys.argv[1:])]
    print(json.dumps(main(cases)))
