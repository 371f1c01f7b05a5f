"""The CPU estimate behind test_kvarn_serve_gpu.py's MEAN_RATIO: how far KVarN's read, and some
wrong reads, move the log-probabilities of a 200-token greedy continuation of that test's prompt
in a transformers Qwen3.5 of the tiny geometry (random init, not the served checkpoint's weights),
against the same model with its exact cache; and the control the test measures (tile 1's prompt
tokens replaced by another text's). Prints mean and max |difference| per variant.

    PYTHONPATH=$PWD/src python tests/kvarn_logprob_estimate.py SEED   # ~20 s on 2 cores
"""

from __future__ import annotations

import sys

import torch
from test_kvarn_serve_gpu import OTHER_TEXT, PROMPT, TILE
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from hyperqwen.checkpoint.config_json import build_config
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.checkpoint.tokenizer import build_fast_tokenizer
from hyperqwen.kvarn.quantize import dequantize_tile, quantize_tile

ANSWER_TOKENS = 200
# the attention read of the full-attention layer: "exact", or KVarN's with a fault
VARIANT = {"name": "exact", "other_kv": None}
exact_attention = qwen.eager_attention_forward


def through_tiles(key, value):
    """key and value [1, Hkv, S, D] with each full tile replaced by its KVarN decoding."""
    out_k, out_v = key.clone(), value.clone()
    for b in range(key.shape[2] // TILE):
        tile = slice(b * TILE, (b + 1) * TILE)
        k, v = dequantize_tile(quantize_tile(key[0, :, tile], value[0, :, tile]))
        out_k[0, :, tile], out_v[0, :, tile] = k.to(key.dtype), v.to(value.dtype)
    return out_k, out_v


def kvarn_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    """A whole-sequence forward reading as attention.read_plan says: the sink and the filling
    tile exact, the full blocks 1 .. L // 128 - 1 of a query's context L through the tiles."""
    name = VARIANT["name"]
    if name == "capture":
        VARIANT["other_kv"] = (key.clone(), value.clone())
    if name in ("exact", "capture") or key.shape[2] != query.shape[2]:
        return exact_attention(module, query, key, value, attention_mask, scaling, dropout, **kw)
    qk, qv = through_tiles(key, value)
    one, two = slice(TILE, 2 * TILE), slice(2 * TILE, 3 * TILE)
    if name == "neighbour block":  # block 1 read from block 2's tile
        qk[:, :, one], qv[:, :, one] = qk[:, :, two], qv[:, :, two]
    elif name == "K and V of two blocks":
        qv[:, :, one] = qv[:, :, two].clone()
    elif name == "another request's tile":
        other_k, other_v = through_tiles(*VARIANT["other_kv"])
        qk[:, :, one], qv[:, :, one] = other_k[:, :, one], other_v[:, :, one]
    seq = key.shape[2]
    position = torch.arange(seq)
    block, context = position // TILE, position + 1
    quantized = (block[None, :] >= 1) & (block[None, :] < (context // TILE)[:, None])
    groups = module.num_key_value_groups
    exact_k, exact_v = qwen.repeat_kv(key, groups), qwen.repeat_kv(value, groups)
    tile_k, tile_v = qwen.repeat_kv(qk, groups), qwen.repeat_kv(qv, groups)
    scores = torch.where(quantized, query @ tile_k.transpose(2, 3), query @ exact_k.transpose(2, 3))
    causal = position[None, :] > position[:, None]
    weights = (scores * scaling).masked_fill(causal, float("-inf")).softmax(-1)
    out = (weights * quantized) @ tile_v + (weights * ~quantized) @ exact_v
    return out.transpose(1, 2).contiguous(), None


def main(seed: int) -> None:
    torch.manual_seed(seed)
    text = build_config(PRESETS["tiny"])["text_config"]
    config = Qwen3_5TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    config._attn_implementation = "eager"
    model = qwen.Qwen3_5ForCausalLM(config).float().eval()
    qwen.eager_attention_forward = kvarn_attention
    tokenizer = build_fast_tokenizer()
    prompt, other = tokenizer.encode(PROMPT).ids, tokenizer.encode(OTHER_TEXT).ids
    with torch.no_grad():
        sequence = list(prompt)
        out = model(torch.tensor([sequence]), use_cache=True)
        for _ in range(ANSWER_TOKENS):  # greedy, exact cache
            sequence.append(int(out.logits[0, -1].argmax()))
            out = model(
                torch.tensor([sequence[-1:]]), past_key_values=out.past_key_values, use_cache=True
            )
        start = len(prompt)
        target = torch.tensor(sequence[start:])[:, None]

        def logprobs(variant: str, ids: list[int], dtype=torch.float32) -> torch.Tensor:
            VARIANT["name"] = variant
            logits = model.to(dtype)(torch.tensor([ids])).logits[0, start - 1 : -1]
            model.float()
            return logits.float().log_softmax(-1).gather(1, target)[:, 0]

        VARIANT["name"] = "capture"  # another request's K and V, for its tile
        model(torch.tensor([other]))
        exact = logprobs("exact", sequence)
        swapped = list(sequence)
        swapped[TILE : 2 * TILE] = other[TILE : 2 * TILE]
        rows = {
            "bf16 model, exact": logprobs("exact", sequence, torch.bfloat16),
            "control (tile 1's tokens swapped)": logprobs("exact", swapped),
            "kvarn": logprobs("kvarn", sequence),
            "kvarn, bf16 model": logprobs("kvarn", sequence, torch.bfloat16),
            **{name: logprobs(name, sequence) for name in (
                "neighbour block", "K and V of two blocks", "another request's tile")},
        }  # fmt: skip
        for name, got in rows.items():
            diff = (got - exact).abs()
            print(f"{name:36s} mean {diff.mean():.4f} max {diff.max():.4f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
