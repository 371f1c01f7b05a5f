"""KVarN as a vLLM 0.26 attention backend: the backend class, its metadata builder and its impl.

vLLM finds it through its own registry: the package's `vllm.general_plugins` entry point
(../vllm_plugin.py) calls `register_backend(AttentionBackendEnum.CUSTOM, ...)` with this
module's `KVarNBackend` when the launcher set HYPERQWEN_KV_KVARN=1 (`KV=kvarn`), and the
launcher passes `--attention-backend CUSTOM`, which vLLM applies to its `Attention` layers (the
full-attention ones; the GDN layers pick their backend from the mamba registry).

The pieces:
- KV cache: one tensor per layer, layout.py's pool uint8 [num_blocks, num_kv_heads, tile_bytes]
  with vLLM blocks of 128 tokens (the only kernel block size it declares); `kv_cache_spec`
  budgets a page as `TQFullAttentionSpec(tq_slot_size=slot_bytes)` does, block_size *
  num_kv_heads * slot_bytes bytes, uint8. The tiles' value bits are the process's
  (`served_layout`: HYPERQWEN_KVARN_V_BITS, which the launcher sets from KVARN_V_BITS), so the
  pages, the pool and the kernels agree.
- The side cache: 16-bit K and V tiles in a few slots per running request (sizing.py), one
  per layer; which slot holds which pool block (`slot_of_block`) is decided on the host by
  the builder's slots.SlotAllocator from the block tables and each request's token counts,
  once per step (per drafter pass) for all layers. Each impl allocates its layer's slots in
  vLLM's profile run (the forward without metadata), so vLLM's memory profile counts them
  among the non-KV memory and sizes the pool around them; ../capacity.py subtracts the same
  bytes.
- Each step (`forward`, which includes the cache update): every new token's K and V go to its
  tile's slot; then each tile the step fills (the allocator's plan: attention.blocks_to_store
  per request, the sink included) is quantized by store.py from its slot into the pool block
  the block table names; then decodes (query length up to 1 + drafts) run
  decode.decode_attention and prefills prefill_dequant.prefill_by_dequantization where vLLM has
  FlashAttention for the head size (dequantized tiles, FlashAttention), else
  prefill.prefill_attention (one launch for all of them).
- CUDA graphs (AttentionCGSupport.UNIFORM_BATCH): vLLM captures whole decode batches, verify
  blocks included, so everything the forward reads keeps its address (the builder's
  step_tensors.StepBuffers, written by one copy and one kernel a build) and its launch sizes
  (the store list padded to one entry per request with skipped entries, which the store
  kernel reads through the slots, so padding moves no bytes); a FULL graph's padded requests
  and vLLM's dummy batches (on its null block) plan nothing, and the padded ones read
  nothing.
  Prefills stay eager between piecewise graphs.

What is not handled yet, and why:
- The builder plans the slots from the runner's host block table, which vLLM 0.26 does not
  give a builder: patches/runner-host-block-table.patch adds it to CommonAttentionMetadata
  (`block_table_cpu`). Without it (stock vLLM, or a caller that rebuilds the metadata without
  it) the builder copies the device table's rows back, a copy that waits for the GPU's queue.
- vLLM's Attention layer builds its KV cache spec from the cache dtype, not from the backend
  (model_executor/layers/attention/attention.py: get_kv_cache_spec), and so does the hybrid
  page alignment (platforms/interface.py: _align_hybrid_block_size): serving needs a seam that
  asks the backend (`kv_cache_spec` below) in both places; without it vLLM sizes bf16 pages and
  the pool shape does not fit them.
- Prefill by dequantization (prefill_dequant.py, where vLLM has FlashAttention) is served;
  its plan (filling-tile groups, page tables: host work and one queued copy) is made by a
  step's first layer and kept on the metadata for the others. The prefill kernel
  (prefill.py) elsewhere is untuned.
- Speculative decoding (README, "Speculative decoding"): verify blocks are decodes, read at the
  device's exact lengths; the host's lengths are upper bounds under async scheduling, so the
  slot plan covers every tile the device may write or fill and the store skips, on the device,
  the candidates this step did not fill (step_tensors.py). Served with MTP (the drafter's
  builder plans its own layer's slots, `build_for_drafting`); kv_choices.py refuses n-gram
  drafters and more than 3 drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID, split_decodes_and_prefills

from hyperqwen.engine.kvarn_v_bits import value_bits
from hyperqwen.kvarn.decode import decode_attention
from hyperqwen.kvarn.layout import TILE_TOKENS, TileLayout
from hyperqwen.kvarn.prefill import prefill_attention
from hyperqwen.kvarn.prefill_dequant import (
    PrefillPlan,
    Scratch,
    plan_prefill,
    prefill_by_dequantization,
)
from hyperqwen.kvarn.side_write import write_side_rows
from hyperqwen.kvarn.sizing import serving_side_slots
from hyperqwen.kvarn.slots import RequestStep, SlotAllocator
from hyperqwen.kvarn.step_tensors import StepBuffers, write_step_tensors
from hyperqwen.kvarn.store import store_tiles

# vLLM resolves a layer's backend by this name (Attention.__init__: AttentionBackendEnum[name])
BACKEND_NAME = "CUSTOM"
HEAD_SIZES = (64, 128, 256)
# Decode's split-K programs per (request, KV head): as many as fill the GPU's multiprocessors
# once with the (request, KV head) pairs' 16-bit programs, since a long context is read by its
# splits alone and a C1 batch has only its 4 KV heads: of the H100's sweep at C1 (4 to 128
# splits at 32k and 112k), this count timed fastest, and the fixed 8 it replaces several
# times slower (docs/results/2026-12-06-h100-kvarn-decode-splits.json). At most
# MAX_DECODE_SPLITS. The count is fixed per batch size, as a CUDA graph captured for that
# size keeps it. Off the GPU (the interpreted tests), HOST_DECODE_SPLITS.
MAX_DECODE_SPLITS = 64
HOST_DECODE_SPLITS = 8


def decode_splits(num_reqs: int, kv_heads: int, multiprocessors: int) -> int:
    """Split-K programs per (request, KV head) for a decode batch of num_reqs requests."""
    wanted = multiprocessors // (num_reqs * kv_heads) - 1  # one 16-bit program per pair
    return max(1, min(MAX_DECODE_SPLITS, wanted))


def served_layout(head_size: int) -> TileLayout:
    """The tiles this process serves: head_size's, of this process's value bits (its variable,
    engine/kvarn_v_bits.py; a value it does not take is refused by name)."""
    return TileLayout(head_dim=head_size, v_bits=value_bits())


def flash_attention_serves(head_size: int) -> bool:
    """Whether vLLM's FlashAttention runs on this GPU for this head size (sm80 and later)."""
    from vllm.v1.attention.backends.fa_utils import (
        get_flash_attn_version,
        is_flash_attn_varlen_func_available,
    )

    return (
        is_flash_attn_varlen_func_available()
        and get_flash_attn_version(head_size=head_size) is not None
    )


class KVarNBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    # the layer's cache dtype stays auto: the pages are KVarN's whatever vLLM's dtype says
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[KVarNImpl]:
        return KVarNImpl

    @staticmethod
    def get_builder_cls() -> type[KVarNMetadataBuilder]:
        return KVarNMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return [TILE_TOKENS]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_SIZES)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        if block_size != TILE_TOKENS:
            raise ValueError(
                f"KVarN's kernel block is one {TILE_TOKENS}-token tile; vLLM asked for "
                f"{block_size} (KV=kvarn)"
            )
        return served_layout(head_size).pool_shape(num_blocks, num_kv_heads)

    @staticmethod
    def kv_cache_spec(block_size: int, num_kv_heads: int, head_size: int):
        """The layer's KV cache spec: uint8 pages of block_size * num_kv_heads * slot_bytes."""
        from vllm.v1.kv_cache_interface import TQFullAttentionSpec

        return TQFullAttentionSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            head_size_v=head_size,
            dtype=torch.uint8,
            tq_slot_size=served_layout(head_size).slot_bytes,
        )


@dataclass
class KVarNMetadata:
    """One step's batch, decodes first (the builder's reorder threshold is 1)."""

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    max_decode_query_len: int  # 1, or 1 + drafts with verify blocks
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 for padding
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor  # exact for the prefill rows (the only ones read from it)
    block_table_cpu: torch.Tensor  # int32: the host's rows, as many columns as the step reaches
    slot_of_block_cpu: torch.Tensor  # int32: the host's slot map (the plan's)
    num_slots: int  # the side cache's slots
    slot_of_block: torch.Tensor  # int32: slots.py's map after this step's plan
    side_rows: torch.Tensor  # int64 [num_tokens]: slot * 128 + offset; num_slots * 128 for padding
    store_blocks: torch.Tensor  # int64: the pool blocks this step fills; -1: a candidate it didn't
    store_slots: torch.Tensor  # int64: the slots their 16-bit tiles are in
    # prefill by dequantization's plan, made by the step's first layer for all (KVarNImpl)
    prefill_plan: PrefillPlan | None = None


def side_cache_slots(vllm_config) -> int:
    """The side cache's slots for this vLLM configuration (sizing.py)."""
    scheduler = vllm_config.scheduler_config
    speculative = vllm_config.speculative_config is not None
    return serving_side_slots(scheduler.max_num_seqs, scheduler.max_num_batched_tokens, speculative)


def pool_blocks(vllm_config) -> int:
    """The pool's 128-token blocks, which bound every block id a table holds: vLLM's worker
    sets cache_config.num_gpu_blocks (blocks of cache_config.block_size tokens, a multiple of
    the kernel block) before it builds the attention backends
    (v1/worker/gpu_worker.py: initialize_from_config)."""
    cache = vllm_config.cache_config
    if not cache.num_gpu_blocks or not cache.block_size:
        raise RuntimeError(
            "KV=kvarn's metadata builder needs the KV cache's size (cache_config.num_gpu_blocks "
            "and block_size), which vLLM sets before it builds the attention backends: its "
            "slot map has one entry per pool block"
        )
    return cache.num_gpu_blocks * (cache.block_size // TILE_TOKENS)


class KVarNMetadataBuilder(AttentionMetadataBuilder[KVarNMetadata]):
    # CUDA graphs of whole uniform decode batches (verify blocks included): the metadata
    # lives in StepBuffers, a padded request (vLLM's FULL graphs pad a batch to a captured
    # size with requests of no tokens) plans and reads nothing, and the store's launch has a
    # fixed size, padded with skipped entries
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # verify blocks (1 + drafts queries) are decodes: decode_attention reads each query
        # at its own context from the device's exact seq_lens
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        # one allocator per KV cache group: its layers share the block tables, so the slots
        # (the drafter builds its own builder for its layers, so it has its own allocator)
        num_slots, num_blocks = side_cache_slots(vllm_config), pool_blocks(vllm_config)
        self.slots = SlotAllocator(num_slots, num_blocks)
        self.buffers = StepBuffers(num_blocks, num_slots, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> KVarNMetadata:
        return self._build(common_attn_metadata, drafting=False)

    def build_for_drafting(
        self, common_attn_metadata: CommonAttentionMetadata, draft_index: int
    ) -> KVarNMetadata:
        """The drafter's passes (README, "Speculative decoding"): pass 0 has the verify step's
        batch; each later pass one query per request at host lengths grown by one from the
        verify step's upper bound, while the device's start from the accepted length."""
        return self._build(common_attn_metadata, drafting=draft_index > 0)

    def _request_steps(self, tables, seq_lens_cpu, query_lens, drafting) -> list[RequestStep]:
        """The step's requests for the slot allocator, from the host's lengths: exact for rows
        longer than a verify block (prefills), else upper bounds up to the previous step's
        drafts above the device's (in a later drafter pass, also this step's). A row on vLLM's
        null block writes no token and plans nothing: a FULL graph's padding (no tokens, a
        stale host length) and the dummy batches of warm-up and capture (slot mapping -1)."""
        afters = seq_lens_cpu.clamp(max=tables.shape[1] * TILE_TOKENS)
        befores = (afters - query_lens).clamp(min=0)
        drafts = self.reorder_batch_threshold - 1  # 0 without speculation
        rejectable = 2 * drafts if drafting else drafts
        steps = []
        for blocks, before, after, query_len in zip(
            tables.tolist(), befores.tolist(), afters.tolist(), query_lens.tolist(), strict=True
        ):
            if not blocks or blocks[0] == NULL_BLOCK_ID:
                continue
            if not drafts or query_len > self.reorder_batch_threshold:  # exact
                steps.append(RequestStep(blocks, before, after))
                continue
            # positions below the lowest possible start, and that start's own token (a verify
            # block's first is the last accepted), are final; a later drafter pass proves none
            final = 0 if drafting else max(before - rejectable, 0) + 1
            steps.append(RequestStep(blocks, before, after, rejectable, final))
        return steps

    def _build(self, cam: CommonAttentionMetadata, drafting: bool) -> KVarNMetadata:
        threshold = self.reorder_batch_threshold
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(cam, threshold)
        seq_lens_cpu = cam.seq_lens_cpu_upper_bound
        if seq_lens_cpu is None:
            seq_lens_cpu = cam.seq_lens.cpu()
        seq_lens_cpu = seq_lens_cpu[: cam.num_reqs]
        query_start_loc_cpu = cam.query_start_loc_cpu[: cam.num_reqs + 1]
        query_lens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
        if threshold > 1:
            check_decodes_first(seq_lens_cpu, query_lens, num_decodes, threshold)
        # a drafter pass past max_model_len writes nothing (vLLM's slot -1): the table's reach
        reach = cam.block_table_tensor.shape[1]
        width = min(-(-int(seq_lens_cpu.max()) // TILE_TOKENS), reach) if cam.num_reqs else 0
        tables = host_block_table(cam, width)
        slots = self.slots
        plan = slots.plan(self._request_steps(tables, seq_lens_cpu, query_lens, drafting))
        # one store entry per request at least: a decode batch's launch keeps its size
        stores = max(len(plan.store_blocks), cam.num_reqs)
        slot_of_block, side_rows, store_blocks, store_slots = write_step_tensors(
            self.buffers, plan, cam.slot_mapping, cam.seq_lens, cam.query_start_loc, stores,
            padding_row=slots.num_slots * TILE_TOKENS,
        )  # fmt: skip
        return KVarNMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            max_decode_query_len=int(query_lens[:num_decodes].max()) if num_decodes else 1,
            query_start_loc=cam.query_start_loc,
            seq_lens=cam.seq_lens,
            block_table=cam.block_table_tensor,
            slot_mapping=cam.slot_mapping,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
            block_table_cpu=tables,
            slot_of_block_cpu=plan.slot_of_block,
            num_slots=slots.num_slots,
            slot_of_block=slot_of_block,
            side_rows=side_rows,
            store_blocks=store_blocks,
            store_slots=store_slots,
        )


def host_block_table(cam: CommonAttentionMetadata, width: int) -> torch.Tensor:
    """The block table's rows (first `width` columns) on the host: the runner's own host
    mirror where patches/runner-host-block-table.patch passes it (README, "The host block
    table": the same rows as the device's, final when the builder runs), else a copy of the
    device's, which waits for the GPU's queue (stock vLLM, and callers that rebuild the
    metadata without it)."""
    host = getattr(cam, "block_table_cpu", None)  # absent from an unpatched vLLM's class
    table = host if host is not None else cam.block_table_tensor
    return table[: cam.num_reqs, :width].cpu()  # a no-op on a host tensor


def check_decodes_first(seq_lens_cpu, query_lens, num_decodes: int, threshold: int) -> None:
    """The prefill path reads the host's lengths, exact for prefill rows only: a verify-sized
    row with context after the decodes (vLLM's runner reorders by the least threshold of all
    builders, gpu_model_runner.calculate_reorder_batch_threshold; Qwen3.5's GDN builder asks
    for the same 1 + drafts) would be read at an upper bound. A first chunk (no context)
    is exact wherever it stands."""
    rest = query_lens[num_decodes:]
    misplaced = (rest <= threshold) & (seq_lens_cpu[num_decodes:] > rest)
    if bool(misplaced.any()):
        raise RuntimeError(
            f"KV=kvarn: a row of at most {threshold} tokens with context came after the "
            "batch's first prefill: vLLM reordered the batch by a smaller decode threshold "
            "than KVarN's, whose prefill path would read it at the host's upper bound"
        )


class SideCache:
    """One layer's 16-bit K and V tiles of the side cache's slots, [num_slots * 128 + 1, Hkv, D]
    each: slot s's token t is row s * 128 + t (the metadata's side_rows), and the last row
    takes the writes of padding tokens."""

    def __init__(self, num_slots: int, kv_heads: int, head_size: int, dtype, device) -> None:
        shape = (num_slots * TILE_TOKENS + 1, kv_heads, head_size)
        self.key = torch.empty(shape, dtype=dtype, device=device)
        self.value = torch.empty(shape, dtype=dtype, device=device)
        self.num_slots = num_slots

    def fits(self, num_slots: int, dtype: torch.dtype, device) -> bool:
        return (
            self.num_slots == num_slots
            and self.key.dtype == dtype
            and self.key.device == torch.device(device)
        )

    def tiles(self, rows: torch.Tensor) -> torch.Tensor:
        """rows viewed as [num_slots, 128, Hkv, D] (decode.py's side_k / side_v)."""
        return rows[: self.num_slots * TILE_TOKENS].view(
            self.num_slots, TILE_TOKENS, *rows.shape[1:]
        )


class KVarNImpl(AttentionImpl[KVarNMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **unused,
    ) -> None:
        refused = {
            "ALiBi": alibi_slopes is not None,
            "a sliding window": sliding_window is not None,
            "a logits soft cap": bool(logits_soft_cap),
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
            "KV sharing between layers": kv_sharing_target_layer_name is not None,
            f"kv_cache_dtype {kv_cache_dtype}": kv_cache_dtype != "auto",
        }
        if any(refused.values()):
            names = ", ".join(name for name, on in refused.items() if on)
            raise NotImplementedError(f"KV=kvarn's attention does not take {names}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.layout = served_layout(head_size)
        self.side: SideCache | None = None
        self.multiprocessors: int | None = None  # the GPU's, read at the first decode
        self.dequantized_prefill: bool | None = None  # decided at the first forward
        # the builder's slot count, known here when vLLM builds the model under its config
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        self.num_slots = side_cache_slots(config) if config is not None else None

    def _prefill_by_dequantization(self, device: torch.device) -> bool:
        """Prefill's path on this device: prefill_dequant.py (vLLM's FlashAttention over a
        dequantized scratch) where vLLM has FlashAttention for this head size, else
        prefill.py's kernel (the CPU's, where a test may set `dequantized_prefill` to run the
        former with attend_torch's attention)."""
        if self.dequantized_prefill is None:
            self.dequantized_prefill = device.type == "cuda" and flash_attention_serves(
                self.head_size
            )
        return self.dequantized_prefill

    def _decode_splits(self, num_reqs: int, device: torch.device) -> int:
        if device.type != "cuda":
            return HOST_DECODE_SPLITS
        if self.multiprocessors is None:
            self.multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
        return decode_splits(num_reqs, self.num_kv_heads, self.multiprocessors)

    def _side_cache(self, num_slots: int, dtype: torch.dtype, device) -> SideCache:
        if self.side is None or not self.side.fits(num_slots, dtype, device):
            self.side = None  # the old one's memory first
            self.side = SideCache(num_slots, self.num_kv_heads, self.head_size, dtype, device)
        return self.side

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KVarNMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("KV=kvarn's attention has no fused output quantization")
        if attn_metadata is None:  # vLLM's profile run: no cache yet
            if self.num_slots is not None:  # allocated now, the profile counts them (docstring)
                self._side_cache(self.num_slots, query.dtype, query.device)
                if self._prefill_by_dequantization(query.device):
                    Scratch.get(self.num_kv_heads, self.head_size, TILE_TOKENS, query.dtype,
                                query.device)  # fmt: skip
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_size
        # q, k and v may be column slices of one fused projection (vLLM splits qkv): reshape
        # keeps them views where it can
        q = query[:n].reshape(n, heads, d)
        out = output[:n].view(n, heads, d)
        side = self._side_cache(attn_metadata.num_slots, q.dtype, q.device)
        new_k, new_v = key[:n].reshape(n, kv_heads, d), value[:n].reshape(n, kv_heads, d)
        write_side_rows(side.key, side.value, attn_metadata.side_rows[:n], new_k, new_v)
        side_k, side_v = side.tiles(side.key), side.tiles(side.value)
        block_table, slot_of_block = attn_metadata.block_table, attn_metadata.slot_of_block

        if slot_of_block.shape[0] != kv_cache.shape[0]:
            raise RuntimeError(
                f"KV=kvarn: the builder's slot map covers {slot_of_block.shape[0]} pool blocks, "
                f"the layer's pool has {kv_cache.shape[0]} (backend.pool_blocks)"
            )
        if attn_metadata.store_blocks.numel():
            store_tiles(
                side_k, side_v, kv_cache, attn_metadata.store_blocks, self.layout,
                tile_ids=attn_metadata.store_slots,
            )  # fmt: skip

        decodes, decode_tokens = attn_metadata.num_decodes, attn_metadata.num_decode_tokens
        if decodes:
            decode_attention(
                q[:decode_tokens], kv_cache, block_table[:decodes], side_k, side_v,
                slot_of_block, attn_metadata.seq_lens[:decodes],
                attn_metadata.query_start_loc[: decodes + 1],
                attn_metadata.max_decode_query_len, self._decode_splits(decodes, q.device),
                scale=self.scale, out=out[:decode_tokens], layout=self.layout,
            )  # fmt: skip
        num_reqs = attn_metadata.seq_lens_cpu.shape[0]
        if num_reqs > decodes and self._prefill_by_dequantization(q.device):
            if attn_metadata.prefill_plan is None:
                attn_metadata.prefill_plan = plan_prefill(
                    attn_metadata.slot_of_block_cpu, attn_metadata.block_table_cpu,
                    attn_metadata.query_start_loc_cpu.tolist(),
                    attn_metadata.seq_lens_cpu.tolist(), range(decodes, num_reqs),
                    TILE_TOKENS, q.device,
                )  # fmt: skip
            prefill_by_dequantization(
                q, kv_cache, side_k, side_v, attn_metadata.prefill_plan, out, self.layout,
                scale=self.scale,
            )  # fmt: skip
        elif num_reqs > decodes:
            prefills = slice(decodes, num_reqs)
            starts = slice(decodes, prefills.stop + 1)
            prefill_attention(
                q, kv_cache, block_table[prefills], side_k, side_v, slot_of_block,
                attn_metadata.seq_lens[prefills], attn_metadata.query_start_loc[starts],
                scale=self.scale, out=out, layout=self.layout,
                host_query_start_loc=attn_metadata.query_start_loc_cpu[starts],
                host_seq_lens=attn_metadata.seq_lens_cpu[prefills],
            )  # fmt: skip
        return output
