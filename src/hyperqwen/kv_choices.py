"""KV=: the KV-cache dtypes of vLLM 0.26.0 that serve Qwen3.5 (Gated DeltaNet + attention
layers) and HyperQwen's KVarN cache (kvarn), what each needs on vLLM's command line, and the
combinations refused before vLLM starts. Pure data and checks: settings.py takes the allowed
names, launch.py the flags, capacity.py the bytes (attention_token_bytes), cli.py the GPU
check, the docs the table.

What vLLM 0.26.0's source says (vllm/...: function), read for these facts:
- The dtypes: config/cache.py CacheDType. Left out here: float16 (this bf16 model's cache is
  bf16, which is auto), fp8_inc (Intel Gaudi), fp8_ds_mla (MLA models), nvfp4 (FlashInfer's
  TRT-LLM kernels on sm100 only: v1/attention/backends/flashinfer.py supports_kv_cache_dtype).
- Which attention backend takes which dtype: each backend's supported_kv_cache_dtypes and
  supports_kv_cache_dtype; the selector tries them in order FLASH_ATTN, FLASHINFER,
  TRITON_ATTN, FLEX_ATTENTION, TURBOQUANT on sm80-sm90 (platforms/cuda.py:
  _get_backend_priorities, CudaPlatformBase.get_attn_backend_cls). FlashAttention takes fp8
  only as FA3 on Hopper (flash_attn.py: supports_kv_cache_dtype), so fp8 runs FA3 on sm90 and
  FlashInfer on sm80/86/89; fp8_e5m2 runs FlashInfer everywhere; the *_per_token_head dtypes
  only Triton (triton_attn.py: TritonAttentionBackend.supported_kv_cache_dtypes), the
  turboquant_* ones only TurboQuant (turboquant_attn.py: supports_kv_cache_dtype).
- Triton stores fp8 natively only from sm89 and raises below it (triton_attn.py:
  TritonAttentionImpl.__init__), so fp8_per_token_head needs Ada or Hopper.
- TurboQuant forces FlashAttention 2 for its prefills (engine/arg_utils.py:
  EngineArgs.create_engine_config, "TurboQuant is not yet compatible with FlashAttention >= 3"),
  skips no layers of a hybrid model (quantization/turboquant/config.py:
  TurboQuantConfig.get_boundary_skip_layers) and has no speculative-verify path: its metadata
  builder asks for supports_spec_as_decode=False (turboquant_attn.py:
  TurboQuantMetadataBuilder.__init__), so every verify step of 1 + drafts tokens takes its
  per-request prefill loop (TurboQuantAttentionImpl._prefill_attention), which reads host-side
  sequence lengths that are only an upper bound under speculative decoding
  (v1/attention/backend.py: CommonAttentionMetadata.seq_lens_cpu_upper_bound, "Not safe for
  kernels that need exact per-row context lengths") and slices by them in Python, which a
  captured full CUDA graph of a verify step (TurboQuant declares UNIFORM_BATCH support) replays
  with the capture's lengths. Hence: TurboQuant only without speculation.
- KVarN (ours) serves speculation as decodes (kvarn/backend.py: verify blocks through the
  decode kernel at the device's exact lengths, the tile store planned from the host's upper
  bounds and decided on the device; kvarn/README.md, "Speculative decoding"). Its decode
  kernel is fitted (kvarn/fit.py: VERIFY_QUERIES) and GPU-checked at MTP's verify block of
  1 + 3 queries, and its server test speculates with MTP only: hence SPEC=mtp with at most 3
  drafts, and ngram / lookup (4 drafts by default, an n-gram drafter's path not run in a
  server with it) refused.
- The MTP drafter's attention backend: vLLM never gives it --attention-backend; it takes
  --speculative-config's attention_backend, else its own selector's pick
  (v1/spec_decode/llm_base_proposer.py: SpecDecodeBaseProposer._create_draft_vllm_config), with
  the target's cache dtype. For vLLM's dtypes the selector's pick takes that dtype (the
  *_per_token_head ones only Triton has); KVarN's pages only its backend sizes, so KV=kvarn names
  CUSTOM there too (drafter_backend), else the drafter's layer gets 16-bit pages that vLLM's
  page unification cannot fit to KVarN's (v1/core/kv_cache_utils.py:
  unify_kv_cache_spec_page_size; tests/test_kvarn_mtp_pages.py).
- int4_per_token_head rotates q, k, v and the attention output with a Hadamard transform
  (v1/attention/ops/int4_per_token_head.py: fast_hadamard_transform), on CUDA through
  _C.hadacore_transform, whose kernel gives each warp two 256-element chunks; the warp left
  with one (an odd chunk count) skips its cp.async wait and reads shared memory before its copy
  lands (vllm-project/vllm#53167, open for 0.26's kernel). On SmolLM2 (9 query heads of 64 per
  GPU) every answer came out garbage while prompt logprobs held
  (docs/results/2026-12-04-h200-smollm2-needle-kv.json). patches/int4-hadamard-even-chunks.patch
  pads every call to an even chunk count: with it the answers are no longer garbage
  (docs/results/2026-12-05-h200-smollm2-needle-kv-int4-kvarn.json) and the 27B's layouts
  rotate exactly, but one rotation of SmolLM2's 9 heads of 64 over 9,001 tokens was still
  wrong on the H200 (bench/measurements/2026-12-05-h200-hadacore.json).
  A rotated tensor is an even number of chunks at any token count when its heads per GPU x
  head_dim is a multiple of 512: head_layout_refusal refuses the rest until
  tests/test_hadacore_gpu.py passes on every layout.
- Prefix caching: Qwen3.5 runs it in "align" mode, which changes the recurrent state's blocks,
  not the attention cache (capacity.py); no backend above refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from hyperqwen.checkpoint.geometry import text_config
from hyperqwen.gpu import Gpu, cards_below

KvCacheDtype = Literal[
    "auto",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "int8_per_token_head",
    "fp8_per_token_head",
    "int4_per_token_head",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
# KV's values: vLLM's dtypes, and HyperQwen's own cache (src/hyperqwen/kvarn), which vLLM gets
# as an attention backend the package registers (its engine feature), its dtype left auto
KVARN_CHOICE = "kvarn"
KvChoiceName = Literal[KvCacheDtype, "kvarn"]

# The attention kernels each dtype runs on (Ampere/Ada sm80/86/89, Hopper sm90), where the
# launcher names no backend: vLLM's selector's first that takes it.
SELECTOR_PATHS = {
    "auto": ("FlashAttention 2", "FlashAttention 3"),
    "fp8": ("FlashInfer", "FlashAttention 3"),
    "fp8_e5m2": ("FlashInfer", "FlashInfer"),
}
TRITON = "TRITON_ATTN"
TURBOQUANT = "TURBOQUANT"
CUSTOM = "CUSTOM"  # vLLM's slot for a registered backend: KVarN's, with KV=kvarn
ADA = (8, 9)
SPECULATING = ("mtp", "ngram", "lookup")
# the widest verify block KVarN's decode kernel is fitted and checked for: 1 + 3 drafts
KVARN_MAX_DRAFTS = 3


@dataclass(frozen=True)
class KvChoice:
    dtype: str
    attention_backend: str | None  # --attention-backend it needs; None: vLLM's selector
    paths: tuple[str, str]  # the attention kernels it runs on Ampere/Ada and on Hopper
    min_capability: tuple[int, int] = (8, 0)
    speculation: tuple[str, ...] = SPECULATING  # the SPEC methods it serves with besides off
    cache_dtype: str = ""  # --kv-cache-dtype; "": the choice's own name
    # The MTP drafter's attention backend (--speculative-config attention_backend); None:
    # vLLM's selector. vLLM never gives the drafter --attention-backend
    # (v1/spec_decode/llm_base_proposer.py: _create_draft_vllm_config), so a cache whose
    # pages only its own backend sizes must name it here too, or the drafter's layer gets
    # 16-bit pages that vLLM cannot unify with the choice's.
    drafter_backend: str | None = None

    @property
    def vllm_cache_dtype(self) -> str:
        return self.cache_dtype or self.dtype

    def launch_flags(self) -> list[tuple[str, str]]:
        """Flags besides --kv-cache-dtype: the backend, and FA2 for TurboQuant's prefills
        (vLLM would force it with a warning)."""
        if self.attention_backend is None:
            return []
        flags = [("--attention-backend", self.attention_backend)]
        if self.attention_backend == TURBOQUANT:
            flags.append(("--attention-config", '{"flash_attn_version":2}'))
        return flags


def _choice(dtype: str) -> KvChoice:
    if dtype == KVARN_CHOICE:
        path = "KVarN (Triton decode and prefill)"
        return KvChoice(
            dtype, CUSTOM, (path, path), speculation=("mtp",), cache_dtype="auto",
            drafter_backend=CUSTOM,
        )  # fmt: skip
    if dtype.startswith("turboquant_"):
        path = "TurboQuant (Triton decode, FlashAttention 2 prefill)"
        return KvChoice(dtype, TURBOQUANT, (path, path), speculation=())
    if dtype.endswith("_per_token_head"):
        minimum = ADA if dtype.startswith("fp8") else (8, 0)
        return KvChoice(dtype, TRITON, ("Triton", "Triton"), minimum)
    return KvChoice(dtype, None, SELECTOR_PATHS["fp8" if dtype == "fp8_e4m3" else dtype])


KV_CHOICES: dict[str, KvChoice] = {
    dtype: _choice(dtype) for dtype in (*KV_CACHE_DTYPES, KVARN_CHOICE)
}


def speculation_refusal(kv: str, spec: str, drafts: int | None = None) -> str | None:
    """Why KV cannot serve with this SPEC (single mode) and `drafts` per step (None: the
    method's default), or None."""
    if kv == KVARN_CHOICE and spec == "mtp" and (drafts or 0) > KVARN_MAX_DRAFTS:
        return (
            f"KV=kvarn cannot serve with DRAFT_TOKENS={drafts}: KVarN's decode kernel reads "
            f"verify blocks of up to 1 + {KVARN_MAX_DRAFTS} queries, the width it is fitted to "
            "the card's shared memory and checked on a GPU at (src/hyperqwen/kvarn/fit.py). "
            f"Use DRAFT_TOKENS={KVARN_MAX_DRAFTS} or fewer with KV=kvarn."
        )
    if spec == "off" or spec in KV_CHOICES[kv].speculation:
        return None
    if kv == KVARN_CHOICE:
        return (
            f"KV=kvarn cannot serve with SPEC={spec}: KVarN speculates with MTP only, the "
            "drafter its server test runs and whose verify block (1 + 3 queries) its decode "
            f"kernel is fitted to; {spec}'s default 4 drafts are wider "
            "(src/hyperqwen/kv_choices.py). Use SPEC=mtp or SPEC=off with KV=kvarn."
        )
    instead = (
        "KV=kvarn, the smallest cache that serves with SPEC=mtp"
        if spec == "mtp"
        else f"KV=fp8 with SPEC={spec}"
    )
    return (
        f"KV={kv} cannot serve with SPEC={spec}: vLLM 0.26's TurboQuant attention has no "
        "speculative-verify path (it runs each verify step through its per-request prefill "
        "loop, on host-side sequence lengths that speculation makes approximate and that a "
        "captured CUDA graph cannot follow; src/hyperqwen/kv_choices.py). Use SPEC=off with "
        f"TurboQuant, or {instead}."
    )


INT4_ROTATED = "int4_per_token_head"
HADACORE_PAIR_ELEMENTS = 512  # two 256-element chunks: one warp's share in hadacore


def head_layout_refusal(kv: str, config: Mapping[str, Any], tensor_parallel: int) -> str | None:
    """Why KV cannot serve this model's attention heads split over `tensor_parallel` GPUs, or
    None: int4_per_token_head where a rotated tensor can be an odd number of hadacore chunks."""
    text = text_config(config)
    heads = text.get("num_attention_heads")
    if kv != INT4_ROTATED or not heads:
        return None
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_heads = text.get("num_key_value_heads") or heads
    per_gpu = {"query": heads // tensor_parallel, "KV": max(1, kv_heads // tensor_parallel)}
    odd = [
        f"{count} {label} heads of {head_dim}"
        for label, count in per_gpu.items()
        if count * head_dim % HADACORE_PAIR_ELEMENTS
    ]
    if not odd:
        return None
    return (
        f"KV={kv} with this model's {' and '.join(odd)} per GPU: vLLM 0.26 rotates those "
        "tensors through its hadacore Hadamard kernel, which reads before its copy lands when "
        "a tensor is an odd number of 256-element chunks (vllm-project/vllm#53167); even padded "
        "to even counts, a rotation of SmolLM2's heads of 64 still went wrong on the H200 "
        "(bench/measurements/2026-12-05-h200-hadacore.json). "
        "Use KV=int8_per_token_head (as good as bf16 there) or KV=fp8."
    )


def capability_refusal(kv: str, gpus: list[Gpu]) -> str | None:
    """Why KV cannot serve on these GPUs, or None."""
    needed = KV_CHOICES[kv].min_capability
    short = cards_below(gpus, needed)
    if not short:
        return None
    return (
        f"KV={kv} needs compute capability {needed[0]}.{needed[1]} or newer (Ada, Hopper): "
        "vLLM 0.26's Triton attention, the only backend that reads it, stores fp8 natively "
        f"only from sm89; this machine has {', '.join(short)}. Use KV=int8_per_token_head "
        "(the same size) or KV=fp8."
    )
