"""`python -m hyperqwen.kvarn.bench`: KVarN's decode attention timed on the GPU against vLLM's
FlashAttention over paged bf16 and fp8 caches, for one full-attention layer of the 27B (24
query / 4 KV heads, head_dim 256, 128-token blocks), per context, batch and queries per request
(1: decode, 1 + k: an MTP verify block). Writes a result file (docs/results schema: stock = FA
over fp8, the issue's yardstick; patched = KVarN at its fastest swept split count) with every
timing under "raw".

Each time is hyperqwen.bench.timing's: the median of CUDA-graph replays timed with CUDA
events, the graph running one launch per layer copy, copies enough that their caches pass
256 MiB (L2 never holds them). KVarN's pool is written by the store kernel from random K and V;
the 16-bit sink and filling tiles sit in a side cache. Random data: the times depend on sizes,
not values.

    python -m hyperqwen.kvarn.bench --contexts 32768 114688 --batch 1 4 --queries 1 4 \\
        --out kvarn-decode.json

`--prefill` times the chunked prefill instead: one request's chunk of --chunks tokens after
--contexts tokens, KVarN's prefill kernel (prefill.py, at each --rows program size) against
the same FlashAttention calls (causal, the chunk at the end of the context). Prefill runs
eagerly (its launcher plans work items on the host), so these are medians of eager launches
timed with CUDA events, the host copies of the lengths given as the backend gives them;
one cache copy (every work item reads the whole context, so L2 serves most reads in either).

    python -m hyperqwen.kvarn.bench --prefill --contexts 32768 114688 --chunks 8192 \\
        --out kvarn-prefill.json

`--v-bits 3` times KVarN's tiles of 3-bit values (KVARN_V_BITS=3) instead of 2-bit ones.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

HEADS, KV_HEADS, D, T = 24, 4, 256, 128
SPLITS = (4, 8, 16, 32, 64, 128)
PREFILL_ROWS = (16, 32, 64)
EAGER_REPEATS = 10


def _tables(batch: int, blocks_per_req: int, generator):
    import torch

    order = torch.randperm(batch * blocks_per_req, generator=generator).to(torch.int32)
    return order.reshape(batch, blocks_per_req).cuda()


def _kvarn_copy(context: int, batch: int, queries: int, source, generator, v_bits: int):
    """One layer's KVarN cache of `v_bits`-bit values for `batch` requests of `context`
    tokens: a dict of decode_attention's arguments."""
    import torch

    from hyperqwen.kvarn.layout import TileLayout
    from hyperqwen.kvarn.store import store_tiles

    layout = TileLayout(head_dim=D, v_bits=v_bits)
    blocks = math.ceil(context / T)
    block_table = _tables(batch, blocks, generator)
    pool = torch.empty(
        layout.pool_shape(batch * blocks, KV_HEADS), dtype=torch.uint8, device="cuda"
    )
    full = context // T
    key, value = source
    for req in range(batch):
        if full > 1:
            tiles = [x[T : full * T].view(full - 1, T, KV_HEADS, D) for x in (key, value)]
            store_tiles(*tiles, pool, block_table[req, 1:full], layout)
    side = torch.randn(batch * blocks, T, KV_HEADS, D, device="cuda", dtype=torch.bfloat16)
    return dict(
        pool=pool, block_table=block_table, side_k=side, side_v=side.clone(),
        # every block has a side slot (itself): the reads name only the sink and filling ones
        slot_of_block=torch.arange(batch * blocks, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.arange(0, batch * queries + 1, queries, dtype=torch.int32,
                                     device="cuda"),
        max_query_len=queries, layout=layout,
    )  # fmt: skip


def _fa_copy(context: int, batch: int, queries: int, dtype, generator):
    import torch

    blocks = math.ceil(context / T)
    cache = torch.randn(2, batch * blocks, T, KV_HEADS, D, device="cuda", dtype=torch.bfloat16)
    return dict(
        k=cache[0].to(dtype), v=cache[1].to(dtype), block_table=_tables(batch, blocks, generator),
        seqused_k=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        cu_seqlens_q=torch.arange(0, batch * queries + 1, queries, dtype=torch.int32,
                                  device="cuda"),
        max_seqlen_q=queries, max_seqlen_k=context,
    )  # fmt: skip


def _fa_launch(copy: dict, query, fp8: bool):
    import torch
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    version = 3 if torch.cuda.get_device_capability()[0] == 9 else 2
    scales = {}
    if fp8:
        ones = torch.ones(copy["seqused_k"].shape[0], KV_HEADS, device="cuda")
        scales = dict(q_descale=ones, k_descale=ones, v_descale=ones)
        query = query.to(copy["k"].dtype)
    out = torch.empty(query.shape, dtype=torch.bfloat16, device="cuda")
    return lambda: flash_attn_varlen_func(
        query, copy["k"], copy["v"], copy["max_seqlen_q"], copy["cu_seqlens_q"],
        copy["max_seqlen_k"], seqused_k=copy["seqused_k"], block_table=copy["block_table"],
        causal=True, out=out, fa_version=version, **scales,
    )  # fmt: skip


def _copies(bytes_per_copy: int) -> int:
    from hyperqwen.bench.timing import L2_ROTATION_BYTES

    return max(1, math.ceil(L2_ROTATION_BYTES / bytes_per_copy))


def stages_key(stages: int, splits: int, served: int) -> str:
    """A decode time's key under "kvarn": the split count, after "stagesN/" where the pipeline
    is not the one served on this GPU (decode.served_stages)."""
    return str(splits) if stages == served else f"stages{stages}/{splits}"


def measure(context: int, batch: int, queries: int, splits: tuple[int, ...],
            stages: tuple[int, ...] | None, log, v_bits: int = 2) -> dict:  # fmt: skip
    """Times in µs of one layer's decode attention: {"kvarn": {stages_key: us}, "fa_bf16": us,
    "fa_fp8": us} (a failure's message instead of a time), and the bytes each cache reads.
    stages: the partition kernel's pipelines to sweep, the served one if None."""
    import torch

    from hyperqwen.bench.timing import graph_time_us
    from hyperqwen.kvarn.decode import decode_attention, partition_rows, served_stages
    from hyperqwen.kvarn.layout import TileLayout, bytes_per_token

    rows = partition_rows(queries, HEADS // KV_HEADS)
    served = served_stages(torch.device("cuda"), rows, D)
    g = torch.Generator().manual_seed(context + batch)
    query = torch.randn(batch * queries, HEADS, D, device="cuda", dtype=torch.bfloat16)
    source = tuple(
        torch.randn(context, KV_HEADS, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)
    )
    layout = TileLayout(head_dim=D, v_bits=v_bits)
    kvarn_bytes = int(batch * KV_HEADS * bytes_per_token(layout, context) * context)
    entry = {"kvarn": {}, "bytes": {"kvarn": kvarn_bytes}}
    copies = [
        _kvarn_copy(context, batch, queries, source, g, v_bits) for _ in range(_copies(kvarn_bytes))
    ]
    del source
    for pipeline in stages or (served,):
        for n in splits:
            launches = [
                lambda c=c, n=n, s=pipeline: decode_attention(query, **c, num_splits=n,
                                                              num_stages=s)
                for c in copies
            ]  # fmt: skip
            key = stages_key(pipeline, n, served)
            entry["kvarn"][key] = round(graph_time_us(launches), 2)
            log(f"  kvarn {key}: {entry['kvarn'][key]} us")
    del copies
    for name, dtype in (("fa_bf16", torch.bfloat16), ("fa_fp8", torch.float8_e4m3fn)):
        nbytes = batch * context * KV_HEADS * D * 2 * dtype.itemsize
        entry["bytes"][name] = nbytes
        try:
            fa = [_fa_copy(context, batch, queries, dtype, g) for _ in range(_copies(nbytes))]
            entry[name] = round(graph_time_us([_fa_launch(c, query, dtype != torch.bfloat16)
                                               for c in fa]), 2)  # fmt: skip
        except Exception as failed:  # a missing baseline is recorded, not fatal
            entry[name] = f"{type(failed).__name__}: {str(failed)[:300]}"
        log(f"  {name}: {entry[name]}")
        torch.cuda.empty_cache()
    return entry


def eager_time_us(launch, repeats: int = EAGER_REPEATS) -> float:
    """Median of `repeats` eager calls of launch, each timed with CUDA events, after one
    warm-up call (compilation)."""
    import statistics

    import torch

    launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def measure_prefill(context: int, chunk: int, rows: tuple[int, ...], log, v_bits: int = 2) -> dict:
    """Times in µs of one layer's prefill attention of a `chunk`-token chunk after `context`
    tokens: {"kvarn": {rows: us, "dequantized": us}, "fa_bf16": us, "fa_fp8": us} (a failure's
    message instead of a time)."""
    import torch

    from hyperqwen.kvarn.prefill import prefill_attention
    from hyperqwen.kvarn.prefill_dequant import plan_prefill, prefill_by_dequantization

    total = context + chunk
    g = torch.Generator().manual_seed(total)
    query = torch.randn(chunk, HEADS, D, device="cuda", dtype=torch.bfloat16)
    source = tuple(
        torch.randn(total, KV_HEADS, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)
    )
    kvarn = _kvarn_copy(total, 1, chunk, source, g, v_bits)
    del source, kvarn["max_query_len"]
    kvarn["host_query_start_loc"] = kvarn["query_start_loc"].cpu()
    kvarn["host_seq_lens"] = kvarn["seq_lens"].cpu()
    entry = {"kvarn": {}}
    for n in rows:
        launch = lambda n=n: prefill_attention(query, **kvarn, rows=n)  # noqa: E731
        entry["kvarn"][str(n)] = round(eager_time_us(launch), 2)
        log(f"  kvarn rows {n}: {entry['kvarn'][str(n)]} us")
    # the path served where vLLM has FlashAttention (prefill_dequant.py); its plan is made
    # once per step for all layers (the backend's first layer), so one layer's time is without it
    host = (kvarn["slot_of_block"].cpu(), kvarn["block_table"].cpu(),
            kvarn["host_query_start_loc"].tolist(), kvarn["host_seq_lens"].tolist())  # fmt: skip
    plan = plan_prefill(*host, range(1), T, "cuda")
    out = torch.empty_like(query)
    entry["kvarn"]["dequantized"] = round(eager_time_us(lambda: prefill_by_dequantization(
        query, kvarn["pool"], kvarn["side_k"], kvarn["side_v"], plan, out, kvarn["layout"],
    )), 2)  # fmt: skip
    log(f"  kvarn dequantized: {entry['kvarn']['dequantized']} us")
    for name, dtype in (("fa_bf16", torch.bfloat16), ("fa_fp8", torch.float8_e4m3fn)):
        try:
            fa = _fa_copy(total, 1, chunk, dtype, g)
            entry[name] = round(eager_time_us(_fa_launch(fa, query, dtype != torch.bfloat16)), 2)
        except Exception as failed:  # a missing baseline is recorded, not fatal
            entry[name] = f"{type(failed).__name__}: {str(failed)[:300]}"
        log(f"  {name}: {entry[name]}")
        torch.cuda.empty_cache()
    return entry


def result(raw: dict, command: str, commit: str) -> dict:
    from hyperqwen.bench.results import RESULT_SCHEMA, comparison_row

    rows = []
    for case in raw["cases"]:
        best = min(case["kvarn"].values())
        fp8 = case["fa_fp8"] if isinstance(case["fa_fp8"], float) else None
        if "chunk" in case:
            name = f"kvarn_prefill_c{case['context']}_chunk{case['chunk']}"
        else:
            name = f"kvarn_decode_c{case['context']}_b{case['batch']}_q{case['queries']}"
        rows.append(asdict(comparison_row(name, "ms", fp8 and fp8 / 1000, best / 1000)))
    return {
        "schema": RESULT_SCHEMA, "gpu": raw["gpu"], "vllm": raw["vllm"], "commit": commit,
        "date": raw["date"], "command": command,
        "model": "27B full-attention layer geometry (24/4 heads, head_dim 256), random K/V",
        "rows": rows,
        "notes": [
            "One layer's decode attention (rows kvarn_decode_*) or prefill attention of one "
            "chunk (kvarn_prefill_*), ms per launch, lower is better. stock = vLLM's "
            "FlashAttention (FA3 on sm90) over a paged fp8 e4m3 cache with unit scales; "
            f"patched = KVarN with {raw['v_bits']}-bit values (src/hyperqwen/kvarn/decode.py; "
            "prefill.py, prefill_dequant.py) at its fastest split count (and pipeline, where "
            "swept) or prefill path; raw holds every one, FA over bf16 and the bytes each "
            "decode cache holds.",
            "Decode: median of 15 CUDA-graph replays timed with CUDA events, one launch per "
            "layer copy, copies together past 256 MiB (hyperqwen/bench/timing.py). Prefill: "
            f"median of {EAGER_REPEATS} eager launches timed with CUDA events, one copy.",
        ],
        "raw": raw,
    }  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hyperqwen.kvarn.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 114688])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument(
        "--queries", type=int, nargs="+", default=[1, 4],
        help="query tokens per request: 1 decode, 1 + k an MTP verify block",
    )  # fmt: skip
    parser.add_argument("--splits", type=int, nargs="+", default=list(SPLITS))
    parser.add_argument(
        "--stages", type=int, nargs="+", choices=(1, 2),
        help="decode: the partition kernel's pipeline stages to sweep (default: the one served "
        "on this GPU, decode.served_stages; 2 needs sm80's or sm90's shared memory)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill", action="store_true",
        help="time the prefill of a chunk of --chunks tokens after each context instead",
    )  # fmt: skip
    parser.add_argument("--chunks", type=int, nargs="+", default=[8192])
    parser.add_argument("--rows", type=int, nargs="+", default=list(PREFILL_ROWS),
                        help="prefill: query rows per program")  # fmt: skip
    parser.add_argument("--v-bits", type=int, choices=(2, 3), default=2,
                        help="bits per value in KVarN's tiles (layout.py)")  # fmt: skip
    parser.add_argument("--out", help="default kvarn-decode.json (kvarn-prefill.json)")
    parser.add_argument("--commit", help="the checkout's commit (default: git describe)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import torch

    from hyperqwen.bench.header import git_commit
    from hyperqwen.bench.timing import gpu_label

    if not torch.cuda.is_available():
        print("kvarn bench: needs a CUDA GPU", file=sys.stderr)
        return 3
    try:
        import vllm

        vllm_version = f"vLLM {vllm.__version__}: its FlashAttention called directly"
    except ImportError as missing:
        vllm_version = f"vLLM not importable ({missing}): no FlashAttention baseline"
    raw = {"gpu": gpu_label(), "vllm": vllm_version, "v_bits": args.v_bits,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cases": []}  # fmt: skip
    command = shlex.join(["python", "-m", "hyperqwen.kvarn.bench", *sys.argv[1:]])
    out = Path(args.out or ("kvarn-prefill.json" if args.prefill else "kvarn-decode.json"))
    if args.prefill:
        cases = [
            (f"context {context}, chunk {chunk}:", {"context": context, "chunk": chunk},
             lambda context=context, chunk=chunk: measure_prefill(
                 context, chunk, tuple(args.rows), print, args.v_bits))
            for context in args.contexts for chunk in args.chunks
        ]  # fmt: skip
    else:
        stages = tuple(args.stages) if args.stages else None
        cases = [
            (f"context {context}, batch {batch}, {queries} queries:",
             {"context": context, "batch": batch, "queries": queries},
             lambda context=context, batch=batch, queries=queries: measure(
                 context, batch, queries, tuple(args.splits), stages, print, args.v_bits))
            for context in args.contexts for batch in args.batch for queries in args.queries
        ]  # fmt: skip
    for title, shape, run in cases:
        print(title, flush=True)
        raw["cases"].append({**shape, **run()})
        document = result(raw, command, args.commit or git_commit())
        out.write_text(json.dumps(document, indent=1) + "\n")  # a kill keeps the rest
    print(f"kvarn bench: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
