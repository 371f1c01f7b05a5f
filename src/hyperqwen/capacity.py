"""How much context a card holds: vLLM 0.26's own sizing of a hybrid GDN + attention model.

Pure arithmetic, no I/O: from a model's geometry, its loaded weight bytes and the card's memory,
the bytes vLLM's KV-cache pool gets, how that pool is cut into blocks, and so how many tokens
fit at how many slots. Each step follows a named vLLM 0.26 function, so the numbers here are
the ones vLLM logs at startup ("GPU KV cache size: N tokens", "Maximum concurrency").

What makes a hybrid model differ from "KV bytes per token x tokens" (all in vLLM 0.26):
- One pool of equal pages serves both kinds of layer. A Gated DeltaNet layer's recurrent state
  (its "mamba page") is ~3 MiB, so the attention block grows until one block of one attention
  layer is at least that big (platforms/interface.py: _align_hybrid_block_size), e.g. 1600
  tokens with an fp8 cache, and the state page is padded up to it.
- Layers are grouped so every group has as many layers as the smallest kind (here the 16 or 17
  attention layers); the 48 GDN layers then fill 3 groups, padded to 17 when MTP's attention
  layer is the 17th (kv_cache_utils.py: _get_kv_cache_groups_uniform_page_size). A block is one
  page in each of the group-size tensors, whichever group uses it
  (kv_cache_utils.py: get_kv_cache_config_from_groups).
- Each request holds, in each GDN group, 1 + draft tokens state blocks, one more under prefix
  caching's "align" mode (kv_cache_interface.py: MambaSpec.max_memory_usage_bytes); under the
  replay verify one (two in "align"), whose page also holds the last verify's inputs.

What a launch takes from this (MAX_LEN, MAX_SEQS, tokens per step): capacity_fit.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from hyperqwen.checkpoint.geometry import Geometry
from hyperqwen.kv_choices import KV_CACHE_DTYPES, KVARN_CHOICE

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# Every CUDA attention backend vLLM picks for head_dim 256 (FlashAttention, FlashInfer, Triton,
# TurboQuant) takes 16-token kernel blocks, so the hybrid block is a multiple of 16 tokens
# (interface.py: _align_hybrid_block_size, kernel_block_alignment_size).
KERNEL_BLOCK_TOKENS = 16
# KVarN's backend takes only its 128-token tiles (kvarn/quantize.py: TILE_TOKENS; not imported
# here, which would load torch and Triton into every launch), of 2-bit values unless its value
# bits say otherwise (quantize.py: V_BITS; CacheSetup.v_bits)
KVARN_TILE_TOKENS = 128
KVARN_DEFAULT_VALUE_BITS = 2
# Qwen3.5 checkpoints are bfloat16: the conv state and an "auto" KV cache take the model dtype
# (mamba_utils.py: MambaStateDtypeCalculator._mamba_state_dtype).
MODEL_DTYPE_BYTES = 2
STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# TurboQuant presets: (key bits, value bits); 8-bit keys are stored as fp8
# (model_executor/layers/quantization/turboquant/config.py: TQ_PRESETS).
TURBOQUANT_BITS = {
    "turboquant_k8v4": (8, 4),
    "turboquant_4bit_nc": (4, 4),
    "turboquant_k3v4_nc": (3, 4),
    "turboquant_3bit_nc": (3, 3),
}

# The card PRINT_ARGV and a machine without a visible GPU size for: the smallest card the
# 27B model serves on (gpu.MIN_MEMORY_GIB_27B).
ASSUMED_CARD_BYTES = 24 * GiB
# Weights vLLM loads for the prepared 27B, text only, with MTP and the draft head ("Model
# loading took 15.31 GiB", docs/results/2026-12-01-h200-27b-single-overlap.json, patched
# weight_gib): the stand-in when the model folder is not there to count.
PREPARED_27B_WEIGHT_BYTES = int(15.31 * GiB)
# nvidia-smi's memory.total exceeds the total CUDA reports (cudaMemGetInfo), which vLLM
# multiplies by --gpu-memory-utilization (worker/utils.py: request_memory): by the driver's own
# reservation, 143,771 MiB against 139.8 GiB on the H200.
CUDA_UNREPORTED_BYTES = 640 * MiB
# vLLM keeps more than the checkpoint's tensors once loaded: "Model loading took 15.31 GiB" for
# the prepared 27B whose config declares 14.93 GiB (its draft head counted at bf16, as the engine
# holds it: drafter/step.py served_bytes), 17.62 GiB for its base's 17.26 (H200, dummy
# weights: bench/measurements/2026-12-03-h200-capacity-logs.json and
# 2026-12-03-h200-capacity-int8-refused.json). Read from vLLM's code and a meta-device build on the
# CPU, not yet checked on a GPU: a bf16 mrope cos/sin cache of 4 x max_position x rotary_dim
# (mrope.py, 0.125 GiB here) and the allocator's 2 MiB block rounding of each large tensor, which
# vLLM loads unsplit (gpu_worker.py: max_split_size_mb=20, ~0.24 GiB). Counted as this share of the
# weights, which covers both checkpoints.
LOAD_OVERHEAD_SHARE = 0.026
# Memory vLLM's profile finds besides weights and the cache (gpu_worker.py:
# determine_available_memory; it logs "Actual usage is ... GiB for peak activation, ... non-torch
# memory, and ... CUDAGraph memory"). Measured for the 27B in single mode at CTX=huge's 4096
# batched tokens on the H200 (2026-12-03-h200-capacity-logs.json, fp8-patched-at-176000): peak
# activation 1.31 GiB, non-torch 0.24 GiB, CUDA graphs 0.65 GiB estimated and 0.64 actual.
# Each constant below is that measurement with some room; batch mode's graphs are not measured.
# - non-torch memory: CUDA context growth, cuBLAS and Triton workspaces;
NON_TORCH_BYTES = 320 * MiB
# - the CUDA graphs single mode captures (FULL_AND_PIECEWISE up to 512 tokens, target + MTP);
CUDA_GRAPH_BYTES = 768 * MiB
# - peak activation of the profile run at max_num_batched_tokens: activation_bytes below counts
#   the MLP's tensors only, 0.42x of the measured peak (the Gated DeltaNet layers' chunked
#   prefill temporaries are not in it), so its count is scaled by this until they are.
ACTIVATION_SCALE = 2.4
# - the profile run's peak does not shrink with the step as that count does: at 2,048 tokens a
#   step the H100 left 4.16 GiB for the cache where the count promised 4.75 and vLLM refused the
#   length (bench/measurements/2026-12-08-h100-capacity-sized-single-refused.json: activation and
#   non-torch memory 1.48 GiB together, 1.55 at 4,096 tokens above). Until that term is found,
#   a smaller step is sized at this floor.
ACTIVATION_FLOOR_BYTES = 1280 * MiB


def attention_token_bytes(
    kv_cache_dtype: str, kv_heads: int, head_dim: int, v_bits: int = KVARN_DEFAULT_VALUE_BITS
) -> int:
    """Bytes one token's K and V take in one attention layer (kv_cache_interface.py:
    AttentionSpec.page_size_bytes at block_size 1; TQFullAttentionSpec for TurboQuant and
    KVarN, whose tiles hold values of v_bits)."""
    if kv_cache_dtype in ("auto", "bfloat16", "float16"):
        return 2 * kv_heads * head_dim * MODEL_DTYPE_BYTES
    if kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        return 2 * kv_heads * head_dim
    # Per-token-head modes add a float32 scale per token, head and K/V
    # (AttentionSpec.unpadded_page_size_bytes); int4 packs two values a byte.
    scales = 2 * kv_heads * 4
    if kv_cache_dtype in ("int8_per_token_head", "fp8_per_token_head"):
        return 2 * kv_heads * head_dim + scales
    if kv_cache_dtype == "int4_per_token_head":
        return 2 * kv_heads * (head_dim // 2) + scales
    if kv_cache_dtype in TURBOQUANT_BITS:
        return kv_heads * turboquant_slot_bytes(kv_cache_dtype, head_dim)
    if kv_cache_dtype == KVARN_CHOICE:  # the pool vLLM budgets; its side cache: kvarn_side_bytes
        from hyperqwen.kvarn.layout import TileLayout

        return kv_heads * TileLayout(head_dim=head_dim, v_bits=v_bits).slot_bytes
    raise ValueError(f"kv cache dtype {kv_cache_dtype!r}: expected one of {KV_CACHE_DTYPES}")


def turboquant_slot_bytes(kv_cache_dtype: str, head_dim: int) -> int:
    """K and V of one head and token, packed (TurboQuantConfig.slot_size_aligned): fp8 keys
    or MSE indices plus an fp16 norm; values at their bits plus fp16 scale and zero."""
    key_bits, value_bits = TURBOQUANT_BITS[kv_cache_dtype]
    key = head_dim if key_bits == 8 else math.ceil(head_dim * key_bits / 8) + 2
    value = math.ceil(head_dim * value_bits / 8) + 4
    return key + value + (key + value) % 2


def recurrent_state_bytes(g: Geometry, ssm_dtype: str, draft_tokens: int, tp: int = 1) -> int:
    """One GDN layer's state for one sequence: the conv window, which keeps a column per draft
    token (mamba_utils.py: MambaStateShapeCalculator.gated_delta_net_state_shape), in the
    model dtype, and the recurrent state in the SSM cache dtype (MambaSpec.page_size_bytes)."""
    conv_dim = 2 * g.linear_key_dim + g.linear_value_dim
    conv = conv_dim // tp * (g.linear_conv_kernel_dim - 1 + draft_tokens) * MODEL_DTYPE_BYTES
    recurrent = (
        g.linear_num_value_heads // tp * g.linear_value_head_dim * g.linear_key_head_dim
    ) * STATE_DTYPE_BYTES[ssm_dtype]
    return conv + recurrent


def state_blocks_per_request(draft_tokens: int, prefix_caching: bool, replay: bool = False) -> int:
    """State blocks one request holds in each GDN group: the running state, one more under
    prefix caching's "align" mode (the last cached one), and in vLLM one per draft token
    (MambaSpec.max_memory_usage_bytes); none per draft under the replay verify
    (engine/quoting.md, "GDN replay"), which keeps the committed state only."""
    return (2 if prefix_caching else 1) + (0 if replay else draft_tokens)


def replay_buffer_bytes(g: Geometry, draft_tokens: int, tp: int = 1) -> int:
    """One GDN layer's saved verify inputs for one request (the replay verify's ReplayBuffer,
    one slot): k, v, a and b of 1 + draft_tokens tokens, in the model dtype."""
    heads, v_heads = g.linear_num_key_heads // tp, g.linear_num_value_heads // tp
    token = heads * g.linear_key_head_dim + v_heads * g.linear_value_head_dim + 2 * v_heads
    return (1 + draft_tokens) * token * MODEL_DTYPE_BYTES


def gdn_verify_state_bytes(
    g: Geometry,
    ssm_dtype: str,
    draft_tokens: int,
    prefix_caching: bool,
    replay: bool,
    tp: int = 1,
) -> int:
    """One request's GDN state in one layer under speculative decoding, unpadded: vLLM's state
    blocks (each a conv window and a recurrent state) or the replay verify's, plus its saved
    inputs. Padding to the attention page (pool_layout) comes on top of either."""
    blocks = state_blocks_per_request(draft_tokens, prefix_caching, replay)
    saved = replay_buffer_bytes(g, draft_tokens, tp) if replay else 0
    return blocks * recurrent_state_bytes(g, ssm_dtype, draft_tokens, tp) + saved


@dataclass(frozen=True)
class CacheSetup:
    """The launch choices that shape the pool."""

    kv_cache_dtype: str
    ssm_dtype: str
    draft_tokens: int  # num_speculative_tokens, whatever the method
    mtp_layers: int  # attention layers the drafter adds (MTP: its own KV cache layer)
    prefix_caching: bool
    tensor_parallel: int = 1
    # the replay verify (an engine feature's one_gdn_state_per_request) with drafts: one state
    # block per request (two under prefix caching), its page holding the verify's inputs too
    replay: bool = False
    # the bits of each value in KVarN's tiles (an engine feature's kvarn_value_bits), whatever
    # the cache: `hyperqwen capacity` sizes kvarn beside it
    v_bits: int = KVARN_DEFAULT_VALUE_BITS

    @property
    def kv_name(self) -> str:
        """The KV cache as messages name it: its dtype, with KVarN's value bits."""
        if self.kv_cache_dtype == KVARN_CHOICE:
            return f"{KVARN_CHOICE}, {self.v_bits}-bit V"
        return self.kv_cache_dtype


@dataclass(frozen=True)
class PoolLayout:
    """How vLLM cuts its KV-cache pool for one model and setup."""

    block_tokens: int  # attention tokens per block (vLLM's aligned block_size)
    page_bytes: int  # one block of one layer: the attention page = the padded GDN state page
    state_bytes: int  # the unpadded GDN state page
    group_layers: int  # layers per KV-cache group = tensors the pool is split into
    attention_groups: int
    state_groups: int
    state_blocks_per_slot: int  # blocks each GDN group holds per request, as vLLM counts them
    # more that each GDN group holds while a request prefills: under prefix caching's "align"
    # mode the state of the chunk still in flight (async scheduling) when the next chunk's
    # blocks are allocated, which vLLM's count leaves out (tests/test_mamba_align_retire.py)
    prefill_state_blocks: int = 0

    @property
    def block_bytes(self) -> int:
        return self.page_bytes * self.group_layers

    @property
    def state_bytes_per_request(self) -> int:
        """The pool each request's recurrent (and conv) state takes, padded to whole blocks."""
        return self.state_groups * self.state_blocks_per_slot * self.block_bytes

    def blocks_per_request(self, max_len: int) -> int:
        """One request of max_len tokens as vLLM counts it (kv_cache_utils.py:
        _max_memory_usage_bytes_from_groups over FullAttentionSpec and
        MambaSpec.max_memory_usage_bytes)."""
        return (
            self.attention_groups * math.ceil(max_len / self.block_tokens)
            + self.state_groups * self.state_blocks_per_slot
        )

    @property
    def peak_state_blocks_per_slot(self) -> int:
        """The state blocks each GDN group holds for one request at its most (prefilling)."""
        return self.state_blocks_per_slot + self.prefill_state_blocks

    def peak_blocks_per_request(self, max_len: int) -> int:
        """One request of max_len tokens at its most: what must fit for it to run unpreempted."""
        return self.blocks_per_request(max_len) + self.state_groups * self.prefill_state_blocks


def state_terms(setup: CacheSetup) -> str:
    """What shapes the recurrent state's share of the pool, for messages."""
    caching = "on" if setup.prefix_caching else "off"
    replay = ", one state block per request" if setup.replay and setup.draft_tokens else ""
    return f"{setup.draft_tokens} draft tokens, prefix caching {caching}{replay}"


def pool_layout(g: Geometry, setup: CacheSetup) -> PoolLayout:
    tp = setup.tensor_parallel
    kv_heads = max(1, g.num_key_value_heads // tp)  # ModelConfig.get_num_kv_heads
    token_bytes = attention_token_bytes(setup.kv_cache_dtype, kv_heads, g.head_dim, setup.v_bits)
    replay = setup.replay and setup.draft_tokens > 0  # without drafts the layer keeps vLLM's page
    state = recurrent_state_bytes(g, setup.ssm_dtype, setup.draft_tokens, tp)
    if replay:
        state += replay_buffer_bytes(g, setup.draft_tokens, tp)
    # interface.py: _align_hybrid_block_size (no "all" mode: Qwen3.5 does not declare
    # SupportsMambaPrefixCaching, so prefix caching runs in "align" mode, same block size)
    align = KVARN_TILE_TOKENS if setup.kv_cache_dtype == KVARN_CHOICE else KERNEL_BLOCK_TOKENS
    block_tokens = align * math.ceil(state / (align * token_bytes))
    attention_layers = g.layer_types.count("full_attention") + setup.mtp_layers
    state_layers = g.layer_types.count("linear_attention")
    # kv_cache_utils.py: _get_kv_cache_groups_uniform_page_size
    fewest, most = sorted((attention_layers, state_layers))
    group_layers = most if most < fewest * 1.5 else fewest
    return PoolLayout(
        block_tokens=block_tokens,
        page_bytes=block_tokens * token_bytes,
        state_bytes=state,
        group_layers=group_layers,
        attention_groups=math.ceil(attention_layers / group_layers),
        state_groups=math.ceil(state_layers / group_layers),
        state_blocks_per_slot=state_blocks_per_request(
            setup.draft_tokens, setup.prefix_caching, replay
        ),
        prefill_state_blocks=1 if setup.prefix_caching else 0,
    )


def activation_bytes(g: Geometry, batched_tokens: int, tp: int = 1) -> int:
    """Estimated peak activation of vLLM's profile run (gpu_model_runner.py: profile_run, a
    forward pass of max_num_batched_tokens tokens): the MLP's gate/up output (2 x
    intermediate) and its SiLU product (1 x) beside ~4 hidden-size tensors, bf16, per token,
    scaled to the measured peak (ACTIVATION_SCALE), and never below the floor a smaller step
    was measured at (ACTIVATION_FLOOR_BYTES)."""
    per_token = MODEL_DTYPE_BYTES * (3 * g.intermediate_size // tp + 4 * g.hidden_size)
    return max(ACTIVATION_FLOOR_BYTES, math.ceil(batched_tokens * per_token * ACTIVATION_SCALE))


def kv_mem_bytes(text: str) -> int:
    """KV_MEM as vLLM reads --kv-cache-memory-bytes (argparse_utils.py: human_readable_int):
    K/M/G/T are powers of 1024, k/m/g/t powers of 1000 (decimals allowed), no suffix: bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if match is None:
        raise ValueError(f"KV_MEM={text!r}: expected bytes such as 6G or 6.5g")
    number, suffix = match.groups()
    if suffix.isupper():
        return int(number) * 1024 ** ("KMGT".index(suffix) + 1)
    return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1 if suffix else 0))


@dataclass(frozen=True)
class Machine:
    """What the budget needs from the machine; `hyperqwen serve` fills it (capacity_probe)."""

    card_bytes: int  # one GPU's memory.total as nvidia-smi reports it
    card: str  # how to name it in messages
    geometry: Geometry
    weight_bytes: int  # weights the model loads (on one GPU, or over tensor-parallel ones)
    weight_source: str  # where weight_bytes and the geometry came from
    card_assumed: bool = False  # no GPU seen: ASSUMED_CARD_BYTES stands in


@dataclass(frozen=True)
class Capacity:
    """The pool vLLM will allocate and what it holds."""

    layout: PoolLayout
    pool_bytes: int

    @property
    def blocks(self) -> int:
        """kv_cache_utils.py: get_num_blocks."""
        return max(self.pool_bytes // self.layout.block_bytes, 0)

    @property
    def usable_blocks(self) -> int:
        """Less block 0, the block pool's null block (block_pool.py: BlockPool)."""
        return max(self.blocks - 1, 0)

    def fits(self, max_len: int, slots: int) -> bool:
        """`slots` requests of `max_len` tokens each, all at once, each at its peak."""
        return slots * self.layout.peak_blocks_per_request(max_len) <= self.usable_blocks

    def max_len(self, slots: int) -> int:
        """The longest request of which `slots` fit at once (0: none)."""
        layout = self.layout
        attention_blocks = (
            self.usable_blocks // slots - layout.state_groups * layout.peak_state_blocks_per_slot
        ) // layout.attention_groups
        return max(attention_blocks, 0) * layout.block_tokens

    def slots(self, max_len: int) -> int:
        """How many requests of `max_len` tokens fit at once, each at its peak."""
        return self.usable_blocks // self.layout.peak_blocks_per_request(max_len)

    def vllm_concurrency(self, max_len: int) -> float:
        """vLLM's "Maximum concurrency for max_len tokens per request"
        (kv_cache_utils.py: get_max_concurrency_for_kv_cache_config)."""
        return self.blocks / self.layout.blocks_per_request(max_len)

    def vllm_tokens(self, max_len: int) -> int:
        """vLLM's "GPU KV cache size: N tokens" (kv_cache_utils.py: get_kv_cache_capacity)."""
        return int(self.vllm_concurrency(max_len) * max_len)


def kvarn_side_bytes(g: Geometry, setup: CacheSetup, max_seqs: int, batched_tokens: int) -> int:
    """KVarN's memory beside its pool: the 16-bit side cache over all its layers
    (kvarn/sizing.py) and the prefill's scratch, one for all layers (kvarn/prefill_dequant.py).
    Both are allocated in vLLM's profile run, so vLLM counts them among the non-KV memory and
    the pool is that much smaller (kvarn/backend.py)."""
    from hyperqwen.kvarn.sizing import scratch_bytes, serving_side_slots, side_cache_bytes

    kv_heads = max(1, g.num_key_value_heads // setup.tensor_parallel)
    layers = g.layer_types.count("full_attention") + setup.mtp_layers
    slots = serving_side_slots(max_seqs, batched_tokens, speculative=setup.draft_tokens > 0)
    return side_cache_bytes(slots, kv_heads, g.head_dim, layers) + scratch_bytes(
        kv_heads, g.head_dim
    )


def reserve_bytes(g: Geometry, batched_tokens: int, tp: int = 1) -> int:
    """Non-KV memory besides the weights (estimates; see the constants above)."""
    return NON_TORCH_BYTES + CUDA_GRAPH_BYTES + activation_bytes(g, batched_tokens, tp)


def card_pool_bytes(
    machine: Machine, gpu_util: float, batched_tokens: int, tp: int = 1
) -> tuple[int, str]:
    """The pool vLLM sizes from --gpu-memory-utilization (gpu_worker.py:
    determine_available_memory: total x util - weights - activation - non-torch - graphs),
    and the sum spelled out for messages. With tensor parallelism each GPU loads about
    1/tp of the weights (the vocabulary-parallel embedding and head shard too)."""
    requested = math.ceil((machine.card_bytes - CUDA_UNREPORTED_BYTES) * gpu_util)
    weights = machine.weight_bytes // tp
    reserve = reserve_bytes(machine.geometry, batched_tokens, tp)
    how = (
        f"{gib(requested)} GiB ({machine.card}, GPU_UTIL {gpu_util:g}) - {gib(weights)} GiB "
        f"weights ({machine.weight_source}) - {gib(reserve)} GiB activations, CUDA graphs and "
        "workspaces (estimated)"
    )
    return requested - weights - reserve, how


def with_load_overhead(checkpoint_bytes: int) -> int:
    """What vLLM holds after loading a checkpoint of this many bytes (LOAD_OVERHEAD_SHARE)."""
    return math.ceil(checkpoint_bytes * (1 + LOAD_OVERHEAD_SHARE))


def gib(size: int) -> str:
    return f"{size / GiB:.2f}"
