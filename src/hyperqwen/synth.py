"""`hyperqwen synth`: write a Qwen3.5-architecture checkpoint of any size with random weights."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

DESCRIPTION = """\
Write a Qwen3.5-architecture checkpoint (vLLM model class qwen3_5) with seeded random
weights, in exactly the on-disk format of the public W4A16 base: compressed-tensors
pack-quantized int4 (group size 128, symmetric) for the decoder's linears; bf16 for the
embedding, lm_head, the MTP head and the Gated DeltaNet in_proj_a/in_proj_b; sharded
safetensors with an index; config.json, generation_config.json and the real Qwen3.5
tokenizer with a thinking + tool-calling chat template.

Use it to test serving code without the real checkpoint:
  * --preset tiny builds a 4-layer model in seconds that vLLM really loads and runs;
  * --preset 27b --config-only writes just the real model's config and tokenizer, for
    speed runs with `vllm serve DIR --load-format dummy` (vLLM fills the weights itself);
  * --preset 27b alone writes all ~18.5 GB of weights: slow (about a quarter of an hour on
    two CPU cores), but it holds only one shard in memory at a time.

The directory is built next to OUT_DIR and renamed into place when complete; an existing
non-empty OUT_DIR is left alone unless you pass --force. Text-only checkpoint: serve it with
--language-model-only (there are no vision tower weights)."""


def _epilog() -> str:
    from hyperqwen.checkpoint.geometry import PRESETS

    names = list(PRESETS)
    rows = [f"  {'key':<26}" + "".join(f"{name:>12}" for name in names)]
    for field in fields(PRESETS[names[0]]):
        values = "".join(f"{getattr(PRESETS[name], field.name)!s:>12}" for name in names)
        rows.append(f"  {field.name:<26}{values}")
    return (
        "geometry keys for --set (preset values):\n"
        + "\n".join(rows)
        + """

examples:
  hyperqwen synth /tmp/qwen-tiny --preset tiny
  vllm serve /tmp/qwen-tiny --language-model-only --enforce-eager --max-model-len 2048

  hyperqwen synth /tmp/qwen-27b-shape --preset 27b --config-only
  vllm serve /tmp/qwen-27b-shape --load-format dummy --language-model-only

  hyperqwen synth /tmp/qwen-27b-prepared --preset 27b --config-only --prepared --draft-head

  hyperqwen synth /tmp/qwen-wide --preset tiny --set hidden_size=512 --set num_hidden_layers=8
"""
    )


def add_subcommand(subparsers) -> None:
    from hyperqwen.checkpoint.geometry import PRESETS
    from hyperqwen.checkpoint.shards import DEFAULT_MAX_SHARD_SIZE, parse_size

    def shard_size(text: str) -> int:
        try:
            return parse_size(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parser = subparsers.add_parser(
        "synth",
        help="write a random-weight Qwen3.5 checkpoint (tiny for tests, 27b shape for speed runs)",
        description=DESCRIPTION,
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="checkpoint directory")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="tiny",
        help="starting geometry: tiny (seconds on a CPU) or 27b (the real model) [tiny]",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override one geometry key (repeatable); keys are listed below",
    )
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="write config, generation config and tokenizer but no weights "
        "(for `vllm serve --load-format dummy`)",
    )
    parser.add_argument(
        "--prepared",
        action="store_true",
        help="with --config-only: write the quantization config `hyperqwen prepare` leaves "
        "(int8 lm_head, embed_tokens and MTP linears), to measure a prepared model with "
        "--load-format dummy (serve it with the patched vLLM: stock cannot load the int8 "
        "embedding)",
    )
    parser.add_argument(
        "--draft-head",
        action="store_true",
        help="with --config-only: also write hyperqwen-draft-head.safetensors, random rows "
        "for the default draft vocabulary (40,960 ids) stored int8 as prepare stores them, "
        "so the patched vLLM's MTP draft vocabulary runs (and can be timed) with --load-format "
        "dummy; real models get theirs from `hyperqwen prepare`",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="random seed; same seed, same weights [0]"
    )
    parser.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        type=shard_size,
        default=DEFAULT_MAX_SHARD_SIZE,
        help=f"largest safetensors shard, e.g. 500MB, 2GB, 4GiB [{DEFAULT_MAX_SHARD_SIZE}]",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace OUT_DIR if it exists and is not empty"
    )
    parser.set_defaults(func=run)


def _size(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000:
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{num_bytes:.0f} B"
        num_bytes /= 1000
    return f"{num_bytes:.1f} TB"


def prepared_quantization_edit(geometry):
    """The quantization config edit of `hyperqwen prepare`'s tensor steps at their defaults."""
    from hyperqwen.prepare.marker import Options
    from hyperqwen.prepare.tensors import prepared_quantization, step_bits

    bits = step_bits(Options())
    return lambda quantization, specs: prepared_quantization(
        quantization, geometry, bits, [spec.name for spec in specs]
    )


def write_synthetic_draft_head(model_dir: Path, geometry, seed: int) -> int:
    """Random rows for the default draft vocabulary, in the file prepare writes from an int8
    lm_head (int8 group-128 codes and scales, as `hyperqwen prepare` leaves the head; written
    atomically); returns its size."""
    import torch
    from safetensors.torch import save_file

    from hyperqwen.checkpoint import w4a16 as checkpoint_format
    from hyperqwen.checkpoint.shards import atomic_file
    from hyperqwen.drafter.head import PREFIX
    from hyperqwen.drafter.vocab import DEFAULT_DRAFT_SIZE, DEFAULT_RANKING, cut, read_ranking
    from hyperqwen.prepare.folder import DRAFT_HEAD_FILE

    ids = cut(read_ranking(DEFAULT_RANKING), DEFAULT_DRAFT_SIZE, geometry.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn((len(ids), geometry.hidden_size), generator=generator) * 0.02
    packed = checkpoint_format.pack(rows.to(torch.bfloat16), num_bits=8)
    target = model_dir / DRAFT_HEAD_FILE
    with atomic_file(target) as temporary:
        tensors = {f"{PREFIX}.token_ids": torch.tensor(ids, dtype=torch.int64)}
        tensors |= {f"{PREFIX}.{suffix}": tensor for suffix, tensor in packed.items()}
        save_file(tensors, str(temporary))
    return target.stat().st_size


def run(args: argparse.Namespace) -> int:
    from hyperqwen.checkpoint.geometry import PRESETS, GeometryError
    from hyperqwen.checkpoint.synthesize import synthesize
    from hyperqwen.checkpoint.w4a16 import FormatError
    from hyperqwen.prepare.folder import DRAFT_HEAD_FILE

    for flag, given in (("--prepared", args.prepared), ("--draft-head", args.draft_head)):
        if given and not args.config_only:
            print(
                f"hyperqwen synth: error: {flag} needs --config-only (for a checkpoint with "
                "weights, run `hyperqwen prepare OUT_DIR` on it instead)",
                file=sys.stderr,
            )
            return 2
    try:
        geometry = PRESETS[args.preset].with_overrides(args.overrides)
        result = synthesize(
            args.out_dir,
            geometry,
            seed=args.seed,
            config_only=args.config_only,
            max_shard_bytes=args.max_shard_size,
            force=args.force,
            edit_quantization=prepared_quantization_edit(geometry) if args.prepared else None,
        )
    except (GeometryError, FormatError, FileExistsError) as error:
        print(f"hyperqwen synth: error: {error}", file=sys.stderr)
        return 2
    kind = "config + tokenizer only" if args.config_only else "W4A16 weights"
    if args.prepared:
        kind += ", prepared quantization config"
    if args.draft_head:
        result.files[DRAFT_HEAD_FILE] = write_synthetic_draft_head(
            result.directory, geometry, args.seed
        )
        kind += ", synthetic draft head"
    print(
        f"wrote {result.directory} ({args.preset}, {result.parameters / 1e9:.2f} B parameters, "
        f"{kind})"
    )
    for name, size in result.files.items():
        print(f"  {name:<40} {_size(size):>10}")
    print(f"total {_size(sum(result.files.values()))} in {result.seconds:.1f} s")
    return 0
