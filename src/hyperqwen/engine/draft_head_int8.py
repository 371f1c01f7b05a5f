"""MTP's greedy drafts from the draft head's int8 rows in one launch (DRAFT_HEAD_INT8=1).

At the proposer_loaded seam (seams.py), after the draft vocabulary has given the drafter its
bf16 rows (engine/draft_vocab.py, earlier in FEATURES' order), this reads the same file's int8
rows and group scales and replaces the drafter's `get_top_tokens` (vLLM's LocalArgmaxMixin,
which the proposer calls for every greedy draft) with kernels/draft_argmax.py: the GEMV, the
argmax and the map to vocabulary ids in one launch, from half the bytes and without the bf16
logits. Sampled drafts (DRAFT_SAMPLE=probabilistic, for a request that samples) still score
the bf16 rows through `compute_logits`, which then stay loaded beside the int8 copy (N x
hidden bytes, 0.2 GiB for the 27B's 40,960 rows); with greedy drafts (the default) nothing
reads them again and they are freed, a net 0.2 GiB less than the bf16 rows alone.

Verification is untouched, so the output is what it is without it; a draft can differ only
where two rows' logits tie to bf16 rounding (the kernel compares them in fp32).

`hyperqwen serve` asks `serve_refusal` first: a model folder whose draft head is missing or
not int8 is refused by name before vLLM starts (so this module loads the standard library
only; torch and the kernel come with `install`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hyperqwen.engine.features import DRAFT_HEAD_INT8, ON

log = logging.getLogger("vllm.hyperqwen.draft_head_int8")
_FIX = (
    f"set {DRAFT_HEAD_INT8.knob}=0 ({DRAFT_HEAD_INT8.env}=0), or write the head again with "
    "`hyperqwen prepare`"
)


def serve_refusal(setting: str, gpus: Any, model_dir: Path) -> str | None:
    """Why DRAFT_HEAD_INT8=`setting` cannot serve this model folder, or None: the prepared
    draft head must be there with int8 rows (read from its safetensors header alone)."""
    if setting != ON:
        return None
    from hyperqwen.checkpoint.shards import ShardFileError, read_header
    from hyperqwen.checkpoint.w4a16_sizes import GROUP_SIZE, packed_bits
    from hyperqwen.prepare.folder import DRAFT_HEAD_FILE

    path = Path(model_dir) / DRAFT_HEAD_FILE
    if not path.is_file():
        return (
            f"{DRAFT_HEAD_INT8.knob}=1 needs the draft head `hyperqwen prepare` writes, and "
            f"{path} does not exist; run `hyperqwen prepare` on the model folder, or set "
            f"{DRAFT_HEAD_INT8.knob}=0"
        )
    try:
        shapes = {name: entry.shape for name, entry in read_header(path).tensors.items()}
    except ShardFileError as error:
        return f"{DRAFT_HEAD_INT8.knob}=1: {error}; {_FIX}"
    packed, scales = shapes.get("draft_head.weight_packed"), shapes.get("draft_head.weight_scale")
    bits = packed_bits(packed[1], GROUP_SIZE * scales[1]) if packed and scales else 16
    if bits != 8:
        return (
            f"{DRAFT_HEAD_INT8.knob}=1 reads int8 draft-head rows, and {path} holds {bits}-bit "
            f"rows; {_FIX}"
        )
    return None


def proposer_loaded(proposer) -> None:
    install(proposer)


def _graph_sizes(config) -> list[int]:
    return list(config.compilation_config.cudagraph_capture_sizes or [0])


def install(proposer) -> bool:
    """Give a loaded MTP proposer, whose drafter has the draft vocabulary, the fused int8
    argmax. Returns whether it was installed; logs why not."""
    import torch

    from hyperqwen.engine import draft_vocab
    from hyperqwen.kernels.draft_argmax import Int8DraftHead

    model = proposer.model
    if not draft_vocab.installed(model):
        log.warning(
            "int8 draft head: the drafter has no draft vocabulary (SPEC=mtp with "
            "hyperqwen-draft-head.safetensors in the model folder); its drafts keep vLLM's path"
        )
        return False
    config = proposer.vllm_config
    token_ids, codes, scales = draft_vocab.load_int8_rows(
        draft_vocab.head_path(config),
        draft_vocab.target_vocab_size(model),
        config.model_config.hf_text_config.hidden_size,
        fix=_FIX,
    )
    device = model.draft_id_to_target_id.device
    # a draft pass scores at most one row per running request (V2 pads to its graph sizes)
    max_batch = max(config.scheduler_config.max_num_seqs, *_graph_sizes(config))
    head = Int8DraftHead(codes.to(device), scales.to(device), token_ids.to(device), max_batch)
    # compiled now, at load, rather than in the first request's draft
    warm = torch.zeros((1, codes.shape[1]), dtype=config.model_config.dtype, device=device)
    head.top_tokens(warm)

    def get_top_tokens(hidden_states: torch.Tensor) -> torch.Tensor:
        return head.top_tokens(hidden_states)[0]

    model.get_top_tokens = get_top_tokens
    kept = "kept for sampled drafts"
    if config.speculative_config.draft_sample_method == "greedy":
        _drop_bf16_rows(model)
        kept = "freed: every draft is greedy"
    log.info(
        "int8 draft head: greedy drafts score %d int8 rows in one fused launch (%.2f GiB; the "
        "bf16 rows %s)",
        len(token_ids),
        (codes.numel() + scales.numel() * scales.element_size()) / 2**30,
        kept,
    )
    return True


def _drop_bf16_rows(model) -> None:
    """With draft_sample_method greedy neither of vLLM's runners asks the drafter for logits
    (only sampled drafts do), so the draft vocabulary's bf16 rows are not read again: their
    memory goes back, and a call for logits says why there are none."""
    model.lm_head.weight.data = model.lm_head.weight.data.new_empty(0)

    def compute_logits(hidden_states: Any, spec_step_idx: int = 0) -> Any:
        raise RuntimeError(
            f"{DRAFT_HEAD_INT8.env}=1 with greedy drafts freed the drafter's bf16 rows, yet "
            "vLLM asked it for logits (sampled drafts); set DRAFT_SAMPLE=probabilistic to keep "
            f"them, or {DRAFT_HEAD_INT8.knob}=0"
        )

    model.compute_logits = compute_logits
