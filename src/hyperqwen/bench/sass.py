"""`hyperqwen bench sass`: what the W4A16 kernel's main loop issues, from SASS compiled here.

No GPU: Triton compiles `kernels/w4a16.py` for the named architecture, and `cuobjdump -sass`
(shipped with Triton) disassembles it. The main loop is the backward branch spanning the most
instructions; its lane-ops per weight code (loop instructions x 32 x warps / codes per
iteration) is the issue cost the kernels README compares against the bytes a token must read.
The compile gets the argument hints a real launch of a 27B shape gets (pointers and lengths
divisible by 16): without them Triton does not vectorize the loads and the counts mislead.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ARCHES = (80, 86, 89, 90)
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(\S*)([^;]*)")
# the kernel's integer arguments that are multiples of 16 at every 27B shape
DIVISIBLE = ("K", "N", "groups_per_row", "stride_xm", "stride_om")


@dataclass(frozen=True)
class LoopCount:
    arch: int
    config: str
    instructions: int  # in the main loop, per warp
    lane_ops_per_code: float
    shared_bytes: int
    ops: dict[str, int]  # opcode -> count, most common first
    loads: dict[str, int]  # global loads and cp.async copies by their SASS suffix


def divisible_by_16(kernel, names) -> dict:
    """ASTSource attrs marking the kernel's arguments `names` divisible by 16, as Triton
    specializes a launch's aligned pointers and multiple-of-16 integers."""
    return {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in names}


def compile_kernel(config, arch: int, block_m: int = 16):
    """The Triton-compiled kernel for one tile config and architecture (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hyperqwen.kernels import w4a16

    kernel = w4a16._w4a16_kernel
    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16",
                "partial_ptr": "*fp32", "counter_ptr": "*i32"}  # fmt: skip
    constants = w4a16.kernel_constants(config, block_m, even=True)
    signature = {
        name: pointers.get(name, "constexpr" if name in constants else "i32")
        for name in kernel.arg_names
    }
    attrs = divisible_by_16(kernel, [*pointers, *DIVISIBLE])
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def disassemble(cubin: bytes) -> str:
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        done = subprocess.run(
            [str(cuobjdump), "-sass", handle.name], capture_output=True, text=True, check=True
        )
    return done.stdout


def main_loop(sass: str) -> list[tuple[str, str]]:
    """(opcode, suffix) of the instructions in the longest backward branch's span."""
    listing = [
        (int(found[1], 16), found[2], found[3], found[4])
        for found in map(INSTRUCTION.match, sass.splitlines())
        if found
    ]
    best: list[tuple[str, str]] = []
    for address, opcode, _, operands in listing:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode == "BRA" else None
        if target and int(target[1], 16) < address:
            start = int(target[1], 16)
            span = [(op, suffix) for at, op, suffix, _ in listing if start <= at <= address]
            best = span if len(span) > len(best) else best
    return best


def count_loop(config, arch: int) -> LoopCount:
    compiled = compile_kernel(config, arch, block_m=config.block_m or 16)
    loop = main_loop(disassemble(compiled.asm["cubin"]))
    if not loop:
        raise RuntimeError(f"no loop found in the sm{arch} SASS of {config.label()}")
    ops = collections.Counter(op for op, _ in loop)
    loads = collections.Counter(op + suffix for op, suffix in loop if op in ("LDG", "LDGSTS"))
    codes = config.block_n * config.block_k
    return LoopCount(
        arch=arch,
        config=config.label(),
        instructions=len(loop),
        lane_ops_per_code=round(len(loop) * 32 * config.num_warps / codes, 2),
        shared_bytes=compiled.metadata.shared,
        ops=dict(ops.most_common()),
        loads=dict(loads),
    )


def cmd_sass(args: argparse.Namespace) -> int:
    from hyperqwen.kernels.w4a16 import TileConfig, check_config

    if os.environ.get("TRITON_INTERPRET") == "1":
        print("bench sass: compiles the kernel; unset TRITON_INTERPRET (=1 here)", file=sys.stderr)
        return 2

    config = TileConfig(
        args.block_n, args.block_k, 1, args.warps, args.stages, args.persistent, args.block_m
    )
    check_config(config, 128, args.block_k)
    counts = [count_loop(config, arch) for arch in args.arch]
    if args.json:
        print(json.dumps([asdict(count) for count in counts], indent=1))
        return 0
    for count in counts:
        print(
            f"sm{count.arch} {count.config}: {count.instructions} instructions per loop step, "
            f"{count.lane_ops_per_code} lane-ops per code, {count.shared_bytes} B shared memory"
        )
        print(f"  ops: {dict(list(count.ops.items())[:12])}")
        print(f"  global loads: {count.loads}")
    return 0


def add_subcommand(actions) -> None:
    sass = actions.add_parser(
        "sass",
        help="count the W4A16 kernel's main-loop instructions in SASS compiled here (no GPU)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sass.add_argument("--block-n", type=int, default=64, help="rows per program")
    sass.add_argument("--block-k", type=int, default=256, help="K per loop step")
    sass.add_argument("--warps", type=int, default=2)
    sass.add_argument("--stages", type=int, default=3, help="software pipeline stages")
    sass.add_argument(
        "--persistent",
        type=int,
        default=0,
        metavar="PROGRAMS_PER_SM",
        help="the persistent grid (programs per SM; 0: one program per work item)",
    )
    sass.add_argument(
        "--arch", type=int, nargs="+", choices=ARCHES, default=[90], help="sm versions"
    )
    sass.add_argument(
        "--block-m", type=int, default=0, help="rows of x per program (default 0: 16, as M <= 16)"
    )
    sass.add_argument("--json", action="store_true", help="print JSON instead of text")
    sass.set_defaults(func=cmd_sass)
