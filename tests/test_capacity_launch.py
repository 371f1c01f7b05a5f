"""The card budget in the launch: single mode's CTX profiles sized to the card, refusals before
vLLM starts, the machine probe (GPU memory, config.json, safetensors headers) and `hyperqwen
serve` (batch mode's sizing: test_capacity_batch.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import get_args

import pytest
from cli_runner import hyperqwen
from loaded_settings import loaded

from hyperqwen.capacity import (
    ASSUMED_CARD_BYTES,
    PREPARED_27B_WEIGHT_BYTES,
    Capacity,
    GiB,
    Machine,
    MiB,
    card_pool_bytes,
    kv_mem_bytes,
    pool_layout,
    with_load_overhead,
)
from hyperqwen.capacity_fit import (
    MIN_BATCHED_TOKENS,
    CapacityRefusal,
    step_budgets,
)
from hyperqwen.capacity_probe import loaded_weight_bytes, probe_machine
from hyperqwen.checkpoint.config_json import build_config
from hyperqwen.checkpoint.geometry import PRESETS
from hyperqwen.gpu import Gpu
from hyperqwen.kv_choices import KV_CACHE_DTYPES, KV_CHOICES
from hyperqwen.launch import SINGLE_PROFILES, build_launch
from hyperqwen.prepare.folder import DRAFT_HEAD_FILE
from hyperqwen.settings import Settings, StateDtype

G27 = PRESETS["27b"]
RTX_4090 = Machine(24_564 * MiB, "RTX 4090", G27, PREPARED_27B_WEIGHT_BYTES, "prepared 27B")
H200 = Machine(143_771 * MiB, "H200", G27, PREPARED_27B_WEIGHT_BYTES, "prepared 27B")
ASSUMED = Machine(ASSUMED_CARD_BYTES, "assumed", G27, PREPARED_27B_WEIGHT_BYTES, "27B", True)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def capacity_for(machine: Machine, ctx: str, tokens: int | None = None, **setup) -> Capacity:
    """What the launch should size from: CTX's profile, MTP with 3 drafts, prefix caching,
    unless `setup` says otherwise, at `tokens` per step (default: the profile's)."""
    from hyperqwen.capacity import CacheSetup

    profile = SINGLE_PROFILES[ctx]
    cache = CacheSetup(profile.kv_cache_dtype, profile.ssm_cache_dtype, 3, 1, True)
    cache = replace(cache, **setup)
    pool, _ = card_pool_bytes(machine, 0.9, tokens or profile.max_batched_tokens)
    return Capacity(pool_layout(G27, cache), pool)


def steps(argv: list[str]) -> int:
    """The tokens per step a launch chose."""
    return int(flag(argv, "--max-num-batched-tokens"))


def test_fast_on_a_24_gb_card_takes_what_fits():
    """CTX=fast's 65,536 tokens at 4 slots of bf16 KV is more than a 24 GB card leaves beside
    the 27B, even at 2,048 tokens a step: fewer tokens a step, then fewer slots, then a shorter
    length at one slot, as for long and huge."""
    assert not capacity_for(RTX_4090, "fast").fits(65_536, 1)
    capacity = capacity_for(RTX_4090, "fast", MIN_BATCHED_TOKENS)
    assert not capacity.fits(65_536, 1)
    plan = build_launch(loaded(CTX="fast"), "single", api_key=None, machine=RTX_4090)
    assert steps(plan.argv) == MIN_BATCHED_TOKENS
    fits = capacity.max_len(1) // 1024 * 1024
    assert flag(plan.argv, "--max-model-len") == str(fits)
    assert flag(plan.argv, "--max-num-seqs") == "1"
    (line,) = [notice for notice in plan.notices if "this card holds" in notice]
    assert line.startswith(f"CTX=fast: this card holds {fits:,} tokens at 1 slot")
    assert "Steps of at most 2,048 tokens (--max-num-batched-tokens; the profile's 8,192" in line


def test_step_budgets_halve_from_the_profile_s_to_the_floor_never_below_a_block():
    assert step_budgets(8192, 800) == [8192, 4096, 2048]
    assert step_budgets(4096, 1600) == [4096, 2048]
    assert step_budgets(8192, 3200) == [8192, 4096]
    assert step_budgets(4096, 3968) == [4096]


def test_fewer_tokens_a_step_come_before_fewer_slots():
    """On a 32 GB card CTX=fast's 65,536 tokens fit one slot at the profile's 8,192 tokens a
    step and two at 2,048: neither holds its four slots, so the launch takes the floor's two."""
    rtx_5090 = Machine(32_607 * MiB, "RTX 5090", G27, PREPARED_27B_WEIGHT_BYTES, "prepared 27B")
    assert capacity_for(rtx_5090, "fast").slots(65_536) == 1
    slots = capacity_for(rtx_5090, "fast", MIN_BATCHED_TOKENS).slots(65_536)
    assert 1 < slots < 4
    argv = build_launch(loaded(CTX="fast"), "single", api_key=None, machine=rtx_5090).argv
    assert (flag(argv, "--max-model-len"), flag(argv, "--max-num-seqs")) == ("65536", str(slots))
    assert steps(argv) == MIN_BATCHED_TOKENS


def test_the_largest_budget_that_holds_the_knobs_is_taken():
    """MAX_SEQS=1 with CTX=fast on a 32 GB card fits at the profile's 8,192 tokens a step,
    which the launch keeps (prefill steps stay as large as the card allows)."""
    rtx_5090 = Machine(32_607 * MiB, "RTX 5090", G27, PREPARED_27B_WEIGHT_BYTES, "prepared 27B")
    argv = build_launch(loaded(CTX="fast", MAX_SEQS="1"), "single", None, machine=rtx_5090).argv
    assert (flag(argv, "--max-model-len"), steps(argv)) == ("65536", 8192)


def test_fast_knobs_beyond_the_card_are_refused_naming_them():
    with pytest.raises(CapacityRefusal, match=r"^MAX_LEN=200000 with MAX_SEQS=9 does not fit"):
        build_launch(
            loaded(CTX="fast", MAX_LEN="200000", MAX_SEQS="9"), "single", None, machine=RTX_4090
        )


@pytest.mark.parametrize("ctx", ["fast", "long", "huge"])
def test_a_card_that_holds_the_profile_keeps_its_numbers(ctx):
    plain = build_launch(loaded(CTX=ctx), "single", api_key=None)
    sized = build_launch(loaded(CTX=ctx), "single", api_key=None, machine=H200)
    assert sized.argv == plain.argv
    profile = SINGLE_PROFILES[ctx]
    (line,) = [notice for notice in sized.notices if "this card holds" in notice]
    slots = "slots" if profile.max_seqs > 1 else "slot"
    assert (
        f"CTX={ctx}: this card holds {profile.max_len:,} tokens at {profile.max_seqs} {slots}"
        in line
    )
    assert "H200, GPU_UTIL 0.9" in line and "GPU KV cache size: " in line


def test_kvarn_is_sized_at_its_value_bits():
    """KV=kvarn on a 24 GB card at CTX=huge (one slot): with KVARN_V_BITS=3 its pool holds the
    tiles of 3-bit values, a sixth more bytes a token, so less context, and the startup line
    names the bits it sized for."""
    held = {}
    for bits in ("2", "3"):
        plan = build_launch(loaded(CTX="huge", KV="kvarn", KVARN_V_BITS=bits), "single", None,
                            machine=RTX_4090)  # fmt: skip
        assert f"for the KV cache (kvarn, {bits}-bit V)" in plan.fit.line
        held[bits] = plan.fit.max_len
    assert 0.8 * held["2"] < held["3"] < held["2"]


def test_huge_on_a_24_gb_card_takes_what_fits():
    argv = build_launch(loaded(CTX="huge"), "single", api_key=None, machine=RTX_4090).argv
    assert steps(argv) == MIN_BATCHED_TOKENS
    fits = capacity_for(RTX_4090, "huge", MIN_BATCHED_TOKENS).max_len(1) // 1024 * 1024
    assert 65_536 < fits < 131_072
    assert flag(argv, "--max-model-len") == str(fits)
    assert flag(argv, "--max-num-seqs") == "1"
    # everything else is CTX=huge's
    plain = build_launch(loaded(CTX="huge"), "single", api_key=None).argv
    sized = {str(fits), str(MIN_BATCHED_TOKENS)}
    assert [t for t in argv if t not in sized] == [t for t in plain if t not in {"262144", "4096"}]


@pytest.mark.parametrize("kv", KV_CACHE_DTYPES)
def test_huge_sizes_with_the_chosen_kv(kv):
    """KV= shapes the pool CTX=huge is fitted to: its bytes a token (capacity.py's
    attention_token_bytes) and, for TurboQuant, no drafts (it serves only with SPEC=off)."""
    spec = "mtp" if KV_CHOICES[kv].speculation else "off"
    argv = build_launch(loaded(CTX="huge", KV=kv, SPEC=spec), "single", None, machine=RTX_4090).argv
    drafts = {} if spec == "mtp" else dict(draft_tokens=0, mtp_layers=0)
    capacity = capacity_for(RTX_4090, "huge", steps(argv), kv_cache_dtype=kv, **drafts)
    assert steps(argv) in step_budgets(4096, capacity.layout.block_tokens)
    assert flag(argv, "--max-model-len") == str(min(262_144, capacity.max_len(1) // 1024 * 1024))
    assert flag(argv, "--kv-cache-dtype") == kv


@pytest.mark.parametrize("state", get_args(StateDtype))
def test_huge_sizes_with_the_chosen_state_dtype(state):
    """STATE_DTYPE= reaches --mamba-ssm-cache-dtype and the pool CTX=huge is fitted to: the
    state page, hence the block, and the longest request that fits."""
    argv = build_launch(
        loaded(CTX="huge", STATE_DTYPE=state), "single", None, machine=RTX_4090
    ).argv
    capacity = capacity_for(RTX_4090, "huge", steps(argv), ssm_dtype=state)
    assert flag(argv, "--max-model-len") == str(capacity.max_len(1) // 1024 * 1024)
    assert flag(argv, "--mamba-ssm-cache-dtype") == state


def test_a_half_precision_state_fits_more_on_the_same_card():
    lengths = {
        state: flag(
            build_launch(
                loaded(CTX="huge", STATE_DTYPE=state), "single", None, machine=RTX_4090
            ).argv,
            "--max-model-len",
        )
        for state in ("float32", "bfloat16", "float16")
    }
    assert lengths["bfloat16"] == lengths["float16"]  # same bytes
    assert int(lengths["bfloat16"]) > int(lengths["float32"])


@pytest.mark.parametrize("drafts", ["3", "15"])
def test_gdn_replay_sizes_with_one_state_block_per_request(drafts):
    """GDN_REPLAY=1 keeps one state block per request (two with prefix caching) instead of one
    per draft: the launch sizes CTX=huge from that pool, says so, and fits more on the card."""
    plans = {
        replay: build_launch(
            loaded(CTX="huge", DRAFT_TOKENS=drafts, GDN_REPLAY=replay), "single", None,
            machine=RTX_4090,
        )
        for replay in ("0", "1")
    }  # fmt: skip
    argv = plans["1"].argv
    capacity = capacity_for(RTX_4090, "huge", steps(argv), draft_tokens=int(drafts), replay=True)
    assert capacity.layout.state_blocks_per_slot == 2
    assert flag(argv, "--max-model-len") == str(capacity.max_len(1) // 1024 * 1024)
    phrase = "one state block per request"
    assert phrase in plans["1"].fit.line and phrase not in plans["0"].fit.line
    lengths = {replay: int(flag(plan.argv, "--max-model-len")) for replay, plan in plans.items()}
    assert lengths["1"] > lengths["0"]


@pytest.mark.parametrize(("mode", "profile"), [("single", "float32"), ("batch", "bfloat16")])
def test_state_dtype_auto_is_the_profile_s(mode, profile):
    for values in ({}, {"STATE_DTYPE": "auto"}):
        plan = build_launch(loaded(**values), mode, api_key=None)
        assert flag(plan.argv, "--mamba-ssm-cache-dtype") == profile


def test_a_state_dtype_shadowed_by_extra_args_names_state_dtype():
    plan = build_launch(
        loaded(STATE_DTYPE="float16", EXTRA_ARGS="--mamba-ssm-cache-dtype float32"),
        "batch",
        api_key=None,
    )
    assert any("STATE_DTYPE" in warning for warning in plan.warnings), plan.warnings


def test_long_trades_slots_before_length():
    # 32 GB: 131,072 tokens fit at one or more slots, not at four
    rtx_5090 = Machine(32_607 * MiB, "RTX 5090", G27, PREPARED_27B_WEIGHT_BYTES, "prepared 27B")
    argv = build_launch(loaded(CTX="long"), "single", api_key=None, machine=rtx_5090).argv
    slots = capacity_for(rtx_5090, "long", steps(argv)).slots(131_072)
    assert 1 <= slots < 4
    assert (flag(argv, "--max-model-len"), flag(argv, "--max-num-seqs")) == ("131072", str(slots))


def test_max_len_set_alone_takes_the_slots_that_fit():
    argv = build_launch(
        loaded(CTX="long", MAX_LEN="20000"), "single", api_key=None, machine=RTX_4090
    ).argv
    assert flag(argv, "--max-model-len") == "20000"
    slots = capacity_for(RTX_4090, "long", steps(argv)).slots(20000)
    assert flag(argv, "--max-num-seqs") == str(slots) and 1 <= slots < 4


def test_max_seqs_set_alone_takes_the_length_that_fits():
    argv = build_launch(
        loaded(CTX="huge", MAX_SEQS="2"), "single", api_key=None, machine=RTX_4090
    ).argv
    assert flag(argv, "--max-num-seqs") == "2"
    fits = capacity_for(RTX_4090, "huge", steps(argv)).max_len(2) // 1024 * 1024
    assert flag(argv, "--max-model-len") == str(fits)


def test_a_max_len_beyond_the_card_is_refused_naming_the_knob_and_the_fit():
    with pytest.raises(CapacityRefusal) as refusal:
        build_launch(loaded(CTX="huge", MAX_LEN="262144"), "single", None, machine=RTX_4090)
    fits = capacity_for(RTX_4090, "huge", MIN_BATCHED_TOKENS).max_len(1)  # the floor holds most
    message = str(refusal.value)
    assert message.startswith("MAX_LEN=262144 does not fit: ")
    assert f"holds {fits:,} tokens at 1 slot" in message
    assert f"Set MAX_LEN={fits // 1024 * 1024} or less" in message and "GPU_UTIL" in message
    assert "RTX 4090" in message and "15.31 GiB weights" in message


def test_max_len_with_max_seqs_beyond_the_card_names_both():
    with pytest.raises(CapacityRefusal, match=r"^MAX_LEN=65536 with MAX_SEQS=4 does not fit: "):
        build_launch(
            loaded(CTX="long", MAX_LEN="65536", MAX_SEQS="4"), "single", None, machine=RTX_4090
        )


def test_too_many_slots_are_refused():
    with pytest.raises(CapacityRefusal, match=r"^MAX_SEQS=64 does not fit: .*Lower MAX_SEQS"):
        build_launch(loaded(CTX="huge", MAX_SEQS="64"), "single", None, machine=RTX_4090)


def test_a_card_without_room_for_the_weights_refuses_ctx():
    card_16gb = Machine(16_376 * MiB, "RTX 4080", G27, PREPARED_27B_WEIGHT_BYTES, "prepared 27B")
    with pytest.raises(CapacityRefusal, match=r"^CTX=huge does not fit: .* leaves 0\.00 GiB"):
        build_launch(loaded(CTX="huge"), "single", None, machine=card_16gb)


def test_an_assumed_card_warns_instead_of_refusing():
    plan = build_launch(loaded(CTX="huge", MAX_LEN="262144"), "single", None, machine=ASSUMED)
    assert flag(plan.argv, "--max-model-len") == "262144"
    (warning,) = plan.warnings
    assert warning.startswith("MAX_LEN=262144 does not fit")
    assert warning.endswith("(the server checks its own card at start)")


def test_kv_mem_sizes_exactly_and_refuses_even_on_an_assumed_card():
    kv_mem = kv_mem_bytes("3G")
    profile = SINGLE_PROFILES["huge"]
    from hyperqwen.capacity import CacheSetup

    cache = CacheSetup(profile.kv_cache_dtype, profile.ssm_cache_dtype, 3, 1, True)
    fits = Capacity(pool_layout(G27, cache), kv_mem).max_len(1)
    argv = build_launch(loaded(CTX="huge", KV_MEM="3G"), "single", None, machine=ASSUMED).argv
    assert flag(argv, "--max-model-len") == str(fits // 1024 * 1024)
    assert steps(argv) == profile.max_batched_tokens  # a fixed pool gains nothing from fewer
    with pytest.raises(CapacityRefusal, match=r"^MAX_LEN=262144 does not fit: KV_MEM=3G leaves"):
        build_launch(
            loaded(CTX="huge", KV_MEM="3G", MAX_LEN="262144"), "single", None, machine=ASSUMED
        )
    # the fix it names is the knob that sizes the pool: GPU_UTIL sizes nothing beside KV_MEM
    for knobs in ({"MAX_LEN": "262144"}, {"MAX_LEN": "262144", "MAX_SEQS": "2"}):
        with pytest.raises(CapacityRefusal) as refused:
            build_launch(loaded(CTX="huge", KV_MEM="3G", **knobs), "single", None, machine=ASSUMED)
        assert "raise KV_MEM" in str(refused.value) and "GPU_UTIL" not in str(refused.value)


def test_tensor_parallel_sizes_each_gpu():
    two = build_launch(loaded(CTX="huge", GPU_COUNT="2"), "single", None, machine=RTX_4090).argv
    one = build_launch(loaded(CTX="huge"), "single", None, machine=RTX_4090).argv
    assert int(flag(two, "--max-model-len")) > 2 * int(flag(one, "--max-model-len"))


def test_a_model_the_budget_does_not_know_keeps_the_profile():
    plan = build_launch(loaded(CTX="huge"), "single", None, machine="x/config.json is not Qwen")
    assert flag(plan.argv, "--max-model-len") == "262144"
    assert "CTX=huge: not sized to the card: x/config.json is not Qwen." in plan.notices


# --- the probe -----------------------------------------------------------------------------


def write_model(folder, tensors_by_file: dict[str, dict[str, int]]) -> None:
    """A config.json and safetensors files of bf16 vectors of the given lengths."""
    import torch

    from hyperqwen.checkpoint.shards import write_shard

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(build_config(PRESETS["tiny"])))
    for name, tensors in tensors_by_file.items():
        write_shard(
            folder / name, {key: torch.zeros(n, dtype=torch.bfloat16) for key, n in tensors.items()}
        )


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "model"
    write_model(
        folder,
        {
            "model-00001-of-00002.safetensors": {"model.language_model.a": 100, "mtp.b": 10},
            "model-00002-of-00002.safetensors": {"model.visual.c": 1000, "lm_head.weight": 50},
            DRAFT_HEAD_FILE: {"weight": 7},
        },
    )
    return folder


@pytest.mark.parametrize(
    ("values", "elements"),
    [
        ({}, 100 + 10 + 50 + 7),  # text only, MTP and its draft head
        ({"VISION": "1"}, 100 + 10 + 1000 + 50 + 7),
        ({"DRAFT_VOCAB": "off"}, 100 + 10 + 50),
        ({"SPEC": "ngram"}, 100 + 50),
    ],
)
def test_weights_count_what_vllm_loads(model_dir, values, elements):
    assert loaded_weight_bytes(model_dir, Settings.model_validate(values)) == 2 * elements


def test_weights_count_the_shards_the_index_lists(model_dir):
    (model_dir / "model-00002-of-00002.safetensors").rename(model_dir / "stale.safetensors")
    shards = ["model-00001-of-00002.safetensors", "stale.safetensors"]
    weight_map = {"model.language_model.a": shards[0], "model.visual.c": shards[1]}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (model_dir / "model-00003-of-00003.safetensors").write_bytes(b"left over, never read")
    assert loaded_weight_bytes(model_dir, Settings()) == 2 * (100 + 10 + 50 + 7)


def test_probe_reads_the_card_and_the_model(model_dir):
    gpus = [
        Gpu(0, "RTX 4090", (8, 9), 23.99, "575", "450 W"),
        Gpu(1, "RTX 3090", (8, 6), 23.5, "575", "350 W"),
    ]
    one = probe_machine(Settings(), model_dir, gpus)
    assert (one.card, one.card_bytes, one.card_assumed) == ("RTX 4090", int(23.99 * GiB), False)
    # the shards' bytes, and the share more vLLM keeps once it has loaded them
    assert one.geometry == PRESETS["tiny"]
    assert one.weight_bytes == with_load_overhead(2 * (100 + 10 + 50 + 7)) > 2 * (100 + 10 + 50 + 7)
    both = probe_machine(Settings(GPU_COUNT=2), model_dir, gpus)
    assert both.card == "RTX 3090"  # the smallest of the GPUs it serves on


def test_probe_without_gpu_or_model_states_what_it_assumes(tmp_path):
    machine = probe_machine(Settings(), tmp_path / "absent", [])
    assert machine.card_assumed and machine.card_bytes == ASSUMED_CARD_BYTES
    assert "no GPU seen" in machine.card
    assert machine.geometry == G27 and machine.weight_bytes == PREPARED_27B_WEIGHT_BYTES
    assert machine.weight_source.startswith(f"no model at {tmp_path / 'absent'}")


def test_probe_declines_other_models(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert probe_machine(Settings(), tmp_path, []) == (
        f"{tmp_path / 'config.json'} is not a Qwen3.5 checkpoint"
    )


# --- `hyperqwen serve` ---------------------------------------------------------------------


def test_serve_prints_what_the_card_holds(tmp_path):
    result = hyperqwen("serve", "single", "--print-argv", env={"CTX": "huge"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "note: CTX=huge: this card holds " in result.stderr
    assert "no GPU seen: an assumed 24 GiB card" in result.stderr


def test_serve_refuses_a_max_len_the_cache_cannot_hold(tmp_path):
    env = {"CTX": "huge", "KV_MEM": "2G", "MAX_LEN": "262144"}
    result = hyperqwen("serve", "single", "--print-argv", env=env, cwd=tmp_path)
    assert result.returncode == 2
    assert "refusing to start: MAX_LEN=262144 does not fit: KV_MEM=2G leaves 2.00 GiB" in (
        result.stderr
    )
    assert result.stdout == ""


@pytest.mark.parametrize("extra", ["--load-format dummy", "--load-format=dummy --enforce-eager"])
def test_a_dummy_load_counts_the_declared_tensors_not_the_empty_folder(tiny_checkpoint, extra):
    # the benches' config-only folders hold no shards: counting the folder would promise the
    # card's whole memory to the KV cache (the H200's capacity run of 2026-12-03)
    from hyperqwen.capacity_probe import declared_weight_bytes

    assert loaded_weight_bytes(tiny_checkpoint, Settings()) == 0
    machine = probe_machine(Settings(EXTRA_ARGS=extra), tiny_checkpoint, [])
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    declared = declared_weight_bytes(config, PRESETS["tiny"], Settings())
    assert machine.weight_bytes == with_load_overhead(declared) > declared > 0
    assert "declares, for --load-format dummy, and the 2.6% more vLLM keeps" in (
        machine.weight_source
    )
    assert probe_machine(Settings(), tiny_checkpoint, []).weight_bytes == 0
