"""Shared memory of KVarN's Triton kernels, compiled here for a GPU architecture (no GPU needed).

Triton sizes a kernel's shared memory at compile time (`metadata.shared`), and a launch that
asks for more than the card allows per block fails. sm86 and sm89 (RTX 3090, 4090) allow
99 KB, sm80 (A100) 163 KB, sm90 (H100, H200) 227 KB. Each kernel is compiled with the
arguments its launcher gives at the 27B's shapes (4 KV heads of head_dim 256, 24 query heads,
a verify block of 4 queries, prefill programs of
prefill.PREFILL_ROWS rows), in 2-bit tiles, and those that read or write value codes again in
3-bit ones (NAME_v3). `python -m hyperqwen.kvarn.fit [--json] [arch ...]` prints them, with
each kernel's register spill stores.
"""

from __future__ import annotations

import json
import os
import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hyperqwen.kvarn import (
    decode,
    dequant,
    hadamard,
    prefill,
    quantize,
    side_write,
    step_tensors,
    store,
)
from hyperqwen.kvarn.layout import HEAD_DIM_27B, V_BITS, TileLayout

SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
GROUP_27B, VERIFY_QUERIES = 6, 4


def _launches(d: int, v_bits: int = V_BITS) -> dict:
    """kernel name -> (jit function, pointer types, constexprs, num_warps, num_stages), as
    the launchers call them for bf16 data in tiles of `v_bits`-bit values."""
    layout = TileLayout(head_dim=d, v_bits=v_bits)
    tile_io = {"k_ptr": "*bf16", "v_ptr": "*bf16", "pool_ptr": "*u8", "block_ids_ptr": "*i32"}
    store_constants = dict(
        T=layout.tokens, D=d, AT=layout.offsets, K_LEVELS=quantize.K_LEVELS,
        V_LEVELS=layout.v_levels, BALANCE_ROUNDS=quantize.BALANCE_ROUNDS,
        GRID_ROUNDS=quantize.GRID_ROUNDS, MIN_SCALE=quantize.MIN_SCALE,
        MIN_STEP=quantize.MIN_STEP, K_COLUMNS=store.K_COLUMNS, V_ROWS=store.V_ROWS,
    )  # fmt: skip
    partition_pointers = {
        "q_ptr": "*bf16", "pool_ptr": "*u8", "block_table_ptr": "*i32", "side_k_ptr": "*bf16",
        "side_v_ptr": "*bf16", "slot_ptr": "*i32", "seq_lens_ptr": "*i32",
        "query_start_ptr": "*i32", "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32",
        "sm_scale": "fp32",
    }  # fmt: skip
    block_m = decode.partition_rows(VERIFY_QUERIES, GROUP_27B)
    partition_constants = dict(
        G=GROUP_27B, BLOCK_M=block_m, BLOCK_N=decode.BLOCK_N, T=layout.tokens, D=d,
        AT=layout.offsets, V_LEVELS=layout.v_levels, DOT=tl.bfloat16,
    )  # fmt: skip
    prefill_pointers = {
        name: kind for name, kind in partition_pointers.items() if not name.startswith("part_")
    } | {"work_ptr": "*i32", "out_ptr": "*bf16"}
    prefill_constants = dict(
        G=GROUP_27B, QUERIES=prefill.PREFILL_ROWS // GROUP_27B, BLOCK_M=prefill.PREFILL_ROWS,
        BLOCK_N=decode.BLOCK_N, T=layout.tokens, D=d, AT=layout.offsets,
        V_LEVELS=layout.v_levels, DOT=tl.bfloat16,
    )  # fmt: skip
    merge_pointers = {"part_o_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*bf16"}
    dequant_constants = dict(
        T=layout.tokens, D=d, AT=layout.offsets, V_LEVELS=layout.v_levels, UNROTATE=True
    )
    rotate_constants = dict(BLOCK_ROWS=hadamard.ROTATE_BLOCK_ROWS, N=d)
    return {
        "store": (
            store._store_kernel,
            tile_io | {"tile_ids_ptr": "*i64"},
            store_constants,
            store.STORE_WARPS,
            3,
        ),
        "dequant": (dequant._dequant_kernel, tile_io, dequant_constants, 8, 3),
        "rotate_rows": (
            hadamard._rotate_rows_kernel,
            {"x_ptr": "*bf16", "out_ptr": "*bf16"},
            rotate_constants,
            4,
            3,
        ),
        "decode_partition": (
            decode._partition_kernel,
            partition_pointers,
            partition_constants,
            decode.PARTITION_WARPS,
            None,  # the served pipeline for the architecture (compile_for)
        ),
        "decode_merge": (
            decode._merge_kernel,
            merge_pointers,
            dict(G=GROUP_27B, BLOCK_H=16, D=d),
            decode.MERGE_WARPS,
            3,
        ),
        "prefill": (
            prefill._prefill_kernel,
            prefill_pointers,
            prefill_constants,
            prefill.PREFILL_WARPS,
            1,
        ),
        "step_tensors": (
            step_tensors._step_tensors_kernel,
            {
                "staged_ptr": "*i32",
                "mapping_ptr": "*i64",
                "seq_lens_ptr": "*i32",
                "query_start_ptr": "*i32",
                "slot_of_block_ptr": "*i32",
                "side_rows_ptr": "*i64",
                "store_blocks_ptr": "*i64",
                "store_slots_ptr": "*i64",
            },
            dict(T=layout.tokens, BLOCK=step_tensors.STEP_BLOCK),
            4,
            3,
        ),
        "side_write": (
            side_write._side_write_kernel,
            {
                "key_ptr": "*bf16",
                "value_ptr": "*bf16",
                "rows_ptr": "*i64",
                "side_k_ptr": "*bf16",
                "side_v_ptr": "*bf16",
            },
            dict(WIDTH=4 * d, BLOCK=4 * d),  # the 27B's 4 KV heads
            4,
            3,
        ),
    }


# the kernels that read or write value codes, compiled again for 3-bit values (their own
# branch of dequant.v_codes and of the store: KVARN_V_BITS=3), as NAME_v3
VALUE_KERNELS = ("store", "dequant", "decode_partition", "prefill")


def _table(d: int) -> dict:
    """_launches' kernels of 2-bit tiles, and the VALUE_KERNELS of 3-bit ones."""
    three = _launches(d, v_bits=3)
    return _launches(d) | {f"{name}_v3": three[name] for name in VALUE_KERNELS}


def compile_for(name: str, arch: int, d: int = HEAD_DIM_27B):
    """Kernel `name` (a key of the table) compiled for sm<arch>, as its launcher runs it."""
    kernel, pointers, constants, warps, stages = _table(d)[name]
    if stages is None:
        stages = decode.pipeline_stages(SHARED_LIMIT[arch], constants["BLOCK_M"], d)
    signature = {
        arg: pointers.get(arg, "constexpr" if arg in constants else "i32")
        for arg in kernel.arg_names
    }
    # a launch specializes pointers and strides divisible by 16, which a pipelined loop needs
    # for its asynchronous copies: hinted here, the shared memory is the launch's
    from hyperqwen.bench.sass import divisible_by_16

    hinted = [arg for arg in kernel.arg_names
              if signature[arg].startswith("*") or arg.startswith("stride_")]  # fmt: skip
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants,
                       attrs=divisible_by_16(kernel, hinted))  # fmt: skip
    options = {"num_warps": warps, "num_stages": stages}
    if kernel is store._store_kernel:
        options |= store.EXACT_ARITHMETIC
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


# PTX of divisions and roots that are not correctly rounded (Triton's `/` and tl.sqrt)
APPROXIMATE_MATH = re.compile(r"\b(div\.full|div\.approx|sqrt\.approx|rsqrt\.approx|rcp\.approx)\.")


def footprint(name: str, arch: int) -> dict[str, int]:
    """Shared memory bytes, register spill stores (STL) in its SASS (not an error, but local
    memory traffic that a decode kernel's time pays for), and approximate divisions and
    roots in its PTX (the store kernel must have none: store.py)."""
    from hyperqwen.bench.sass import disassemble

    compiled = compile_for(name, arch)
    stores = disassemble(compiled.asm["cubin"]).count(" STL")
    approximate = len(APPROXIMATE_MATH.findall(compiled.asm["ptx"]))
    return {
        "shared": compiled.metadata.shared,
        "spill_stores": stores,
        "approximate_math": approximate,
    }


KERNELS = tuple(_table(HEAD_DIM_27B))


def main(argv: list[str]) -> int:
    """`python -m hyperqwen.kvarn.fit [--json] [arch ...]`: the table (or JSON {arch:
    {kernel: bytes}}) for the named architectures, all of SHARED_LIMIT's by default."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("kvarn fit: compiles the kernels; unset TRITON_INTERPRET (=1 here)", file=sys.stderr)
        return 2
    as_json = "--json" in argv
    arches = [int(a) for a in argv if a != "--json"] or sorted(SHARED_LIMIT)
    sizes = {arch: {name: footprint(name, arch) for name in KERNELS} for arch in arches}
    if as_json:
        print(json.dumps(sizes))
        return 0
    header = " | ".join(f"sm{a}: shared (limit {SHARED_LIMIT[a]}), spill stores" for a in arches)
    print(f"| kernel | {header} |")
    print("|---|" + "---:|" * len(arches))
    for name in KERNELS:
        cells = (f"{sizes[a][name]['shared']}, {sizes[a][name]['spill_stores']}" for a in arches)
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
