"""A copy prompt the random-weight tiny Qwen3.5 really continues by copying, for
tests/test_engine_quoting_gpu.py, and what the lookup search could find in an answer.

A random model does not copy its context: its greedy text is a chain of top-2 near ties (logits
of std ~0.3 over 248k tokens), and what the GDN and attention layers add to the residual stream
outweighs the token embedding (std 0.02), so any change of context changes the continuation.
Seen on the CPU with transformers' Qwen3.5 and the synthesized tiny weights (2026-12-03): after
S + X + S, where X is the greedy continuation of a seed S, the continuation agreed with X for
0-2 tokens; 600 greedy tokens from a chat seed never repeated 6 tokens in a row. So the test
plants a cycle: `CYCLE_LENGTH` ordinary tokens no chat prompt uses, each given the embedding
that points at the lm_head row of the next, so after one of them the residual stream points at
its successor by a margin the layers' contributions cannot flip. Text over those tokens is
continued around the cycle; every other token keeps its random embedding, so the chat prompts
meet the model as synthesized.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from hyperqwen.checkpoint.tokenizer import SPECIAL_TOKEN_IDS
from hyperqwen.engine.lookup import LONG_MATCH

CYCLE_LENGTH = 64
# Each planted embedding's RMS: ~20 times what the tiny model's layers add to the residual
# stream (~0.18 RMS with std-0.02 weights), so the final norm sees the planted direction.
PLANTED_RMS = 4.0
EMBEDDING = "model.language_model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
INDEX = "model.safetensors.index.json"


def cycle_tokens(avoid: Iterable[int], length: int = CYCLE_LENGTH, seed: int = 0) -> list[int]:
    """`length` distinct ordinary token ids (below the first special token), none in `avoid`,
    in a seeded order: the cycle's order."""
    ordinary = min(SPECIAL_TOKEN_IDS.values())
    avoided = set(avoid)
    chooser = random.Random(seed)
    chosen: list[int] = []
    while len(chosen) < length:
        token = chooser.randrange(ordinary)
        if token not in avoided and token not in chosen:
            chosen.append(token)
    return chosen


def planted_embeddings(lm_head: torch.Tensor, cycle: Sequence[int], rms: float) -> torch.Tensor:
    """[len(cycle), hidden] float32: for each cycle token the lm_head row of the token after it
    (around the cycle), scaled to RMS `rms`, so its logit leads by about |row| * sqrt(hidden)."""
    following = torch.tensor([*cycle[1:], cycle[0]])
    rows = lm_head[following].float()
    return rows * (rms / rows.pow(2).mean(dim=1, keepdim=True).sqrt())


def plant_cycle(model_dir: Path, cycle: Sequence[int], rms: float = PLANTED_RMS) -> None:
    """Overwrite the cycle tokens' rows of a bf16 checkpoint's embedding (before `prepare`
    quantizes it) with planted_embeddings from its lm_head."""
    from safetensors.torch import load_file, save_file

    weight_map = json.loads((model_dir / INDEX).read_text())["weight_map"]
    head = load_file(model_dir / weight_map[LM_HEAD])[LM_HEAD]
    shard = model_dir / weight_map[EMBEDDING]
    tensors = load_file(shard)
    embedding = tensors[EMBEDDING]
    embedding[torch.tensor(list(cycle))] = planted_embeddings(head, cycle, rms).to(embedding.dtype)
    # a new file renamed over the old: a shard hard-linked from a shared base stays as it was
    staging = shard.with_name(shard.name + ".planting")
    save_file(tensors, staging, metadata={"format": "pt"})
    staging.replace(shard)


def copy_prompt(cycle: Sequence[int]) -> list[int]:
    """The cycle once, then its first half again: a continuation that keeps going around the
    cycle copies the prompt from its second half on."""
    return [*cycle, *cycle[: len(cycle) // 2]]


def copyable_tokens(
    prompt_ids: Sequence[int], answer_ids: Sequence[int], n: int = LONG_MATCH
) -> int:
    """How many answer tokens the lookup search could have drafted: the n tokens before it
    occurred earlier in the context (prompt and answer so far), and the token after their
    latest earlier occurrence is this one."""
    ids = [*prompt_ids, *answer_ids]
    latest: dict[tuple[int, ...], int] = {}  # n tokens -> the index after their latest end
    count = 0
    for end in range(n, len(ids)):
        key = tuple(ids[end - n : end])
        if end >= len(prompt_ids) and key in latest and ids[latest[key]] == ids[end]:
            count += 1
        latest[key] = end
    return count


def repeats_its_context(prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> bool:
    """Whether the answer's last LONG_MATCH tokens occurred earlier in the request's context
    (prompt and answer): a long match, which lookup copies alone."""
    ids = [*prompt_ids, *answer_ids]
    tail = ids[-LONG_MATCH:]
    return any(ids[i : i + LONG_MATCH] == tail for i in range(len(ids) - LONG_MATCH))
