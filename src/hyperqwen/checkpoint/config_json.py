"""config.json and generation_config.json of a `Qwen3_5ForConditionalGeneration` checkpoint.

Keys are the ones transformers 5.24's `Qwen3_5Config`/`Qwen3_5TextConfig` define and vLLM
0.26.0's `qwen3_5` model, `qwen3_5_mtp` draft model and speculative config read
(`mtp_num_hidden_layers`, `attn_output_gate`, `mamba_ssm_dtype`, the M-RoPE `rope_parameters`).
The vision tower is described as on the real model; vLLM builds it only when images are enabled
(serve text-only checkpoints with `--language-model-only`).
"""

from __future__ import annotations

import json
from pathlib import Path

from hyperqwen.checkpoint.geometry import Geometry
from hyperqwen.checkpoint.layout import VISION_DEPTH
from hyperqwen.checkpoint.tokenizer import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKEN_IDS

ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
DTYPE = "bfloat16"
INITIALIZER_RANGE = 0.02


def _vision_config(text_hidden_size: int) -> dict:
    return {
        # The public checkpoints say "qwen3_5" here; transformers maps it to qwen3_5_vision.
        "model_type": "qwen3_5",
        "deepstack_visual_indexes": [],
        "depth": VISION_DEPTH,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": INITIALIZER_RANGE,
        "intermediate_size": 4304,
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": text_hidden_size,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }


def _number(value: float) -> int | float:
    """1e7 is written 10000000, as in the real config."""
    return int(value) if float(value).is_integer() else value


def build_config(g: Geometry) -> dict:
    """config.json without `quantization_config` (the W4A16 format module adds that)."""
    text_config = {
        "model_type": "qwen3_5_text",
        "dtype": DTYPE,
        "vocab_size": g.vocab_size,
        "hidden_size": g.hidden_size,
        "intermediate_size": g.intermediate_size,
        "num_hidden_layers": g.num_hidden_layers,
        "layer_types": g.layer_types,
        "full_attention_interval": g.full_attention_interval,
        "num_attention_heads": g.num_attention_heads,
        "num_key_value_heads": g.num_key_value_heads,
        "head_dim": g.head_dim,
        "attn_output_gate": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_conv_kernel_dim": g.linear_conv_kernel_dim,
        "linear_key_head_dim": g.linear_key_head_dim,
        "linear_value_head_dim": g.linear_value_head_dim,
        "linear_num_key_heads": g.linear_num_key_heads,
        "linear_num_value_heads": g.linear_num_value_heads,
        # The Gated DeltaNet recurrent state stays fp32 (vLLM reads this for its SSM cache).
        "mamba_ssm_dtype": "float32",
        "hidden_act": "silu",
        "rms_norm_eps": g.rms_norm_eps,
        "max_position_embeddings": g.max_position_embeddings,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": _number(g.rope_theta),
            "partial_rotary_factor": g.partial_rotary_factor,
            "mrope_section": g.mrope_section,
            "mrope_interleaved": True,
        },
        "mtp_num_hidden_layers": g.mtp_num_hidden_layers,
        "initializer_range": INITIALIZER_RANGE,
        "tie_word_embeddings": False,
        "use_cache": True,
        "eos_token_id": SPECIAL_TOKEN_IDS[EOS_TOKEN],
        "pad_token_id": SPECIAL_TOKEN_IDS[PAD_TOKEN],
    }
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3_5",
        "dtype": DTYPE,
        "text_config": text_config,
        "vision_config": _vision_config(g.hidden_size),
        "image_token_id": SPECIAL_TOKEN_IDS["<|image_pad|>"],
        "video_token_id": SPECIAL_TOKEN_IDS["<|video_pad|>"],
        "vision_start_token_id": SPECIAL_TOKEN_IDS["<|vision_start|>"],
        "vision_end_token_id": SPECIAL_TOKEN_IDS["<|vision_end|>"],
        "tie_word_embeddings": False,
    }


def write_config(directory: Path, g: Geometry) -> None:
    (directory / "config.json").write_text(json.dumps(build_config(g), indent=2) + "\n")


def write_generation_config(directory: Path) -> None:
    """Stop on <|im_end|> or <|endoftext|>; Qwen3's recommended thinking-mode sampling."""
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=SPECIAL_TOKEN_IDS[PAD_TOKEN],
        eos_token_id=[SPECIAL_TOKEN_IDS[EOS_TOKEN], SPECIAL_TOKEN_IDS[PAD_TOKEN]],
        pad_token_id=SPECIAL_TOKEN_IDS[PAD_TOKEN],
        do_sample=True,
        temperature=0.6,
        top_p=0.95,
        top_k=20,
    ).save_pretrained(str(directory))
