"""`hyperqwen bench kernels`: W4A16 GEMMs of a model's layer shapes, vLLM's kernels against ours.

For every quantized linear shape of the geometry and every M, times vLLM 0.26's W4A16 kernels
(machete, marlin, exllama, triton: built through their own MPLinearKernel classes from the
checkpoint layout, as vLLM builds a layer) and HyperQwen's skinny kernel over a sweep of tile
configs, each launch replayed from a CUDA graph over rotating weight copies larger than L2, so the
time is HBM time. Achieved bandwidth = (int4 weights + scales + activations + output bytes) /
time, against a device-to-device copy measured in the same process. Every config of ours is checked
against a float32 reference before it is timed; a config that disagrees is left out.

Writes one result file in `bench ab`'s row schema (stock = Machete, vLLM's default W4A16 kernel
on sm90; patched = the candidate named in the row), with every raw timing under "raw";
`hyperqwen bench publish` takes it into docs/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hyperqwen.bench.timing import (
    L2_ROTATION_BYTES,
    add_timing_parser,
    copy_bandwidth_gbps,
    copy_row,
    gpu_label,
    gpu_name,
    graph_time_us,
)
from hyperqwen.checkpoint.geometry import PRESETS, Geometry
from hyperqwen.checkpoint.w4a16_sizes import GROUP_SIZE

DEFAULT_MS = (1, 2, 4, 5, 8, 16, 32, 64)
VLLM_BACKENDS = ("machete", "marlin", "exllama", "triton")
# humming JIT-compiles its GEMMs with nvcc on first use (not timed yet): asked for by name only;
# hyperqwen_layer is our kernel as LINEAR_BACKEND=hyperqwen serves it (the engine feature on
# vLLM's linear_kernels seam: its own launch shapes, through the custom op), against the
# sweep's best launch of it
LAYER_BACKEND = "hyperqwen_layer"
# INT8_ACT's 8-bit-activation kernels (engine/w4a8_linear.py CANDIDATES, whose names follow the
# prefix), built as the engine builds them: their timings decide ARCH_TABLE's entry per architecture
W4A8_PREFIX = "w4a8_"
W4A8_BACKENDS = ("w4a8_marlin_int8", "w4a8_cutlass_fp8", "w4a8_humming_int8", "w4a8_humming_fp8")
OPTIONAL_BACKENDS = ("humming", LAYER_BACKEND, *W4A8_BACKENDS)


@dataclass(frozen=True)
class LinearShape:
    """One quantized linear of the model: output rows n, inputs k, how many per token."""

    name: str
    n: int
    k: int
    per_token: int
    bits: int = 4  # 4: the W4A16 body; 8: prepare's int8 heads (timed against their bf16 form)


# The W4A16 GEMMs of each decoder layer type, in the order a forward pass launches them.
LAYER_GEMMS = {
    "linear_attention": ("gdn_in_proj_qkvz", "gdn_out_proj", "mlp_gate_up", "mlp_down"),
    "full_attention": ("attn_qkv", "attn_o", "mlp_gate_up", "mlp_down"),
}


def linear_kinds(g: Geometry) -> list[LinearShape]:
    """Every kind of W4A16 linear of a qwen3_5 decoder as vLLM fuses it (one GEMM each), named
    as in LAYER_GEMMS, with how many a token runs."""
    layers = g.layer_types
    gdn = layers.count("linear_attention")
    attn = layers.count("full_attention")
    qkvz = 2 * g.linear_key_dim + 2 * g.linear_value_dim
    attn_qkv = 2 * g.num_attention_heads * g.head_dim + 2 * g.num_key_value_heads * g.head_dim
    return [
        LinearShape("gdn_in_proj_qkvz", qkvz, g.hidden_size, gdn),
        LinearShape("gdn_out_proj", g.hidden_size, g.linear_value_dim, gdn),
        LinearShape("attn_qkv", attn_qkv, g.hidden_size, attn),
        LinearShape("attn_o", g.hidden_size, g.num_attention_heads * g.head_dim, attn),
        LinearShape("mlp_gate_up", 2 * g.intermediate_size, g.hidden_size, len(layers)),
        LinearShape("mlp_down", g.hidden_size, g.intermediate_size, len(layers)),
    ]


def layer_shapes(g: Geometry) -> list[LinearShape]:
    """linear_kinds with kinds of one shape merged: each distinct GEMM shape timed once."""
    merged: dict[tuple[int, int], LinearShape] = {}
    for shape in linear_kinds(g):  # o_proj and out_proj share [hidden, 6144] on the 27B
        key = (shape.n, shape.k)
        if key in merged:
            old = merged[key]
            merged[key] = LinearShape(
                f"{old.name}+{shape.name}", shape.n, shape.k, old.per_token + shape.per_token
            )
        else:
            merged[key] = shape
    return list(merged.values())


def head_shapes(g: Geometry) -> list[LinearShape]:
    """The heads a speculative step reads: the verify lm_head and the draft vocabulary's rows."""
    from hyperqwen.drafter.vocab import DEFAULT_DRAFT_SIZE

    return [
        LinearShape("lm_head", g.vocab_size, g.hidden_size, 1, bits=8),
        LinearShape("draft_head", DEFAULT_DRAFT_SIZE, g.hidden_size, 1, bits=8),
    ]


def moved_bytes(m: int, n: int, k: int, act_bytes: int = 2, bits: int = 4) -> int:
    """The fewest bytes a WnA16 GEMM moves: n-bit weights, group scales, x in, y out."""
    weights = n * k * bits // 8
    return weights + n * (k // GROUP_SIZE) * act_bytes + m * k * act_bytes + m * n * act_bytes


def sweep_configs() -> list:
    """Our candidate tile configs (kernels/README.md): the tiles that came within 3 % of the
    best somewhere on the H200 (2026-12-01, commit 091d556: 64 rows with 4 warps and 3 stages,
    one program per work item or 4 per SM walking them; 128 rows with 8 warps; 4-5 stages, a K
    block of 512 and 2 warps never did)."""
    from hyperqwen.kernels.w4a16 import TileConfig

    configs = []
    for split_k in (1, 2, 4, 8):
        configs.append(TileConfig(64, 256, split_k, num_warps=4))
        configs.append(TileConfig(64, 256, split_k, num_warps=4, programs_per_sm=4))
        configs.append(TileConfig(128, 256, split_k, num_warps=8))
    # prefill's M (beyond 64 rows): wider M tiles, timed only where M fills them (skip_config);
    # 128 x 256 with 128 rows of x would take 224 KB of shared memory on sm90
    configs.append(TileConfig(128, 256, 1, num_warps=8, block_m=64))
    for block_m in (64, 128):
        configs.append(TileConfig(128, 128, 1, num_warps=8, num_stages=4, block_m=block_m))
    return configs


def skip_config(config, m: int, k: int) -> bool:
    """Configs not worth timing at this shape: a K slice shorter than one K block, or an M
    tile asked for that is more than twice the rows there are."""
    if config.split_k > 1 and k // config.split_k < config.block_k:
        return True
    return bool(config.block_m) and config.block_m > 2 * max(m, 16)


class Weights:
    """Random WnA16 weights of one shape in the checkpoint layout, plus their float reference."""

    def __init__(self, n: int, k: int, copies: int, seed: int, bits: int = 4):
        import torch

        from hyperqwen.kernels.w4a16 import pack_codes, tiles_from_checkpoint

        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.n, self.k, self.bits = n, k, bits
        codes = torch.randint(0, 2**bits, (n, k), device="cuda", generator=gen)
        self.packed = [pack_codes(codes, bits)]
        scale = torch.rand((n, k // GROUP_SIZE), device="cuda", generator=gen) * 0.02 + 0.002
        self.scales = [scale.to(torch.bfloat16)]
        bias = 2 ** (bits - 1)  # uint4b8 / uint8b128
        self.dense = (codes.to(torch.float32) - bias) * self.scales[0].float().repeat_interleave(
            GROUP_SIZE, dim=1
        )
        del codes
        for _ in range(copies - 1):  # distinct storage, same values: rotation defeats L2
            self.packed.append(self.packed[0].clone())
            self.scales.append(self.scales[0].clone())
        # the same codes as our kernel reads them (int4 only): pair planes, in tiles
        self.ours = (
            [tiles_from_checkpoint(p, s) for p, s in zip(self.packed, self.scales, strict=True)]
            if bits == 4
            else []
        )


def start_one_rank() -> None:
    """vLLM's distributed state for this process alone (world and tensor-parallel size 1, gloo
    on a free local port), under the vLLM config current now: vLLM's weight parameters ask for
    their tensor-parallel rank. destroy_model_parallel and destroy_distributed_environment end
    it."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from hyperqwen.bench.server_process import free_port

    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        backend="gloo",
    )
    initialize_model_parallel(1, 1)


def init_vllm_single_rank() -> None:
    """A one-rank vLLM world and config for the rest of the process (start_one_rank); a
    second call (another GPU test in the same process) finds it made."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return

    # Kept referenced: a dropped context generator is closed by the collector, which
    # unsets the config again.
    global _VLLM_CONFIG_CONTEXT
    _VLLM_CONFIG_CONTEXT = set_current_vllm_config(VllmConfig())
    _VLLM_CONFIG_CONTEXT.__enter__()  # never left: the process ends first
    start_one_rank()


def w4a16_layer_config(n: int, k: int, bits: int = 4, **changes):
    """vLLM's MPLinearLayerConfig of an unsharded compressed-tensors layer [N, K] (int4 or the
    int8 heads, symmetric groups of GROUP_SIZE, bf16 activations), with `changes` applied."""
    import torch
    from vllm.model_executor.kernels.linear.mixed_precision import MPLinearLayerConfig
    from vllm.scalar_type import scalar_types

    fields = dict(
        full_weight_shape=(k, n), partition_weight_shape=(k, n),
        weight_type=scalar_types.uint4b8 if bits == 4 else scalar_types.uint8b128,
        act_type=torch.bfloat16, group_size=GROUP_SIZE, zero_points=False, has_g_idx=False,
    )  # fmt: skip
    return MPLinearLayerConfig(**{**fields, **changes})


def vllm_w4a16_layer(packed, scale, bits: int = 4):
    """A module holding a checkpoint's packed words [N, K * bits / 32] and scales [N, K / G] in
    the parameter classes vLLM's CompressedTensorsWNA16.create_weights registers."""
    import torch
    from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter

    layer = torch.nn.Module()
    # what a vLLM linear layer also carries that kernels read (humming's layer conversion)
    layer.input_size_per_partition = scale.shape[1] * GROUP_SIZE
    layer.output_partition_sizes = [packed.shape[0]]
    layer.params_dtype = scale.dtype
    layer.has_bias = False
    layer.register_parameter(
        "weight_packed",
        PackedvLLMParameter(
            data=packed, input_dim=1, output_dim=0, packed_dim=1, packed_factor=32 // bits,
            weight_loader=None,
        ),
    )  # fmt: skip
    layer.register_parameter(
        "weight_scale",
        GroupQuantScaleParameter(data=scale, input_dim=1, output_dim=0, weight_loader=None),
    )
    return layer


def vllm_layers(backend: str, w: Weights):
    """One vLLM layer per weight copy, processed by `backend`'s MPLinearKernel; or a reason."""
    from vllm.model_executor.kernels.linear import mixed_precision as mp

    classes = {
        "machete": "MacheteLinearKernel",
        "marlin": "MarlinLinearKernel",
        "exllama": "ExllamaLinearKernel",
        "triton": "TritonW4A16LinearKernel",
        "humming": "HummingLinearKernel",
    }
    config = w4a16_layer_config(w.n, w.k, w.bits)
    candidate = None
    if backend.startswith(W4A8_PREFIX):
        from hyperqwen.engine.w4a8_linear import CANDIDATES

        candidate = CANDIDATES[backend.removeprefix(W4A8_PREFIX)]
        if reason := candidate.refusal(config):
            return None, reason
        kernel_cls, config = candidate.kernel_class(), candidate.config(config)
    elif backend == LAYER_BACKEND:
        from hyperqwen.engine.w4a16_linear import linear_kernel_class

        kernel_cls = linear_kernel_class()
    else:
        kernel_cls = getattr(mp, classes[backend])
    ok, reason = kernel_cls.can_implement(config)
    if not ok:
        return None, reason
    built = []
    for packed, scale in zip(w.packed, w.scales, strict=True):
        layer = vllm_w4a16_layer(packed.clone(), scale.clone(), w.bits)
        if candidate:  # the bench's scales are positive: no sign to fold
            candidate.prepare(layer)
        kernel = kernel_cls(
            config,
            w_q_param_name="weight_packed",
            w_s_param_name="weight_scale",
            w_zp_param_name="weight_zero_point",
            w_gidx_param_name="weight_g_idx",
        )
        kernel.process_weights_after_loading(layer)
        built.append((kernel, layer))
    return built, None


def relative_error(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def _failure(error: Exception) -> str:
    """What a kernel that could not be built or run raised, short enough for the result file."""
    return f"{type(error).__name__}: {error}"[:300]


def measure_shape(shape: LinearShape, ms: tuple[int, ...], backends: tuple[str, ...], log):
    """Every timing for one shape: {m: {"vllm": {...}, "ours": [...]}}."""
    import torch

    from hyperqwen.kernels.w4a16 import TileConfig, w4a16_matmul

    weight_bytes = shape.n * shape.k * shape.bits // 8
    copies = max(2, math.ceil(L2_ROTATION_BYTES / weight_bytes))
    w = Weights(shape.n, shape.k, copies, seed=shape.n * 31 + shape.k, bits=shape.bits)
    # a head's bf16 form: what stock vLLM reads for the base's bf16 lm_head (F.linear, cuBLAS)
    bf16_heads = [w.dense.to(torch.bfloat16) for _ in range(copies)] if shape.bits == 8 else []
    layers = {}
    for backend in backends:
        try:
            built, reason = vllm_layers(backend, w)
        except Exception as error:  # a kernel vLLM ships but cannot build here: say why
            built, reason = None, _failure(error)
        layers[backend] = built if built is not None else reason
    results = {}
    for m in ms:
        x = torch.randn((m, shape.k), device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w.dense.T
        entry = {
            "bytes": moved_bytes(m, shape.n, shape.k, bits=shape.bits),
            "vllm": {},
            "ours": [],
        }
        if bf16_heads:
            us = graph_time_us(
                [lambda h=h, x=x: torch.nn.functional.linear(x, h) for h in bf16_heads]
            )
            err = relative_error(torch.nn.functional.linear(x, bf16_heads[0]), ref)
            entry["vllm"][BF16] = {"us": us, "rel_err": err}
        for backend, built in layers.items():
            if isinstance(built, str):
                entry["vllm"][backend] = {"error": built}
                continue
            try:
                err = relative_error(built[0][0].apply_weights(built[0][1], x), ref)
                us = graph_time_us(
                    [lambda kl=kl, x=x: kl[0].apply_weights(kl[1], x) for kl in built]
                )
                entry["vllm"][backend] = {"us": us, "rel_err": err}
            except Exception as error:
                entry["vllm"][backend] = {"error": _failure(error)}
        for config in sweep_configs() if shape.bits == 4 else ():
            if skip_config(config, m, shape.k):
                continue
            tried = {"config": asdict(config)}
            try:
                out = torch.full((m, shape.n), float("nan"), device="cuda", dtype=torch.bfloat16)
                w4a16_matmul(x, *w.ours[0], GROUP_SIZE, config, out=out)
                err = relative_error(out, ref)
                if not math.isfinite(err) or err > 1e-2:
                    entry["ours"].append({**tried, "rel_err": err})
                    continue
                outs = [torch.empty_like(out) for _ in range(copies)]
                us = graph_time_us(
                    [
                        lambda p=p, s=s, o=o, x=x, c=config: w4a16_matmul(
                            x, p, s, GROUP_SIZE, c, out=o
                        )
                        for (p, s), o in zip(w.ours, outs, strict=True)
                    ]
                )
                entry["ours"].append({**tried, "us": us, "rel_err": err})
            except Exception as error:
                entry["ours"].append({**tried, "error": _failure(error)})
        summary = " ".join(
            f"{b}={v['us']:.1f}" if "us" in v else f"{b}=n/a" for b, v in entry["vllm"].items()
        )
        timed = [o for o in entry["ours"] if "us" in o]
        best = min(timed, key=lambda o: o["us"]) if timed else None
        summary += " ours=" + (
            f"{best['us']:.1f}us ({TileConfig(**best['config']).label()})" if best else "n/a"
        )
        log(f"{shape.name} n={shape.n} k={shape.k} m={m}: {summary}")
        results[m] = entry
    del w, layers, bf16_heads
    torch.cuda.empty_cache()
    return results


OURS = "hyperqwen"
BF16 = "bf16_torch"  # a head in bf16 through F.linear, as stock vLLM runs the base's lm_head
HEAD_CANDIDATES = ("machete", "marlin")
BASELINE = "machete"
ROW_CANDIDATES = ("marlin", OURS)
SUMMARY_CANDIDATES = ("machete", "marlin", "triton", "humming", LAYER_BACKEND, OURS)


def best_us(entry: dict, candidate: str) -> float | None:
    """Time of `candidate` at one shape and M: a vLLM backend's, or our fastest config's."""
    if candidate == OURS:
        timed = [o["us"] for o in entry["ours"] if "us" in o]
        return min(timed) if timed else None
    return entry["vllm"].get(candidate, {}).get("us")


def _ms(us: float | None) -> float | None:
    return None if us is None else round(us / 1000, 4)


def _gbps(nbytes: int, us: float | None) -> float | None:
    return None if us is None else round(nbytes / (us * 1e-6) / 1e9, 1)


def _row_dict(name: str, unit: str, stock: float | None, patched: float | None) -> dict:
    from hyperqwen.bench.results import comparison_row

    return asdict(comparison_row(name, unit, stock, patched))


def result_rows(raw: dict) -> list[dict]:
    """bench ab rows from raw timings: achieved GB/s per shape, M and candidate against Machete,
    and per M the fraction of copy bandwidth over the whole body (shapes weighted by how many
    of each a token runs)."""
    rows = []
    ms = sorted({int(m) for shape in raw["shapes"] for m in shape["m"]})
    body = [shape for shape in raw["shapes"] if shape.get("bits", 4) == 4]
    heads = [shape for shape in raw["shapes"] if shape.get("bits", 4) == 8]
    for shape in body:
        for m in ms:
            entry = shape["m"].get(str(m))
            if entry is None:
                continue
            stock = _gbps(entry["bytes"], best_us(entry, BASELINE))
            for candidate in ROW_CANDIDATES:
                patched = _gbps(entry["bytes"], best_us(entry, candidate))
                rows.append(_row_dict(f"{shape['name']}_m{m}_{candidate}", "GB/s", stock, patched))
    timed = {OURS} | {b for shape in body for e in shape["m"].values() for b in e["vllm"]}
    for m in ms:
        fractions = {}
        for candidate in (c for c in SUMMARY_CANDIDATES if c in timed):
            total_bytes = total_us = 0.0
            for shape in body:
                entry = shape["m"].get(str(m))
                us = best_us(entry, candidate) if entry else None
                if us is None:
                    total_us = math.nan
                    break
                total_bytes += shape["per_token"] * entry["bytes"]
                total_us += shape["per_token"] * us
            fraction = total_bytes / (total_us * 1e-6) / 1e9 / raw["copy_gbps"]
            fractions[candidate] = None if math.isnan(fraction) else round(fraction, 3)
            if candidate != BASELINE:
                rows.append(
                    _row_dict(
                        f"body_bw_fraction_m{m}_{candidate}",
                        "fraction",
                        fractions.get(BASELINE),  # absent when --backends left Machete out
                        fractions[candidate],
                    )
                )
    for shape in heads:
        for m in ms:
            entry = shape["m"].get(str(m))
            if entry is None:
                continue
            stock = _ms(best_us(entry, BF16))
            for backend in HEAD_CANDIDATES:
                patched = _ms(best_us(entry, backend))
                rows.append(_row_dict(f"{shape['name']}_m{m}_int8_{backend}", "ms", stock, patched))
    rows.append(asdict(copy_row(raw)))
    return rows


def result_document(raw: dict, command: str, commit: str, vllm_version: str) -> dict:
    """A result file (docs/results schema) for a kernel run; raw timings ride along."""
    from hyperqwen.bench.results import RESULT_SCHEMA

    return {
        "schema": RESULT_SCHEMA,
        "gpu": raw["gpu"],
        "vllm": f"{vllm_version}: its W4A16 kernels called directly (no server, no patches)",
        "commit": commit,
        "date": raw["date"],
        "command": command,
        "model": f"{raw['preset']} geometry W4A16 g{GROUP_SIZE} layer shapes, random int4 weights",
        "rows": result_rows(raw),
        "notes": [
            "stock = Machete (vLLM 0.26's default W4A16 kernel on sm90); patched = the "
            "kernel named at the end of the row (hyperqwen: src/hyperqwen/kernels/w4a16.py, "
            "fastest of its swept tile configs). GB/s = (int4 weights + scales + x + y bytes) / "
            "time; body_bw_fraction = the body's bytes per token over its GEMM time per token, "
            "over the copy bandwidth (read + written) measured in the same process.",
            "Head rows (lm_head, draft_head; ms, lower is better): stock = the head in bf16 "
            "through F.linear (what stock vLLM reads for the W4A16 base's bf16 lm_head), "
            "patched = the same rows in prepare's int8 g128 format through the named vLLM kernel.",
            "Each time is the median of 15 replays of a CUDA graph that runs the kernel once "
            "per weight copy (copies together > 256 MiB, so weights come from HBM, not L2), "
            "divided by the copies: launch gaps inside a graph are included, as in vLLM.",
        ],
        "raw": raw,
    }


def cmd_kernels(args: argparse.Namespace) -> int:
    import shlex

    import torch

    from hyperqwen.bench.header import git_commit

    if not torch.cuda.is_available():
        print("bench kernels: needs a CUDA GPU (it times kernels on one)", file=sys.stderr)
        return 3
    geometry = PRESETS[args.preset].with_overrides(args.set or [])
    shapes = layer_shapes(geometry) + (head_shapes(geometry) if args.heads else [])
    if args.only:
        shapes = [s for s in shapes if any(name in s.name for name in args.only)]
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    vllm_version = "vLLM not imported"
    if args.backends:
        import vllm

        vllm_version = f"vLLM {vllm.__version__}"
        init_vllm_single_rank()
    copy = copy_bandwidth_gbps()
    print(f"bench kernels: {gpu_name()}, copy bandwidth {copy:.0f} GB/s", flush=True)
    raw = {
        "gpu": gpu_label(),
        "date": started,
        "preset": args.preset,
        "copy_gbps": copy,
        "shapes": [],
    }
    command = shlex.join(["hyperqwen", "bench", "kernels", *sys.argv[3:]])
    commit = args.commit or git_commit()
    out = Path(args.out)
    for shape in shapes:
        timings = measure_shape(shape, tuple(args.m), tuple(args.backends), print)
        raw["shapes"].append({**asdict(shape), "m": {str(m): t for m, t in timings.items()}})
        document = result_document(raw, command, commit, vllm_version)
        out.write_text(json.dumps(document, indent=1) + "\n")  # after each shape: a kill keeps some
    for row in document["rows"]:
        if row["name"].startswith(("body_bw", "copy")):
            print(f"{row['name']}: stock {row['stock']} patched {row['patched']}")
    print(f"bench kernels: wrote {out} (publish: hyperqwen bench publish {out} --name NAME)")
    return 0


def add_subcommand(actions) -> None:
    kernels = add_timing_parser(
        actions,
        "kernels",
        "time W4A16 GEMM kernels at a model's layer shapes (GPU)",
        __doc__,
        "kernels-result.json",
    )
    kernels.add_argument("--set", action="append", metavar="KEY=VALUE", help="geometry override")
    kernels.add_argument("--m", type=int, nargs="+", default=list(DEFAULT_MS), help="rows (M)")
    kernels.add_argument(
        "--backends",
        nargs="*",
        default=list(VLLM_BACKENDS),
        choices=VLLM_BACKENDS + OPTIONAL_BACKENDS,
        help=f"vLLM kernels to time beside ours (default: {' '.join(VLLM_BACKENDS)}; humming "
        "JIT-compiles with nvcc first; w4a8_*: INT8_ACT's 8-bit-activation kernels)",
    )
    kernels.add_argument("--only", nargs="*", help="shape names containing these words")
    kernels.add_argument(
        "--heads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the lm_head and draft-head rows int8 (machete, marlin) against bf16",
    )
    kernels.set_defaults(func=cmd_kernels)
