"""capacity.py: the card budget's arithmetic, by hand, for real card sizes, and against vLLM.

One test holds the launcher's pool to what vLLM logged on the H200 (docs/results' capacity
rows). The last tests build vLLM 0.26's own KV-cache configuration for the 27B geometry (its
real block-size alignment, grouping, block count and logged capacity) and compare.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import get_args

import pytest

from hyperqwen.capacity import (
    ACTIVATION_FLOOR_BYTES,
    ACTIVATION_SCALE,
    CUDA_GRAPH_BYTES,
    NON_TORCH_BYTES,
    PREPARED_27B_WEIGHT_BYTES,
    STATE_DTYPE_BYTES,
    CacheSetup,
    Capacity,
    GiB,
    Machine,
    MiB,
    activation_bytes,
    attention_token_bytes,
    card_pool_bytes,
    gib,
    kv_mem_bytes,
    kvarn_side_bytes,
    pool_layout,
    recurrent_state_bytes,
    replay_buffer_bytes,
    turboquant_slot_bytes,
)
from hyperqwen.capacity_fit import fit_to_card
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.engine import seams
from hyperqwen.engine.features import KVARN as KVARN_FEATURE
from hyperqwen.kv_choices import KV_CACHE_DTYPES, KVARN_CHOICE
from hyperqwen.settings import StateDtype

ROOT = Path(__file__).resolve().parents[1]
G27 = PRESETS["27b"]
MTP = CacheSetup("fp8", "float32", draft_tokens=3, mtp_layers=1, prefix_caching=True)
# memory.total as nvidia-smi lists it for a card of each class: RTX 3060 12GB, RTX 4080,
# RTX 4090, RTX 5090, RTX A6000, H100 80GB, H200
CARDS_MIB = {12: 12288, 16: 16376, 24: 24564, 32: 32607, 48: 49140, 80: 81559, 141: 143771}
# CTX=huge's max_num_batched_tokens (launch.SINGLE_PROFILES)
HUGE_BATCHED_TOKENS = 4096


def card(gb: int) -> Machine:
    return Machine(
        CARDS_MIB[gb] * MiB, f"{gb} GB card", G27, PREPARED_27B_WEIGHT_BYTES, "prepared 27B"
    )


def setup_for(kv: str, mtp: bool, prefix_caching: bool = True) -> CacheSetup:
    return CacheSetup(kv, "float32", 3 if mtp else 0, 1 if mtp else 0, prefix_caching)


def test_a_4_gib_pool_by_hand():
    """27B, fp8 KV, MTP with 3 drafts, prefix caching, float32 state, a 4 GiB pool."""
    # One token of one attention layer: K and V x 4 KV heads x 256 dims x 1 byte.
    assert attention_token_bytes("fp8", 4, 256) == 2 * 4 * 256 == 2048
    # One GDN layer's state: the conv window holds 2 x 16 x 128 key + 48 x 128 value channels
    # over kernel 4 - 1 + 3 drafts columns in bf16; the recurrent state 48 x 128 x 128 fp32.
    conv = (2 * 16 * 128 + 48 * 128) * (4 - 1 + 3) * 2
    recurrent = 48 * 128 * 128 * 4
    assert (conv, recurrent) == (122_880, 3_145_728)
    assert recurrent_state_bytes(G27, "float32", draft_tokens=3) == conv + recurrent == 3_268_608
    layout = pool_layout(G27, MTP)
    # The attention block grows in 16-token steps until its page holds one state:
    # 3,268,608 / (16 x 2048) = 99.75 -> 100 steps = 1600 tokens, a 3,276,800-byte page.
    assert layout.block_tokens == 16 * math.ceil(3_268_608 / (16 * 2048)) == 1600
    assert layout.page_bytes == 1600 * 2048 == 3_276_800
    # 16 attention layers + MTP's = 17, the smaller kind, so groups of 17 layers; the 48 GDN
    # layers fill ceil(48 / 17) = 3 groups. A block is a page in each of 17 tensors.
    assert (layout.group_layers, layout.attention_groups, layout.state_groups) == (17, 1, 3)
    assert layout.block_bytes == 17 * 3_276_800 == 55_705_600
    # Each request keeps, in each GDN group, the running state, the last cached one (align
    # mode) and one per draft token: 3 groups x 5 = 15 blocks.
    assert layout.state_blocks_per_slot == 5
    # While it prefills, each GDN group also holds the state of the chunk in flight: 18 blocks.
    assert layout.peak_state_blocks_per_slot == 6
    capacity = Capacity(layout, 4 * GiB)
    # 4 GiB / 55,705,600 = 77.1 -> 77 blocks, one of them vLLM's null block.
    assert (capacity.blocks, capacity.usable_blocks) == (77, 76)
    # One slot: 76 - 18 = 58 attention blocks x 1600 = 92,800 tokens.
    assert capacity.max_len(1) == (76 - 18) * 1600 == 92_800
    assert capacity.fits(92_800, 1) and not capacity.fits(92_801, 1)
    # vLLM's log at that length counts 15 state blocks: 77 blocks / (58 + 15) per request.
    assert capacity.vllm_concurrency(92_800) == 77 / 73
    assert capacity.vllm_tokens(92_800) == int(77 / 73 * 92_800) == 97_884
    # Two slots: 76 // 2 = 38 blocks each, 38 - 18 = 20 for attention.
    assert capacity.max_len(2) == 20 * 1600 == 32_000


def test_a_24_gb_card_by_hand():
    """CTX=huge on an RTX 4090 (24,564 MiB), GPU_UTIL 0.9, the prepared 27B's weights."""
    pool, how = card_pool_bytes(card(24), 0.9, HUGE_BATCHED_TOKENS)
    # vLLM asks for CUDA's total (nvidia-smi's less 640 MiB of driver reservation) x 0.9.
    requested = math.ceil((24_564 - 640) * MiB * 0.9)
    # Reserve: workspaces + CUDA graphs + 4096 batched tokens x 2 bytes x (3 x 17,408
    # intermediate + 4 x 5,120 hidden) of activations, scaled to the measured peak.
    activations = math.ceil(4096 * 2 * (3 * 17_408 + 4 * 5_120) * ACTIVATION_SCALE)
    reserve = NON_TORCH_BYTES + CUDA_GRAPH_BYTES + activations
    assert reserve == 2_570_269_492
    assert pool == requested - PREPARED_27B_WEIGHT_BYTES - reserve
    assert "GPU_UTIL 0.9" in how and "15.31 GiB weights" in how
    capacity = Capacity(pool_layout(G27, MTP), pool)
    usable = pool // 55_705_600 - 1
    assert capacity.max_len(1) == (usable - 18) * 1600  # 15 state blocks and 3 in flight
    # 262,144 tokens (CTX=huge's old number) need 164 + 18 blocks: far beyond this card.
    assert not capacity.fits(262_144, 1)


def test_a_smaller_step_keeps_the_measured_activation_floor():
    # The linear count halves from 4,096 tokens a step to 2,048; the peak vLLM found did not
    linear = 2 * (3 * 17_408 + 4 * 5_120) * ACTIVATION_SCALE
    assert activation_bytes(G27, 4096) == math.ceil(4096 * linear) > ACTIVATION_FLOOR_BYTES
    assert activation_bytes(G27, 2048) == ACTIVATION_FLOOR_BYTES > 2048 * linear


def test_the_pool_vllm_refused_at_2048_tokens_a_step_is_not_promised_again():
    """bench/measurements/2026-12-08-h100-capacity-sized-single-refused.json: the H100 at GPU_UTIL
    0.2733 (0.9 of a 24 GB card), the prepared 27B (15.31 GiB loaded), 2,048 tokens a step:
    vLLM left 4.16 GiB for the cache; the launcher had promised 4.75."""
    h100 = Machine(CARDS_MIB[80] * MiB, "H100", G27, PREPARED_27B_WEIGHT_BYTES, "prepared 27B")
    pool, how = card_pool_bytes(h100, 0.2733, 2048)
    assert "21.60 GiB" in how
    assert pool <= 4.16 * GiB


@pytest.mark.parametrize(
    ("kv", "token_bytes"),
    [
        ("auto", 4096),  # bf16
        ("fp8", 2048),
        ("int8_per_token_head", 2048 + 32),  # + a float32 scale per head for K and V
        ("int4_per_token_head", 1024 + 32),
        ("turboquant_k8v4", 4 * (256 + 128 + 4)),  # fp8 keys; 4-bit values + scale, zero
        ("turboquant_4bit_nc", 4 * (128 + 2 + 128 + 4)),  # 4-bit keys + fp16 norm
        ("turboquant_k3v4_nc", 4 * (96 + 2 + 128 + 4)),
        ("turboquant_3bit_nc", 4 * (96 + 2 + 96 + 4)),
    ],
)
def test_kv_token_bytes_per_choice(kv, token_bytes):
    assert attention_token_bytes(kv, 4, 256) == token_bytes


def test_turboquant_slots_round_up_to_even_bytes():
    # 64-dim heads, 3-bit keys: 24 + 2; 3-bit values: 24 + 4 -> 54, already even
    assert turboquant_slot_bytes("turboquant_3bit_nc", 64) == 54
    # 72-dim heads, 3-bit: 27 + 2 and 27 + 4 = 60; 4-bit values: 36 + 4 -> 29 + 40 = 69 -> 70
    assert turboquant_slot_bytes("turboquant_k3v4_nc", 72) == 70


def test_unknown_kv_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="'int2'"):
        attention_token_bytes("int2", 4, 256)


@pytest.mark.parametrize(
    ("text", "size"),
    [("6G", 6 * GiB), ("6g", 6 * 10**9), ("6.5g", 6_500_000_000), ("1024", 1024), ("3K", 3072)],
)
def test_kv_mem_reads_like_vllm(text, size):
    assert kv_mem_bytes(text) == size


CARD_CASES = list(itertools.product(CARDS_MIB, KV_CACHE_DTYPES, (True, False)))


@pytest.mark.parametrize(("gb", "kv", "mtp"), CARD_CASES)
def test_card_sizes(gb, kv, mtp):
    pool, _ = card_pool_bytes(card(gb), 0.9, HUGE_BATCHED_TOKENS)
    capacity = Capacity(pool_layout(G27, setup_for(kv, mtp)), pool)
    if gb <= 16:  # 15.3 GiB of weights leave a 12 or 16 GB card nothing
        assert pool < 0 and capacity.max_len(1) == 0 and not capacity.fits(1, 1)
        return
    longest = capacity.max_len(1)
    assert capacity.fits(longest, 1)
    assert not capacity.fits(longest + 1, 1)
    # vLLM counts the null block, leaves out the state of a chunk in flight and amortizes the
    # state over max_len: it logs a bit more
    layout = capacity.layout
    spare = 2 + layout.state_groups * layout.prefill_state_blocks
    assert longest <= capacity.vllm_tokens(longest) < longest + layout.block_tokens * spare
    for slots in (2, 4):
        assert capacity.fits(capacity.max_len(slots), slots) or capacity.max_len(slots) == 0
    bigger = [size for size in CARDS_MIB if size > gb]
    if bigger:
        pool_up, _ = card_pool_bytes(card(bigger[0]), 0.9, HUGE_BATCHED_TOKENS)
        assert Capacity(capacity.layout, pool_up).max_len(1) > longest


@pytest.mark.parametrize(
    ("gb", "holds"),
    # fp8 KV, MTP, prefix caching, CTX=huge's batch: tokens at one slot
    [(24, 72_000), (32, 289_600), (48, 737_600), (80, 1_616_000), (141, 3_302_400)],
)
def test_fp8_mtp_tokens_at_one_slot(gb, holds):
    pool, _ = card_pool_bytes(card(gb), 0.9, HUGE_BATCHED_TOKENS)
    assert Capacity(pool_layout(G27, MTP), pool).max_len(1) == holds


# `hyperqwen bench capacity` results: vLLM's own pool at a 24 GiB budget on the H200
MEASURED_CAPACITY = sorted((ROOT / "docs" / "results").glob("*-h200-27b-capacity-*.json"))
# what the launcher may leave unused of vLLM's pool (its reserve is an estimate from logs)
POOL_SLACK_BYTES = GiB // 2


@pytest.mark.parametrize("result", MEASURED_CAPACITY, ids=lambda path: path.stem)
def test_the_launcher_never_promises_more_pool_than_vllm_measured(result):
    """The budget's pool at the run's GPU_UTIL on the H200, MAX_SEQS 1 (KVarN's side cache
    taken off, as vLLM's profile does), against the pool vLLM logged: never larger (a length
    vLLM would refuse), and at most POOL_SLACK_BYTES smaller."""
    document = json.loads(result.read_text())
    util = float(re.search(r"GPU_UTIL ([0-9.]+)", document["gpu"]).group(1))
    logged = {row["name"]: row["patched"] for row in document["rows"]}
    measured = [
        name.removeprefix("capacity_").removesuffix("_kv_pool")
        for name, value in logged.items()
        if name.endswith("_kv_pool") and value is not None
    ]
    assert measured, f"{result.name}: no KV choice with a logged pool"
    for kv in measured:
        pool, _ = card_pool_bytes(card(141), util, HUGE_BATCHED_TOKENS)
        if kv == KVARN_CHOICE:
            pool -= kvarn_side_bytes(G27, setup_for(kv, True), 1, HUGE_BATCHED_TOKENS)
        vllm_pool = logged[f"capacity_{kv}_kv_pool"] * GiB
        assert vllm_pool - POOL_SLACK_BYTES <= pool <= vllm_pool, (kv, gib(pool), gib(vllm_pool))


def test_smaller_kv_dtypes_hold_more_tokens():
    pool, _ = card_pool_bytes(card(24), 0.9, HUGE_BATCHED_TOKENS)
    order = ["auto", "fp8", "int4_per_token_head", "turboquant_3bit_nc"]
    held = [Capacity(pool_layout(G27, setup_for(kv, True)), pool).max_len(1) for kv in order]
    assert held == sorted(held) and len(set(held)) == len(held)


def test_speculation_and_prefix_caching_cost_state_blocks():
    def blocks(draft_tokens, prefix_caching):
        setup = CacheSetup("fp8", "float32", draft_tokens, 1, prefix_caching)
        layout = pool_layout(G27, setup)
        return layout.state_groups * layout.state_blocks_per_slot

    assert blocks(0, False) == 3 * 1
    assert blocks(3, False) == 3 * 4
    assert blocks(3, True) == 3 * 5


def test_the_batch_profile_s_state_by_hand():
    """27B, fp8 KV, no drafts, prefix caching, a half-precision state (the batch profile)."""
    conv = (2 * 16 * 128 + 48 * 128) * (4 - 1) * 2
    recurrent = 48 * 128 * 128 * 2
    for dtype in ("bfloat16", "float16"):  # the same bytes
        layout = pool_layout(G27, CacheSetup("fp8", dtype, 0, 0, True))
        assert layout.state_bytes == conv + recurrent == 1_634_304
        # 1,634,304 / (16 x 2048) = 49.9 -> an 800-token, 1,638,400-byte page; 16 attention
        # layers, the smaller kind, make a group: a 25 MiB block
        assert (layout.block_tokens, layout.block_bytes) == (800, 16 * 1_638_400)
        # 3 GDN groups x (running + last cached state) = 6 blocks, 150 MiB
        assert layout.state_bytes_per_request == 6 * 25 * MiB
        # a 640-token request (the batch benchmark's) adds one attention block
        assert layout.blocks_per_request(640) == 7
    float32 = pool_layout(G27, CacheSetup("fp8", "float32", 0, 0, True))
    assert float32.state_bytes_per_request > 1.9 * layout.state_bytes_per_request


def test_every_state_dtype_vllm_takes_has_its_bytes():
    assert set(STATE_DTYPE_BYTES) == set(get_args(StateDtype))


def test_tensor_parallel_halves_heads_and_state():
    split = pool_layout(G27, CacheSetup("fp8", "float32", 3, 1, True, tensor_parallel=2))
    whole = pool_layout(G27, MTP)
    assert split.state_bytes == recurrent_state_bytes(G27, "float32", 3, tp=2)
    assert split.state_bytes * 2 == whole.state_bytes
    # 2 KV heads a GPU: half the bytes a token, half the state: the same block length
    assert split.block_tokens == whole.block_tokens


# --- against vLLM 0.26 itself ----------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_27b(tmp_path_factory):
    """A 27B config (no weights) and vLLM on its CPU platform; block_size 16 as on CUDA."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    from hyperqwen.checkpoint.synthesize import synthesize

    platforms._current_platform = CpuPlatform()
    directory = tmp_path_factory.mktemp("capacity") / "27b"
    return synthesize(directory, G27, config_only=True, progress=False).directory


def gdn_state_spec(config, draft_tokens: int, replay: bool = False):
    """The GDN layers' state spec as MambaBase.get_kv_cache_spec builds it from vLLM's config
    after its hybrid alignment, with one block per draft token (none under the replay verify,
    whose layer sets num_speculative_blocks to 0: engine/gdn_replay.py)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import MambaSpec

    model_class, _ = ModelRegistry.resolve_model_cls(
        config.model_config.architecture, model_config=config.model_config
    )
    cache = config.cache_config
    return MambaSpec(
        shapes=model_class.get_mamba_state_shape_from_config(config),
        dtypes=model_class.get_mamba_state_dtype_from_config(config),
        block_size=cache.mamba_block_size,
        page_size_padded=cache.mamba_page_size_padded,
        mamba_cache_mode=cache.mamba_cache_mode,
        num_speculative_blocks=0 if replay else draft_tokens,
    )


def vllm_kv_cache(model_dir, setup: CacheSetup, max_len: int, pool: int):
    """vLLM's own block-size alignment, layer specs, groups and KV-cache config."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        TQFullAttentionSpec,
        get_kv_quant_mode,
    )

    from hyperqwen.kvarn.backend import KVarNBackend

    draft = {"method": "mtp", "num_speculative_tokens": setup.draft_tokens}
    config = EngineArgs(
        model=str(model_dir),
        language_model_only=True,
        block_size=16,  # CUDA backends' block; vLLM's CPU platform would pick 128
        max_model_len=max_len,
        kv_cache_dtype="auto" if setup.kv_cache_dtype == KVARN_CHOICE else setup.kv_cache_dtype,
        mamba_ssm_cache_dtype=setup.ssm_dtype,
        enable_prefix_caching=setup.prefix_caching,
        speculative_config=draft if setup.draft_tokens else None,
    ).create_engine_config()
    turboquant = setup.kv_cache_dtype.startswith("turboquant_")
    backend = TurboQuantAttentionBackend if turboquant else TritonAttentionBackend
    kvarn = setup.kv_cache_dtype == KVARN_CHOICE
    if kvarn:  # the launcher's flags: cache dtype auto, KVarN's backend (the seam sizes it)
        config.cache_config.cache_dtype = "auto"
        backend = KVarNBackend
    CpuPlatform._align_hybrid_block_size(config, backend)
    cache = config.cache_config
    # the specs Attention.get_kv_cache_spec and MambaBase.get_kv_cache_spec build
    dtype = (
        torch.bfloat16
        if cache.cache_dtype == "auto" or turboquant
        else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype]
    )
    if kvarn:
        attention = seams.attention_kv_spec(backend, cache.block_size, 4, 256)
    elif turboquant:
        slot = TurboQuantConfig.from_cache_dtype(cache.cache_dtype, 256).slot_size_aligned
        attention = TQFullAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=4,
            head_size=256,
            dtype=dtype,
            tq_slot_size=slot,
        )
    else:
        attention = FullAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=4,
            head_size=256,
            dtype=dtype,
            kv_quant_mode=get_kv_quant_mode(cache.cache_dtype),
        )
    state = gdn_state_spec(config, setup.draft_tokens, setup.replay)
    specs = {f"attention.{i}": attention for i in range(16 + setup.mtp_layers)}
    specs |= {f"gdn.{i}": state for i in range(48)}
    (kv_cache,) = get_kv_cache_configs(config, [specs], [pool])
    return config, kv_cache


VLLM_CASES = list(
    itertools.product(
        (
            "auto",
            "fp8",
            "int8_per_token_head",
            "int4_per_token_head",
            "turboquant_k8v4",
            "turboquant_3bit_nc",
        ),
        (True, False),  # MTP
        (True, False),  # prefix caching
    )
)


# KV=kvarn serves with MTP (its layer's pool a KVarN one too: the launcher names KVarN the
# drafter's backend, tests/test_kvarn_mtp_pages.py) and without speculation
VLLM_CASES += [
    (KVARN_CHOICE, True, True),
    (KVARN_CHOICE, False, True),
    (KVARN_CHOICE, False, False),
]


@pytest.mark.parametrize(("kv", "mtp", "prefix_caching"), VLLM_CASES)
def test_vllm_sizes_the_pool_as_computed(vllm_27b, kv, mtp, prefix_caching, monkeypatch):
    monkeypatch.setenv(KVARN_FEATURE.env, "1" if kv == KVARN_CHOICE else "0")
    assert_vllm_sizes_the_pool_as_computed(vllm_27b, setup_for(kv, mtp, prefix_caching))


@pytest.fixture
def replay_models(monkeypatch):
    """vLLM's model registry with the replay verify's model classes, as the plugin registers
    them with GDN_REPLAY on (vLLM's own entries back afterwards)."""
    from vllm import ModelRegistry

    from hyperqwen.engine.gdn_replay import REPLAY_MODELS

    for architecture, model in REPLAY_MODELS.items():
        monkeypatch.setitem(ModelRegistry.models, architecture, ModelRegistry.models[architecture])
        ModelRegistry.register_model(architecture, model)


@pytest.mark.parametrize(
    ("kv", "drafts", "prefix_caching"),
    [
        ("fp8", 3, True),
        ("fp8", 3, False),
        ("fp8", 15, True),
        ("auto", 15, False),
        (KVARN_CHOICE, 3, True),
    ],
)
def test_vllm_sizes_the_replay_pool_as_computed(
    vllm_27b, replay_models, kv, drafts, prefix_caching, monkeypatch
):
    """GDN_REPLAY: one state block per request (two with prefix caching) whatever the drafts,
    its page the state and the last verify's inputs, which the attention block grows to hold."""
    monkeypatch.setenv(KVARN_FEATURE.env, "1" if kv == KVARN_CHOICE else "0")
    setup = CacheSetup(kv, "float32", drafts, 1, prefix_caching, replay=True)
    layout = pool_layout(G27, setup)
    vllms = pool_layout(G27, replace(setup, replay=False))
    assert layout.state_blocks_per_slot == (2 if prefix_caching else 1)
    assert layout.state_bytes == vllms.state_bytes + replay_buffer_bytes(G27, drafts)
    assert layout.state_bytes_per_request < vllms.state_bytes_per_request
    assert_vllm_sizes_the_pool_as_computed(vllm_27b, setup)


def test_vllm_sizes_a_pool_of_3_bit_kvarn_values_as_computed(vllm_27b, monkeypatch):
    """KVARN_V_BITS=3 (its variable, as the launcher sets it): 238 bytes per token and KV head
    at head_dim 256 (kvarn/layout.py), vLLM's alignment and KV cache config through the seam
    agree, and the pool holds less context than 2-bit values'."""
    from hyperqwen.engine.features import KVARN_V_BITS

    monkeypatch.setenv(KVARN_FEATURE.env, "1")
    monkeypatch.setenv(KVARN_V_BITS.env, "3")
    assert attention_token_bytes(KVARN_CHOICE, 4, 256, v_bits=3) == 4 * 238
    two = setup_for(KVARN_CHOICE, True)
    three = replace(two, v_bits=3)
    pool = 3 * GiB
    assert Capacity(pool_layout(G27, three), pool).max_len(1) < (
        Capacity(pool_layout(G27, two), pool).max_len(1)
    )
    assert_vllm_sizes_the_pool_as_computed(vllm_27b, three)


def test_replay_without_drafts_is_vllms_pool():
    """No speculation, nothing verifies: the layer keeps vLLM's page (gdn_layer_built)."""
    setup = CacheSetup("fp8", "float32", 0, 0, True, replay=True)
    assert pool_layout(G27, setup) == pool_layout(G27, replace(setup, replay=False))


def assert_vllm_sizes_the_pool_as_computed(model_dir, setup: CacheSetup) -> None:
    from vllm.v1.core.kv_cache_utils import (
        _estimate_max_model_len_from_groups,
        get_kv_cache_capacity,
    )

    capacity = Capacity(pool_layout(G27, setup), 3 * GiB + 12345)
    max_len = capacity.max_len(1)
    config, kv_cache = vllm_kv_cache(model_dir, setup, max_len, capacity.pool_bytes)
    layout = capacity.layout
    assert config.cache_config.block_size == layout.block_tokens
    assert config.cache_config.mamba_page_size_padded in (layout.page_bytes, None)
    assert layout.state_bytes <= layout.page_bytes
    groups = kv_cache.kv_cache_groups
    assert max(len(group.layer_names) for group in groups) == layout.group_layers  # padded
    assert len(groups) == layout.attention_groups + layout.state_groups
    assert kv_cache.num_blocks == capacity.blocks
    tokens, concurrency = get_kv_cache_capacity(config, kv_cache)
    assert (tokens, concurrency) == (
        capacity.vllm_tokens(max_len),
        capacity.vllm_concurrency(max_len),
    )
    # vLLM's own longest request uses the null block's room too, and the state blocks of a
    # chunk in flight, which ours keeps free (prefix caching): that many blocks more than ours
    config.model_config.max_model_len = G27.max_position_embeddings  # the search's upper end
    longest = _estimate_max_model_len_from_groups(config, groups, capacity.pool_bytes)
    spare = 1 + layout.state_groups * layout.prefill_state_blocks
    assert longest == max_len + layout.block_tokens * spare


def test_kvarn_pool_leaves_room_for_its_side_cache():
    """KV=kvarn: the impls allocate the side cache in vLLM's profile run, which counts it, so the
    pool is the card's less the side cache for the most sequences the launch may choose. At
    the 27B's 16 attention layers of 4 KV heads of 256 a slot is 8 MiB; 4 sequences at 4096
    batched tokens take 32 + 8 slots for the steps and 8 for cached sinks (kvarn/sizing.py),
    plus a padding row per layer; and the prefill's scratch, one for all layers: 256 tiles of
    bf16 K and V (128 MiB)."""
    from hyperqwen.settings import Settings

    setup = setup_for(KVARN_CHOICE, False)
    side = kvarn_side_bytes(G27, setup, 4, HUGE_BATCHED_TOKENS)
    scratch = 256 * 128 * 4 * 256 * 2 * 2
    assert scratch == 128 * MiB
    assert side == 48 * 8 * MiB + 16 * 2 * 4 * 256 * 2 + scratch
    settings = Settings(KV=KVARN_CHOICE, SPEC="off", MAX_SEQS=4, MAX_LEN=32768)
    fit = fit_to_card(card(48), settings, setup, (32768, 8), HUGE_BATCHED_TOKENS)
    pool, _ = card_pool_bytes(card(48), settings.GPU_UTIL, HUGE_BATCHED_TOKENS)
    assert (
        f"- {gib(side)} GiB KVarN side cache (4 sequences) and prefill scratch leaves "
        f"{gib(pool - side)} GiB"
    ) in fit.line
    # without MAX_SEQS, the profile's sequences
    unset = Settings(KV=KVARN_CHOICE, SPEC="off")
    line = fit_to_card(card(48), unset, setup, (32768, 8), HUGE_BATCHED_TOKENS).line
    assert f"{gib(kvarn_side_bytes(G27, setup, 8, HUGE_BATCHED_TOKENS))} GiB KVarN" in line
    # speculating, the MTP layer's side cache too, and a slot more per sequence (a filled
    # tile pinned until its drafts are known accepted): 32 + 12 + 8 slots over 17 layers
    speculating = kvarn_side_bytes(G27, setup_for(KVARN_CHOICE, True), 4, HUGE_BATCHED_TOKENS)
    assert speculating == 17 * (52 * MiB // 2 + 2 * 4 * 256 * 2) + scratch
    fp8 = Settings(KV="fp8", SPEC="off", MAX_SEQS=4, MAX_LEN=32768)
    line = fit_to_card(card(48), fp8, setup_for("fp8", False), (32768, 8), HUGE_BATCHED_TOKENS)
    assert "KVarN" not in line.line
