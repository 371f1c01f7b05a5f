"""`hyperqwen bench gdn`: the GDN recurrent update of decode and verify steps, vLLM's kernel
against HyperQwen's (src/hyperqwen/kernels/gdn_recurrent.py).

For the geometry's Gated DeltaNet heads and each case (sequences x tokens per sequence: MTP
verify blocks of 1 + 3 tokens at C1/C2/C4, a 16-token lookup block, decode at C1 and C64), times
vLLM 0.26's fused_sigmoid_gating_delta_rule_update and ours over a sweep of launch configs, each
replayed from a CUDA graph over state slots larger than L2 (each launch updates other slots, as
48 layers do), with the fp32 state the single profile keeps. Every config of ours is checked
against vLLM's output and state first; one that disagrees is left out.

Writes one result file in `bench ab`'s row schema: per case, `gdn_<case>` in us (stock = vLLM's
kernel, patched = our fastest config) and `gdn_<case>_moved` in GB/s (state read once and written
after every token, over the time); every timing and config under "raw".
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path

from hyperqwen.bench.timing import (
    L2_ROTATION_BYTES,
    add_timing_parser,
    copy_row,
    graph_time_us,
    kernel_run,
)
from hyperqwen.checkpoint.geometry import PRESETS

# (name, sequences, tokens per sequence): what the serving path serves first (verify steps of one
# or two sequences, `served_label`), so a run cut short still has them
CASES = (
    ("verify_n1_t4", 1, 4),
    ("verify_n2_t4", 2, 4),
    ("verify_n1_t16", 1, 16),
    ("verify_n4_t4", 4, 4),
    ("decode_n1", 1, 1),
    ("decode_n64", 64, 1),
)
BLOCKS = (8, 16, 32)
WARPS = (1, 2, 4)


def state_bytes(v_heads: int, dim: int, tokens: int) -> int:
    """fp32 state bytes a sequence moves: read once, written after each token."""
    return v_heads * dim * dim * 4 * (1 + tokens)


def make_case(geometry, sequences: int, tokens: int, device: str = "cuda"):
    """Inputs for `copies` launches of one case, each on its own state slots."""
    import torch

    heads, v_heads = geometry.linear_num_key_heads, geometry.linear_num_value_heads
    dim = geometry.linear_key_head_dim
    per_launch = sequences * tokens * v_heads * dim * dim * 4
    copies = max(2, math.ceil(L2_ROTATION_BYTES / per_launch))
    total = sequences * tokens
    generator = torch.Generator(device=device).manual_seed(sequences * 31 + tokens)

    def rand(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)

    inputs = {
        "A_log": rand(v_heads, scale=0.5, dtype=torch.float32),
        "a": rand(total, v_heads),
        "b": rand(total, v_heads),
        "dt_bias": rand(v_heads, scale=0.5, dtype=torch.float32),
        "q": rand(1, total, heads, dim),
        "k": rand(1, total, heads, dim),
        "v": rand(1, total, v_heads, dim),
        "cu_seqlens": torch.arange(0, total + 1, tokens, dtype=torch.int32, device=device),
    }
    state = rand(1 + copies * total, v_heads, dim, dim, scale=0.3, dtype=torch.float32)
    slots = torch.arange(1, 1 + copies * total, dtype=torch.int32, device=device)
    if tokens > 1:
        indices = slots.reshape(copies, sequences, tokens)
        accepted = torch.full((sequences,), tokens, dtype=torch.int32, device=device)
    else:
        indices = slots.reshape(copies, sequences)
        accepted = None
    return inputs, state, indices, accepted, copies


def vllms_update():
    from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
        fused_sigmoid_gating_delta_rule_update,
    )

    return fused_sigmoid_gating_delta_rule_update


def vllm_launch(inputs, state, indices, accepted, update=None):
    update = update or vllms_update()

    def launch():
        return update(
            **inputs, initial_state=state, inplace_final_state=True, ssm_state_indices=indices,
            num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=True,
        )[0]  # fmt: skip

    return launch


def our_launch(inputs, state, indices, accepted, config):
    from hyperqwen.kernels.gdn_recurrent import gdn_recurrent_update

    def launch():
        return gdn_recurrent_update(
            **inputs, state=state, state_indices=indices, num_accepted_tokens=accepted, **config
        )

    return launch


def configs_for(tokens: int) -> list[dict]:
    passes = sorted({min(tokens, 4), 1 << (tokens - 1).bit_length()})
    return [
        {"block_v": block, "num_warps": warps, "tokens_per_pass": per_pass}
        for block in BLOCKS
        for warps in WARPS
        for per_pass in passes
    ]


def measure_case(
    geometry, name: str, sequences: int, tokens: int, log, timer=graph_time_us, device="cuda",
    vllms=None,
) -> dict:  # fmt: skip
    """vLLM's time and each correct config's; `timer` runs a list of launches and returns us per
    launch (graph_time_us; its replays update the state slots in place, as the layer does)."""
    import torch

    inputs, state, indices, accepted, copies = make_case(geometry, sequences, tokens, device)
    # the timed launches update `state` in place: every check starts from this copy
    pristine = state.clone()
    check = pristine.clone()
    want = vllm_launch(inputs, check, indices[0], accepted, vllms)()
    want_state = check[1 : 1 + sequences * tokens]
    entry = {"sequences": sequences, "tokens": tokens, "copies": copies, "ours": {}}
    entry["vllm_us"] = timer(
        [vllm_launch(inputs, state, indices[c], accepted, vllms) for c in range(copies)]
    )
    for config in configs_for(tokens):
        label = config_label(config)
        trial = pristine.clone()
        got = our_launch(inputs, trial, indices[0], accepted, config)()
        out_error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        state_error = (trial[1 : 1 + sequences * tokens] - want_state).abs().max().item()
        if not (out_error < 1e-2 and state_error < 1e-3):
            entry["ours"][label] = {"error": f"out {out_error:.2e}, state {state_error:.2e}"}
            continue
        launches = [our_launch(inputs, state, indices[c], accepted, config) for c in range(copies)]
        entry["ours"][label] = {"us": timer(launches), "out_error": out_error}
        del trial
    timed = {k: v["us"] for k, v in entry["ours"].items() if "us" in v}
    best = min(timed, key=timed.get) if timed else None
    log(f"{name}: vllm {entry['vllm_us']:.1f} us, ours {timed.get(best, math.nan):.1f} us ({best})")
    if device == "cuda":
        torch.cuda.empty_cache()
    return entry


def config_label(config: dict) -> str:
    return "b{block_v}_w{num_warps}_p{tokens_per_pass}".format(**config)


def served_label(sequences: int, tokens: int, v_heads: int, dim: int) -> str:
    """The config label of what the serving path (engine/gdn_recurrent.py) launches."""
    from hyperqwen.engine.gdn_recurrent import tokens_per_pass
    from hyperqwen.kernels.gdn_recurrent import DEFAULT_WARPS, default_block_v

    served = {
        "block_v": default_block_v(sequences, v_heads, dim),
        "num_warps": DEFAULT_WARPS,
        "tokens_per_pass": tokens_per_pass(sequences * tokens, sequences),
    }
    return config_label(served)


def result_rows(raw: dict) -> list[dict]:
    from hyperqwen.bench.results import comparison_row

    rows = []
    v_heads, dim = raw["v_heads"], raw["head_dim"]
    for name, entry in raw["cases"].items():
        timed = [v["us"] for v in entry["ours"].values() if "us" in v]
        ours = round(min(timed), 2) if timed else None
        stock = round(entry["vllm_us"], 2)
        rows.append(comparison_row(f"gdn_{name}", "us", stock, ours))
        moved = entry["sequences"] * state_bytes(v_heads, dim, entry["tokens"])

        def gbps(us, moved=moved):
            return None if us is None else round(moved / (us * 1e-6) / 1e9, 1)

        rows.append(comparison_row(f"gdn_{name}_moved", "GB/s", gbps(stock), gbps(ours)))
        served = entry["ours"].get(served_label(entry["sequences"], entry["tokens"], v_heads, dim))
        if served and "us" in served:  # what the serving path runs for this batch
            rows.append(comparison_row(f"gdn_{name}_served", "us", stock, round(served["us"], 2)))
    rows.append(copy_row(raw))
    return [asdict(row) for row in rows]


def cmd_gdn(args: argparse.Namespace) -> int:
    geometry = PRESETS[args.preset]
    run = kernel_run(
        "gdn",
        args,
        "its recurrent kernel called directly (no server)",
        f"{args.preset} geometry Gated DeltaNet heads, fp32 state, random inputs",
        [
            "stock = vLLM 0.26's recurrent kernel (32 state rows and 4 warps per program); "
            "patched = src/hyperqwen/kernels/gdn_recurrent.py at its fastest swept config "
            "(raw has them all). Each time is the median of 15 replays of a CUDA graph over "
            "state slots larger than L2, divided by the launches. GB/s counts the fp32 state "
            "read once and written after each token.",
        ],
    )
    if run is None:
        return 3
    raw, document = run
    raw |= {
        "v_heads": geometry.linear_num_value_heads,
        "head_dim": geometry.linear_value_head_dim,
        "cases": {},
    }
    out = Path(args.out)
    for name, sequences, tokens in CASES:
        raw["cases"][name] = measure_case(geometry, name, sequences, tokens, print)
        document.update(rows=result_rows(raw), raw=raw)
        out.write_text(json.dumps(document, indent=1) + "\n")  # after each case: a kill keeps some
    print(f"bench gdn: wrote {out} (publish: hyperqwen bench publish {out} --name NAME)")
    return 0


def add_subcommand(actions) -> None:
    gdn = add_timing_parser(
        actions,
        "gdn",
        "time the GDN recurrent update of decode and verify steps (GPU)",
        __doc__,
        "gdn-result.json",
    )
    gdn.set_defaults(func=cmd_gdn)
