"""`hyperqwen bench pdl`: HyperQwen's decode-step kernels in a chain of Gated DeltaNet layers
(bench/pdl_chain.py), one CUDA graph of all layers replayed with and without programmatic
dependent launch (PDL, src/hyperqwen/kernels/pdl.py), at T = 1 and 4 tokens.

Writes one result file in `bench ab`'s row schema: `pdl_chain_t<T>` in us per layer (stock =
PDL off, patched = on); the raw medians under "raw".
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from hyperqwen.bench.timing import add_timing_parser, graph_time_us, kernel_run
from hyperqwen.checkpoint.geometry import PRESETS

TOKENS = (1, 4)  # a decode step and an MTP k=3 verify step of one sequence


def measure(geometry, layers: int, tokens: int, replays: int) -> dict[str, float]:
    """us per layer of one replay of the whole chain, PDL off and on."""
    from hyperqwen.bench.pdl_chain import Chain, make_weights, random_step

    weights = make_weights(geometry, layers)
    timed = {}
    for pdl in (False, True):
        chain = Chain(geometry, weights, tokens, pdl)
        chain.load(*random_step(geometry, layers, tokens, seed=0))
        timed["on" if pdl else "off"] = graph_time_us([chain.run], replays) / layers
    return timed


def cmd_pdl(args: argparse.Namespace) -> int:
    import torch

    from hyperqwen.bench.results import comparison_row

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("bench pdl: needs a CUDA GPU of sm90 or newer (PDL is Hopper's)", file=sys.stderr)
        return 3
    run = kernel_run(
        "pdl", args, "HyperQwen's kernels called directly (no server)",
        f"{args.preset} geometry GDN layers, random weights, fp32 state",
        ["stock = the chain without PDL, patched = with it (src/hyperqwen/bench/pdl.py: "
         "w4a16, split_qkv, ba_proj, gdn_recurrent, w4a16, a torch add, per layer). Each "
         "time is the median of the replays of one CUDA graph of every layer, per layer."],
    )  # fmt: skip
    if run is None:
        return 3
    raw, document = run
    geometry = PRESETS[args.preset]
    raw |= {"layers": args.layers, "replays": args.replays, "us_per_layer": {}}
    rows = []
    for tokens in TOKENS:
        timed = measure(geometry, args.layers, tokens, args.replays)
        raw["us_per_layer"][f"t{tokens}"] = timed
        off, on = round(timed["off"], 2), round(timed["on"], 2)
        rows.append(asdict(comparison_row(f"pdl_chain_t{tokens}", "us", off, on)))
        print(f"bench pdl: T={tokens}: {off} us per layer without PDL, {on} with", flush=True)
    document |= {"rows": rows, "raw": raw}
    out = Path(args.out)
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"bench pdl: wrote {out} (publish: hyperqwen bench publish {out} --name NAME)")
    return 0


def add_subcommand(actions) -> None:
    parser = add_timing_parser(
        actions,
        "pdl",
        "time HyperQwen's decode-step kernel chain with and without PDL (GPU, sm90+)",
        __doc__,
        "pdl-result.json",
    )
    parser.add_argument("--layers", type=int, default=16, help="GDN layers (default %(default)s)")
    parser.add_argument("--replays", type=int, default=50, help="timed replays (default 50)")
    parser.set_defaults(func=cmd_pdl)
