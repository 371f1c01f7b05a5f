"""Draft vocabulary for the MTP drafter: score only prepare's draft-head rows, remap to target ids.

vLLM's MTP proposer shares the target's full lm_head (248,320 rows, 2.5 GB in bf16) with the
drafter, so each draft token reads the whole head. `hyperqwen prepare` writes the rows of the
draft vocabulary's ids (40,960 by default; drafter/README.md) as hyperqwen-draft-head.safetensors
beside the checkpoint. `install` swaps them in after vLLM has loaded the drafter (the
proposer_loaded seam, seams.py):

- greedy drafts (`draft_sample_method: greedy`) go through vLLM's own LocalArgmaxMixin seam of
  Qwen3_5MTP: the argmax over the draft rows, index k, becomes target id k +
  draft_id_to_target_id[k];
- sampled drafts get full-vocabulary logits with -inf outside the draft vocabulary, so the
  draft distribution vLLM's rejection sampler sees is the drafter's, restricted.

Verification is untouched: the target scores every id, so output is exactly what it is without
the draft vocabulary (greedy: identical tokens; sampled: the same distribution); only how many
drafts are accepted can change (tokens outside the vocabulary are never proposed).

The knob: env HYPERQWEN_DRAFT_VOCAB (Settings.DRAFT_VOCAB): "auto" (default) installs it when
the file exists, "off" leaves vLLM's full head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.base import unpack_from_int32
from safetensors import safe_open

from hyperqwen.checkpoint import w4a16 as checkpoint_format
from hyperqwen.drafter.head import PREFIX
from hyperqwen.engine.features import DRAFT_VOCAB
from hyperqwen.prepare.folder import DRAFT_HEAD_FILE

log = logging.getLogger("vllm.hyperqwen.draft_vocab")


class DraftVocabError(ValueError):
    """A draft head file the drafter cannot use; the message names the file and the fix."""


@dataclass(frozen=True)
class DraftHead:
    """The draft vocabulary's target ids (sorted) and their lm_head rows, dequantized."""

    token_ids: torch.Tensor  # int64 [N]
    weight: torch.Tensor  # [N, hidden]

    @property
    def offsets(self) -> torch.Tensor:
        return target_offsets(self.token_ids)


def target_offsets(token_ids: torch.Tensor) -> torch.Tensor:
    """draft_id_to_target_id as LocalArgmaxMixin reads it: target id = k + offsets[k]."""
    return token_ids - torch.arange(len(token_ids), device=token_ids.device)


def _read(path: Path, vocab_size: int, hidden_size: int) -> tuple[torch.Tensor, dict]:
    """A draft head file's token ids and its stored rows (`weight`, or the packed tensors by
    suffix), checked."""
    with safe_open(path, framework="pt") as handle:
        names = set(handle.keys())
        if f"{PREFIX}.token_ids" not in names:
            raise DraftVocabError(f"{path}: no {PREFIX}.token_ids tensor; {_fix()}")
        token_ids = handle.get_tensor(f"{PREFIX}.token_ids").to(torch.int64)
        stored = {
            name.removeprefix(f"{PREFIX}."): handle.get_tensor(name)
            for name in names
            if name != f"{PREFIX}.token_ids"
        }
    if "weight" in stored:
        shape = tuple(stored["weight"].shape)
    elif set(checkpoint_format.PACKED_SUFFIXES) <= stored.keys():
        shape = tuple(stored["weight_shape"].tolist())
    else:
        raise DraftVocabError(
            f"{path}: holds {sorted(stored)}, neither {PREFIX}.weight nor the packed "
            f"{'/'.join(checkpoint_format.PACKED_SUFFIXES)}; {_fix()}"
        )
    problems = []
    if token_ids.ndim != 1 or len(token_ids) == 0:
        problems.append(f"token_ids has shape {list(token_ids.shape)}, expected [N > 0]")
    elif not bool((token_ids[1:] > token_ids[:-1]).all()):
        problems.append("token_ids are not strictly increasing")
    elif token_ids[0] < 0 or token_ids[-1] >= vocab_size:
        problems.append(
            f"token_ids span {int(token_ids[0])}..{int(token_ids[-1])}, outside the model's "
            f"vocabulary of {vocab_size}"
        )
    if shape != (len(token_ids), hidden_size):
        problems.append(
            f"rows have shape {list(shape)}, expected [{len(token_ids)}, {hidden_size}]"
        )
    if problems:
        raise DraftVocabError(f"{path}: " + "; ".join(problems) + f"; {_fix()}")
    return token_ids, stored


def _fix() -> str:
    return (
        f"rerun `hyperqwen prepare` to rewrite it, or set {DRAFT_VOCAB.knob}=off "
        f"({DRAFT_VOCAB.env}=off)"
    )


def load_draft_head(path: Path, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> DraftHead:
    """Read and check a draft head file; the int8 rows of a prepared head come back in `dtype`."""
    token_ids, stored = _read(path, vocab_size, hidden_size)
    weight = stored["weight"] if "weight" in stored else checkpoint_format.unpack(stored)
    return DraftHead(token_ids, weight.to(dtype))


def load_int8_rows(
    path: Path, vocab_size: int, hidden_size: int, fix: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prepared draft head's token ids [N], int8 codes [N, hidden] and group scales
    [N, hidden / 128], as stored (no dequantization); a file of other rows is refused with
    `fix`, the caller's way out."""
    token_ids, stored = _read(path, vocab_size, hidden_size)
    bits = checkpoint_format.packed_bits(stored) if "weight" not in stored else 16
    if bits != 8:
        raise DraftVocabError(
            f"{path}: holds {bits}-bit rows, not the int8 rows `hyperqwen prepare` writes from "
            f"an int8 lm_head; {fix}"
        )
    codes = unpack_from_int32(stored["weight_packed"], 8, torch.Size((len(token_ids), hidden_size)))
    return token_ids, codes.contiguous(), stored["weight_scale"].contiguous()


# set on a drafter given the draft vocabulary: the vocabulary its draft ids map into
_TARGET_VOCAB = "hyperqwen_target_vocab_size"


def installed(model) -> bool:
    """Whether `install` gave this drafter the draft vocabulary."""
    return getattr(model, _TARGET_VOCAB, None) is not None


def target_vocab_size(model) -> int:
    return getattr(model, _TARGET_VOCAB)


def head_path(config) -> Path:
    """The draft head file of the model vLLM serves."""
    return Path(config.model_config.model) / DRAFT_HEAD_FILE


def full_vocab_logits(draft_logits: torch.Tensor, token_ids: torch.Tensor, vocab_size: int):
    """[B, N] logits over the draft ids -> [B, vocab_size], -inf where the draft cannot go."""
    full = draft_logits.new_full((draft_logits.shape[0], vocab_size), float("-inf"))
    full[:, token_ids] = draft_logits
    return full


def proposer_loaded(proposer) -> None:
    install(proposer)


def install(proposer) -> bool:
    """Give a loaded vLLM MTP proposer the draft head (vLLM's seam: after load_model shared the
    target's lm_head). Returns whether it was installed; logs why not."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    config = proposer.vllm_config
    if config.speculative_config.method != "mtp":
        return False
    path = head_path(config)
    if not path.is_file():
        log.info("draft vocabulary: %s not found; the drafter scores the full vocabulary", path)
        return False
    model = proposer.model
    if not hasattr(model, "get_top_tokens"):
        log.warning(
            "draft vocabulary: %s has no get_top_tokens (vLLM's LocalArgmaxMixin); keeping the "
            "full head",
            type(model).__name__,
        )
        return False
    text_config = config.model_config.hf_text_config
    vocab_size = model.logits_processor.vocab_size
    head = load_draft_head(path, vocab_size, text_config.hidden_size, config.model_config.dtype)
    device = next(model.parameters()).device
    # both read the current config (head dtype, TP group); the proposer may run outside it
    with set_current_vllm_config(config), torch.device(device):
        draft_lm_head = ParallelLMHead(
            len(head.token_ids),
            text_config.hidden_size,
            params_dtype=config.model_config.dtype,
            prefix="draft_head",
        )
        draft_logits = LogitsProcessor(len(head.token_ids))
    draft_lm_head.weight_loader(draft_lm_head.weight, head.weight.to(device))
    draft_lm_head.quant_method.process_weights_after_loading(draft_lm_head)  # as vLLM's loader
    token_ids = head.token_ids.to(device)

    def compute_logits(hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        return full_vocab_logits(draft_logits(draft_lm_head, hidden_states), token_ids, vocab_size)

    model.lm_head = draft_lm_head
    model.logits_processor = draft_logits
    model.draft_id_to_target_id = torch.nn.Parameter(head.offsets.to(device), requires_grad=False)
    model.compute_logits = compute_logits
    setattr(model, _TARGET_VOCAB, vocab_size)
    # greedy drafts: argmax over the draft rows and remap (LocalArgmaxMixin.get_top_tokens)
    proposer.use_local_argmax_reduction = True
    log.info(
        "draft vocabulary: %d of %d ids from %s (each draft reads %.1f%% of the head)",
        len(token_ids),
        vocab_size,
        path,
        100 * len(token_ids) / vocab_size,
    )
    return True
