"""`hyperqwen bench draft-head`: a greedy MTP draft from the draft head, vLLM's way against the
fused int8 kernel (src/hyperqwen/kernels/draft_argmax.py).

For the geometry's hidden size and the default draft vocabulary (40,960 rows), at each batch of
hidden rows a draft pass scores (1, 2, 4, 8, 16), times what vLLM's proposer runs with the draft
vocabulary (LocalArgmaxMixin.get_top_tokens over the bf16 rows: the GEMM, the max and the id
remap) and the fused kernel over the same rows stored int8:
- graph: each replayed from a CUDA graph (two copies of the head, so no replay finds the rows
  in L2), the GPU's time;
- eager: launched one after another from Python and synchronized at the end, as the proposer
  launches them outside its graphs: the host's launch cost shows here when it exceeds the GPU's.
The fused ids are checked against float64 first (a batch where one is not the best row to fp32
rounding stops the run); how often they equal the bf16 path's (which rounds each logit to bf16
before its max) is recorded.

Writes one result file in `bench ab`'s row schema: per batch, `draft_head_b<B>` and
`draft_head_eager_b<B>` in us (stock = vLLM's path, patched = the kernel), the same two for
the int8 rows through vLLM's Marlin GEMM and the same max and remap (`draft_head_marlin_b<B>`,
`draft_head_marlin_eager_b<B>`: the other way to read int8 rows, as an int8 lm_head is served),
and `draft_head_moved_b<B>` in GB/s (the rows' bytes over the graph time); timings under "raw".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from hyperqwen.bench.timing import add_timing_parser, copy_row, graph_time_us, kernel_run
from hyperqwen.checkpoint.geometry import PRESETS

BATCHES = (1, 2, 4, 8, 16)
EAGER_CALLS = 200
COPIES = 2  # each copy of the bf16 head is 419 MB for the 27B, far beyond L2


def make_heads(rows: int, hidden: int, copies: int = COPIES, device: str = "cuda"):
    """`copies` random int8 heads (codes, scales, sorted ids) and the bf16 rows they dequantize
    to, as the draft vocabulary loads them."""
    import torch

    from hyperqwen.kernels.draft_argmax import GROUP

    generator = torch.Generator(device=device).manual_seed(rows)
    token_ids = torch.sort(torch.randperm(3 * rows, generator=generator, device=device)[:rows])[0]
    heads = []
    for _ in range(copies):
        codes = torch.randint(
            -128, 128, (rows, hidden), generator=generator, device=device, dtype=torch.int8
        )
        scales = torch.rand((rows, hidden // GROUP), generator=generator, device=device) * 1e-3
        scales = scales.to(torch.bfloat16)
        bf16 = (codes.float() * scales.float().repeat_interleave(GROUP, dim=1)).to(torch.bfloat16)
        heads.append((codes, scales, bf16))
    return token_ids, heads


def vllm_path(bf16, offsets):
    """LocalArgmaxMixin.get_top_tokens with the draft vocabulary, at one tensor-parallel rank."""
    import torch

    def top_tokens(hidden):
        top = torch.nn.functional.linear(hidden, bf16).max(dim=-1).indices
        return top + offsets[top]

    return top_tokens


def marlin_paths(heads, token_ids) -> list:
    """The same int8 rows through vLLM's Marlin (as a prepared int8 lm_head is served: weights
    uint8b128 in groups of 128), then the max and the id remap: the other way to read int8."""
    from compressed_tensors.compressors.pack_quantized.base import pack_to_int32

    from hyperqwen.bench.kernels import init_vllm_single_rank, vllm_layers
    from hyperqwen.engine.draft_vocab import target_offsets

    init_vllm_single_rank()
    offsets = target_offsets(token_ids)
    rows, hidden = heads[0][0].shape
    weights = SimpleNamespace(
        n=rows,
        k=hidden,
        bits=8,
        packed=[pack_to_int32(codes, 8) for codes, _, _ in heads],
        scales=[scales for _, scales, _ in heads],
    )
    built, reason = vllm_layers("marlin", weights)
    if built is None:
        raise RuntimeError(f"Marlin cannot serve the draft head: {reason}")

    def path(kernel, layer):
        def top_tokens(hidden_states):
            top = kernel.apply_weights(layer, hidden_states).max(dim=-1).indices
            return top + offsets[top]

        return top_tokens

    return [path(kernel, layer) for kernel, layer in built]


def eager_us(call, hidden, calls: int = EAGER_CALLS) -> float:
    """Wall time per call of `calls` back-to-back eager calls, synchronized once at the end."""
    import torch

    call(hidden)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call(hidden)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / calls


def measure_batch(
    token_ids, heads, batch: int, log, timer=graph_time_us, eager=eager_us, device="cuda",
    marlin=None,
) -> dict:  # fmt: skip
    """The paths checked, then timed: `timer` takes a list of launches and returns us per
    launch (graph_time_us), `eager` a call and its input (eager_us); `marlin`: marlin_paths'
    calls, one per copy of the head, or None to leave that path out."""
    import torch

    from hyperqwen.engine.draft_vocab import target_offsets
    from hyperqwen.kernels.draft_argmax import Int8DraftHead

    hidden_size = heads[0][0].shape[1]
    offsets = target_offsets(token_ids)
    hidden = torch.randn((batch, hidden_size), device=device).to(torch.bfloat16)
    fused = [Int8DraftHead(codes, scales, token_ids).top_tokens for codes, scales, _ in heads]
    stock = [vllm_path(bf16, offsets) for _, _, bf16 in heads]
    ids = fused[0](hidden)[0]
    codes, scales, _ = heads[0]
    # the rows the kernel scores, exactly (the bf16 path's are these rounded to bf16)
    exact = codes.double() * scales.double().repeat_interleave(codes.shape[1] // scales.shape[1], 1)
    reference = hidden.double() @ exact.T
    del exact
    chosen = reference.gather(1, torch.searchsorted(token_ids, ids)[:, None]).squeeze(1)
    worst_gap = (reference.max(dim=1).values - chosen).max().item()
    if worst_gap > 1e-4 * reference.abs().max().item():
        raise RuntimeError(f"B={batch}: a fused draft is {worst_gap:.3g} below the best logit")
    stock_ids = stock[0](hidden)
    agree = (ids == stock_ids).float().mean().item()
    entry = {
        "batch": batch,
        "worst_gap_to_float64_best": worst_gap,
        "agree_with_vllm_path": agree,
        "vllm_us": timer([lambda s=s: s(hidden) for s in stock]),
        "fused_us": timer([lambda f=f: f(hidden)[0] for f in fused]),
        "vllm_eager_us": statistics.median(eager(stock[0], hidden) for _ in range(5)),
        "fused_eager_us": statistics.median(
            eager(lambda h: fused[0](h)[0], hidden) for _ in range(5)
        ),
        "fused_bytes": codes.numel() + scales.numel() * scales.element_size(),
    }
    if marlin:
        # Marlin rounds each logit to bf16, as vLLM's bf16 path does: ties may differ
        agreed = marlin[0](hidden) == stock_ids
        entry["marlin_agree_with_vllm_path"] = agreed.float().mean().item()
        entry["marlin_us"] = timer([lambda m=m: m(hidden) for m in marlin])
        entry["marlin_eager_us"] = statistics.median(eager(marlin[0], hidden) for _ in range(5))
        eager_marlin = entry["marlin_eager_us"]
        log(f"B={batch}: Marlin int8 {entry['marlin_us']:.1f} us (eager {eager_marlin:.1f})")
    log(
        f"B={batch}: vLLM {entry['vllm_us']:.1f} us (eager {entry['vllm_eager_us']:.1f}), fused "
        f"{entry['fused_us']:.1f} us (eager {entry['fused_eager_us']:.1f}); agree {agree:.2f}"
    )
    return entry


def result_rows(raw: dict) -> list[dict]:
    from hyperqwen.bench.results import comparison_row

    rows = []
    for entry in raw["batches"]:
        b = entry["batch"]
        rows.append(comparison_row(f"draft_head_b{b}", "us", entry["vllm_us"], entry["fused_us"]))
        rows.append(
            comparison_row(
                f"draft_head_eager_b{b}", "us", entry["vllm_eager_us"], entry["fused_eager_us"]
            )
        )
        if "marlin_us" in entry:
            for suffix, key in (("", "us"), ("_eager", "eager_us")):
                rows.append(
                    comparison_row(
                        f"draft_head_marlin{suffix}_b{b}", "us", entry[f"vllm_{key}"],
                        entry[f"marlin_{key}"],
                    )
                )  # fmt: skip
        bf16_bytes = 2 * raw["rows"] * raw["hidden"]

        def gbps(nbytes: int, us: float) -> float:
            return round(nbytes / (us * 1e-6) / 1e9, 1)

        rows.append(
            comparison_row(
                f"draft_head_moved_b{b}",
                "GB/s",
                gbps(bf16_bytes, entry["vllm_us"]),
                gbps(entry["fused_bytes"], entry["fused_us"]),
            )
        )
    rows.append(copy_row(raw))
    return [asdict(row) for row in rows]


def cmd_draft_head(args: argparse.Namespace) -> int:
    from hyperqwen.drafter.vocab import DEFAULT_DRAFT_SIZE

    run = kernel_run(
        "draft-head",
        args,
        "LocalArgmaxMixin's ops called directly (no server)",
        f"{args.preset} geometry draft head ({DEFAULT_DRAFT_SIZE} rows), random rows",
        [
            "stock = what vLLM's MTP proposer runs for a greedy draft with the draft vocabulary "
            "(bf16 GEMM, max, id remap); patched = src/hyperqwen/kernels/draft_argmax.py over "
            "the same rows stored int8 (DRAFT_HEAD_INT8=1); draft_head_marlin_* rows: patched = "
            "those int8 rows through vLLM's Marlin, then the same max and remap. Graph rows: "
            f"median of 15 replays of a CUDA graph over {COPIES} copies of the head; eager rows: "
            f"{EAGER_CALLS} eager calls synchronized once, median of 5, so the host's launch cost "
            "counts.",
        ],
    )
    if run is None:
        return 3

    raw, document = run
    raw |= {"rows": DEFAULT_DRAFT_SIZE, "hidden": PRESETS[args.preset].hidden_size, "batches": []}
    token_ids, heads = make_heads(raw["rows"], raw["hidden"])
    marlin = marlin_paths(heads, token_ids)
    out = Path(args.out)
    for batch in BATCHES:
        raw["batches"].append(measure_batch(token_ids, heads, batch, print, marlin=marlin))
        document.update(rows=result_rows(raw), raw=raw)
        out.write_text(json.dumps(document, indent=1) + "\n")  # after each batch: a kill keeps some
    print(f"bench draft-head: wrote {out} (publish: hyperqwen bench publish {out} --name NAME)")
    return 0


def add_subcommand(actions) -> None:
    parser = add_timing_parser(
        actions,
        "draft-head",
        "time a greedy MTP draft from the draft head, vLLM's path against the int8 kernel (GPU)",
        __doc__,
        "draft-head-result.json",
    )
    parser.set_defaults(func=cmd_draft_head)
