"""Settings -> argv: every profile combination must be accepted by vLLM 0.26.0's own parser."""

from __future__ import annotations

import itertools
import json
from typing import get_args

import pytest
from loaded_settings import loaded

from hyperqwen.engine.features import (
    ALIGN_OVERLAP,
    DRAFT_HEAD_INT8,
    DRAFT_VOCAB,
    GDN_BA,
    GDN_RECURRENT,
    KVARN_V_BITS,
    LOOKUP,
    W4A16_LINEAR,
)
from hyperqwen.launch import LOOKUP_MATCH, DraftWidthRefusal, build_launch, redact_argv
from hyperqwen.settings import LinearBackend, SettingsError, StateDtype, load_settings
from hyperqwen.vllm_flags import FLAG_ALIASES, FlagToken, flag_keys, flag_value, read_flag

SINGLE_COMBOS = [
    dict(CTX=ctx, SPEC=spec, DRAFT_SAMPLE=sample)
    for ctx, spec, sample in itertools.product(
        ("fast", "long", "huge"), ("mtp", "ngram", "lookup", "off"), ("greedy", "probabilistic")
    )
]
SWITCH_COMBOS = [
    dict(TOOLS=t, PREFIX_CACHE=p, VISION=v, REQ_METRICS=r)
    for t, p, v, r in itertools.product("01", "01", "01", "01")
]


@pytest.mark.parametrize("values", SINGLE_COMBOS, ids=lambda v: "-".join(v.values()))
def test_single_profiles_parse(vllm_serve, values):
    plan = build_launch(loaded(**values), "single", api_key=None)
    args = vllm_serve(plan.argv)
    expected_len = {"fast": 65536, "long": 131072, "huge": 262144}[values["CTX"]]
    assert args.model_tag == "models/Qwen3.8-27B-W4A16-hq"
    assert args.max_model_len == expected_len
    assert args.max_num_seqs == (1 if values["CTX"] == "huge" else 4)
    assert args.kv_cache_dtype == ("auto" if values["CTX"] == "fast" else "fp8")
    assert args.mamba_ssm_cache_dtype == "float32"
    spec = args.speculative_config
    if values["SPEC"] == "off":
        assert spec is None
    else:
        assert spec["method"] == {"lookup": "ngram"}.get(values["SPEC"], values["SPEC"])
        assert spec["num_speculative_tokens"] == {"mtp": 3, "ngram": 4, "lookup": 4}[values["SPEC"]]
    # graphs for every decode step and for prompts of up to 512 tokens, as stock vLLM
    assert args.compilation_config.max_cudagraph_capture_size == 512


@pytest.mark.parametrize("values", SWITCH_COMBOS, ids=lambda v: "".join(v.values()))
@pytest.mark.parametrize("mode", ["single", "batch"])
def test_switches_parse(vllm_serve, mode, values):
    args = vllm_serve(build_launch(loaded(**values), mode, api_key="k").argv)
    assert args.enable_auto_tool_choice is (values["TOOLS"] == "1")
    assert args.tool_call_parser == ("qwen3_coder" if values["TOOLS"] == "1" else None)
    assert args.enable_prefix_caching is (values["PREFIX_CACHE"] == "1")
    assert bool(args.language_model_only) is (values["VISION"] == "0")
    assert bool(args.enable_per_request_metrics) is (values["REQ_METRICS"] == "1")
    assert args.enable_prompt_tokens_details is True
    assert args.sse_keep_alive_interval == 15.0
    assert args.api_key is None  # the key travels in the environment


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1", "none"])
def test_reasoning_parser_knob_names_the_parser_or_leaves_it_out(vllm_serve, parser):
    argv = build_launch(loaded(REASONING_PARSER=parser), "batch", api_key=None).argv
    assert ("--reasoning-parser" in argv) is (parser != "none")
    assert vllm_serve(argv).reasoning_parser == ("" if parser == "none" else parser)  # "": off


def test_batch_profile_parses(vllm_serve):
    args = vllm_serve(
        build_launch(
            loaded(KV="auto", MAX_SEQS="32", GPU_COUNT="2", KV_MEM="6G", MAX_LEN="32768"),
            "batch",
            None,
        ).argv
    )
    assert (args.max_num_seqs, args.data_parallel_size, args.max_model_len) == (32, 2, 32768)
    assert args.tensor_parallel_size == 1  # batch mode: a replica per GPU
    assert args.kv_cache_dtype == "auto"
    assert args.kv_cache_memory_bytes == 6 * 2**30
    assert args.speculative_config is None
    assert args.mamba_ssm_cache_dtype == "bfloat16"
    assert args.compilation_config.max_cudagraph_capture_size == 32


@pytest.mark.parametrize("mode", ["single", "batch"])
@pytest.mark.parametrize("state", get_args(StateDtype))
def test_every_state_dtype_parses_in_vllm(vllm_serve, mode, state):
    plan = build_launch(loaded(STATE_DTYPE=state), mode, api_key=None)
    assert vllm_serve(plan.argv).mamba_ssm_cache_dtype == state


def test_state_dtypes_are_vllm_s_less_its_auto():
    """STATE_DTYPE's choices are vLLM's (its auto, the model dtype, is not offered: ours is
    the profile's)."""
    from vllm.config.cache import MambaDType

    assert set(get_args(MambaDType)) == {"auto", *get_args(StateDtype)}


def test_speculative_and_compilation_json_accepted_by_vllm_config_classes(vllm_serve):
    from vllm.config import CompilationConfig, SpeculativeConfig

    # never FULL for every step: with n-gram drafting's verify blocks of varying width vLLM
    # 0.26 answered garbage that way (src/hyperqwen/engine/quoting.md, "Lookup alone")
    for spec in ("mtp", "ngram", "lookup"):
        args = vllm_serve(build_launch(loaded(SPEC=spec), "single", None).argv)
        compilation = args.compilation_config
        assert isinstance(compilation, CompilationConfig)
        assert compilation.cudagraph_mode.name == "FULL_AND_PIECEWISE"
        # The keys must be real SpeculativeConfig fields: a typo would be silently dropped
        # by our own JSON but rejected here.
        fields = set(SpeculativeConfig.__dataclass_fields__)
        assert set(args.speculative_config) <= fields
    ngram = SpeculativeConfig(
        **vllm_serve(build_launch(loaded(SPEC="ngram"), "single", None).argv).speculative_config
    )
    assert (ngram.method, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == ("ngram", 2, 5)
    lookup = SpeculativeConfig(
        **vllm_serve(build_launch(loaded(SPEC="lookup"), "single", None).argv).speculative_config
    )
    assert (lookup.method, lookup.prompt_lookup_min, lookup.prompt_lookup_max) == (
        "ngram",
        *LOOKUP_MATCH,
    )
    assert lookup.num_speculative_tokens == 4
    on_gpu = SpeculativeConfig(
        **vllm_serve(
            build_launch(
                loaded(SPEC="lookup", LOOKUP_DEVICE="gpu", DRAFT_TOKENS="15"), "single", None
            ).argv
        ).speculative_config
    )
    assert (on_gpu.method, on_gpu.prompt_lookup_min, on_gpu.prompt_lookup_max) == (
        "ngram_gpu",
        *LOOKUP_MATCH,
    )
    assert on_gpu.num_speculative_tokens == 15 and on_gpu.use_ngram_gpu()


@pytest.mark.parametrize(
    ("values", "method", "env"),
    [
        ({"SPEC": "lookup"}, "ngram", "fill"),  # LOOKUP_FILL=auto fills on the CPU
        ({"SPEC": "lookup", "LOOKUP_DEVICE": "cpu"}, "ngram", "fill"),
        ({"SPEC": "lookup", "LOOKUP_FILL": "0"}, "ngram", "1"),
        ({"SPEC": "lookup", "LOOKUP_DEVICE": "gpu"}, "ngram_gpu", "gpu"),
        ({"SPEC": "lookup", "LOOKUP_DEVICE": "gpu", "LOOKUP": "0"}, "ngram_gpu", "gpu"),
        ({"SPEC": "mtp", "LOOKUP_DEVICE": "gpu"}, "mtp", "auto"),  # ignored (warned) there
        ({"SPEC": "lookup", "LOOKUP_FILL": "1"}, "ngram", "fill"),
        ({"SPEC": "lookup", "LOOKUP_FILL": "1", "LOOKUP_DEVICE": "gpu"}, "ngram_gpu", "gpu"),
        ({"SPEC": "mtp", "LOOKUP_FILL": "1"}, "mtp", "auto"),  # ignored (warned) there
        ({"SPEC": "mtp", "LOOKUP_FILL": "auto"}, "mtp", "auto"),
    ],
)
def test_lookup_device_picks_vllms_method_and_the_engine_path(values, method, env):
    """LOOKUP_DEVICE=gpu: vLLM's ngram_gpu (its GPU token buffer, async scheduling on) and
    HYPERQWEN_LOOKUP=gpu, which tells the runner's seams to search and cut there."""
    plan = build_launch(loaded(**values), "single", None)
    spec = json.loads(flag_value(plan.argv, "--speculative-config"))
    assert spec["method"] == method
    assert spec["num_speculative_tokens"] == (3 if method == "mtp" else 4)
    assert plan.env.get(LOOKUP.env) == env


def test_extra_args_come_last_and_win(vllm_serve):
    plan = build_launch(
        loaded(
            EXTRA_ARGS="--max-model-len 4096 --load-format dummy -tp 1 "
            "--max_num_seqs=2 --no-enable-prefix-caching"
        ),
        "single",
        None,
    )
    args = vllm_serve(plan.argv)
    assert args.max_model_len == 4096 and args.max_num_seqs == 2
    assert args.load_format == "dummy" and args.enable_prefix_caching is False
    shadowed = [w for w in plan.warnings if w.startswith("EXTRA_ARGS sets")]
    assert [w.split()[2].rstrip(",") for w in shadowed] == [
        "--max-model-len",
        "--tensor-parallel-size",
        "--max-num-seqs",
        "--enable-prefix-caching",
    ]
    assert "from MAX_LEN" in shadowed[0]


def test_extra_args_api_key_warned_and_redacted():
    plan = build_launch(loaded(EXTRA_ARGS="--api-key hunter2 --api-key=hunter3"), "batch", None)
    assert any("--api-key" in w and "VLLM_API_KEY" in w for w in plan.warnings)
    shown = "\n".join(redact_argv(plan.argv))
    assert "hunter" not in shown and "--api-key\n***" in shown and "--api-key=***" in shown


def test_flag_aliases_match_vllm(vllm_serve):
    actions = vllm_serve.parser._subparsers._group_actions[0].choices["serve"]
    for short, long in FLAG_ALIASES.items():
        assert actions._option_string_actions[short] is actions._option_string_actions[long]


SPEC = '{"method":"ngram","num_speculative_tokens":2}'


@pytest.mark.parametrize(
    ("tokens", "flag"),
    [
        (["--max_num_seqs", "8"], "--max-num-seqs"),
        (["--max-num-seqs=8"], "--max-num-seqs"),
        (["--max-num-seqs", "4", "--max_num_seqs=8"], "--max-num-seqs"),
        (["-tp", "2"], "--tensor-parallel-size"),
        (["-sc", SPEC], "--speculative-config"),
        ([f"--speculative_config={SPEC}"], "--speculative-config"),
    ],
)
def test_the_flag_reader_reads_the_value_vllm_parses(vllm_serve, tokens, flag):
    parsed = vllm_serve.parser.parse_args(["serve", "model", *tokens])
    dest = flag.removeprefix("--").replace("-", "_")
    assert json.loads(flag_value(tokens, flag)) == getattr(parsed, dest)


def test_the_flag_reader_reads_no_flags_and_json_keys_as_vllm_does(vllm_serve):
    parsed = vllm_serve.parser.parse_args(["serve", "model", "--no-enable-prefix-caching"])
    assert parsed.enable_prefix_caching is False
    assert read_flag("--no-enable-prefix-caching") == FlagToken(
        "--enable-prefix-caching", negated=True, key=None, inline=False
    )
    keys = ["--speculative_config.method=ngram", "--speculative-config.num_speculative_tokens", "2"]
    parsed = vllm_serve.parser.parse_args(["serve", "model", *keys])
    assert parsed.speculative_config == json.loads(SPEC)
    assert flag_keys(keys, "--speculative-config") == keys[:2]
    assert flag_value(keys, "--speculative-config") is None  # no whole value given


@pytest.mark.parametrize(
    ("values", "key", "container", "host", "warns"),
    [
        ({}, None, False, "127.0.0.1", False),
        ({}, "k", False, "0.0.0.0", False),
        ({"HOST": "127.0.0.1"}, "k", False, "127.0.0.1", False),
        ({"HOST": "0.0.0.0"}, None, False, "0.0.0.0", True),
        ({"HOST": "192.168.1.5"}, "k", False, "192.168.1.5", False),
        ({"HOST": "::1"}, None, False, "::1", False),
        ({}, None, True, "0.0.0.0", False),
        ({"BIND": "0.0.0.0"}, None, True, "0.0.0.0", True),
        ({"BIND": "0.0.0.0"}, "k", True, "0.0.0.0", False),
    ],
)
def test_bind_and_key_matrix(values, key, container, host, warns):
    plan = build_launch(loaded(**values), "single", key, in_container=container)
    assert plan.host == host
    assert any("WITHOUT an API key" in w for w in plan.warnings) is warns
    assert ("VLLM_API_KEY" in plan.env) is bool(key)
    assert key is None or key not in plan.argv


@pytest.mark.parametrize(
    ("mode", "values", "expected"),
    [
        ("batch", {"SPEC": "ngram"}, "SPEC is a single-mode knob; ignored in batch mode."),
        ("batch", {"CTX": "long"}, "CTX is a single-mode knob; ignored in batch mode."),
        ("single", {"SPEC": "off", "DRAFT_TOKENS": "2"}, "DRAFT_TOKENS is ignored with SPEC=off."),
        ("single", {"TOOLS": "0", "TOOL_PARSER": "hermes"}, "TOOL_PARSER is ignored with TOOLS=0."),
        (
            "single",
            {"SPEC": "lookup", "DRAFT_SAMPLE": "probabilistic"},
            "DRAFT_SAMPLE is ignored with SPEC=lookup (copied drafts are not sampled).",
        ),
        (
            "single",
            {"SPEC": "mtp", "LOOKUP_DEVICE": "gpu"},
            "LOOKUP_DEVICE is ignored unless SPEC=lookup (it picks where lookup drafts).",
        ),
        (
            "batch",
            {"SPEC": "lookup", "LOOKUP_DEVICE": "gpu"},
            "LOOKUP_DEVICE is a single-mode knob; ignored in batch mode.",
        ),
        (
            "single",
            {"SPEC": "lookup", "LOOKUP_DEVICE": "gpu", "LOOKUP_FILL": "1"},
            "LOOKUP_FILL is ignored unless SPEC=lookup drafts on the CPU (LOOKUP_DEVICE=cpu): it "
            "fills that proposer's draft slots.",
        ),
        (
            "single",
            {"SPEC": "ngram", "LOOKUP": "1"},
            "LOOKUP is ignored with SPEC=ngram (it fills MTP's drafts).",
        ),
        (
            "single",
            {"LOOKUP": "1", "DRAFT_SAMPLE": "probabilistic"},
            "LOOKUP is ignored with DRAFT_SAMPLE=probabilistic (a copied draft has no MTP "
            "probability to verify against).",
        ),
    ],
)
def test_ignored_knobs_warn(mode, values, expected):
    assert expected in build_launch(loaded(**values), mode, None).warnings


@pytest.mark.parametrize(
    "values",
    [
        {"SPEC": "ngram", "LOOKUP": "auto"},
        {"SPEC": "off", "LOOKUP": "auto"},
        {"LOOKUP": "auto", "DRAFT_SAMPLE": "probabilistic"},
        {"SPEC": "lookup", "LOOKUP_DEVICE": "gpu", "LOOKUP_FILL": "auto"},
        {"SPEC": "mtp", "LOOKUP_FILL": "auto"},
    ],
)
def test_lookup_auto_is_silent_where_it_does_not_apply(values):
    """auto means "where it applies": only an explicit LOOKUP=1 or LOOKUP_FILL=1 that cannot
    apply warns."""
    warnings = build_launch(loaded(**values), "single", None).warnings
    assert not [w for w in warnings if w.startswith("LOOKUP")]


def test_defaults_warn_about_nothing():
    for mode in ("single", "batch"):
        assert build_launch(loaded(), mode, None).warnings == []


def test_model_path_and_served_name():
    plan = build_launch(loaded(MODELS_DIR="/srv/models", MODEL="tiny"), "single", None)
    assert plan.argv[2] == "/srv/models/tiny" and plan.served_name == "tiny"
    plan = build_launch(loaded(MODEL="/data/other-model"), "batch", None)
    assert plan.argv[2] == "/data/other-model" and plan.served_name == "other-model"
    assert plan.argv[plan.argv.index("--served-model-name") + 1] == "other-model"


def test_draft_overrides_reach_speculative_config(vllm_serve):
    args = vllm_serve(
        build_launch(
            loaded(DRAFT_TOKENS="5", DRAFT_SAMPLE="probabilistic", MAX_SEQS="2"), "single", None
        ).argv
    )
    assert args.speculative_config == {
        "method": "mtp",
        "num_speculative_tokens": 5,
        "draft_sample_method": "probabilistic",
    }
    assert args.compilation_config.max_cudagraph_capture_size == 512
    assert json.loads(json.dumps(args.speculative_config))


def test_single_graphs_cover_a_decode_step_larger_than_512_tokens(vllm_serve):
    plan = build_launch(loaded(DRAFT_TOKENS="7", MAX_SEQS="80"), "single", None)
    assert vllm_serve(plan.argv).compilation_config.max_cudagraph_capture_size == 80 * 8


def test_overlap_asked_for_without_prefix_caching_warns():
    asked = build_launch(loaded(PREFIX_CACHE_OVERLAP="1", PREFIX_CACHE="0"), "single", None)
    assert any("PREFIX_CACHE_OVERLAP is ignored with PREFIX_CACHE=0" in w for w in asked.warnings)
    default = build_launch(loaded(PREFIX_CACHE="0"), "single", None)  # overlap left at its default
    assert not any("PREFIX_CACHE_OVERLAP" in w for w in default.warnings)


@pytest.mark.parametrize(
    ("mode", "values", "expected"),
    [
        ("single", {}, "auto"),
        ("single", {"DRAFT_VOCAB": "off"}, "off"),
        ("batch", {"DRAFT_VOCAB": "off"}, None),  # batch never drafts
    ],
)
def test_draft_vocab_reaches_the_patched_vllm_through_its_env(mode, values, expected):
    plan = build_launch(loaded(**values), mode, None)
    assert plan.env.get(DRAFT_VOCAB.env) == expected


@pytest.mark.parametrize(
    ("mode", "values", "expected", "warning"),
    [
        ("single", {"KV": "kvarn"}, None, None),  # unset: 2, the default
        ("single", {"KV": "kvarn", "KVARN_V_BITS": "3"}, "3", None),
        ("batch", {"KV": "kvarn", "KVARN_V_BITS": "3"}, "3", None),
        ("single", {"KVARN_V_BITS": "3"}, None, "KVARN_V_BITS is ignored without KV=kvarn"),
        ("batch", {"KV": "fp8", "KVARN_V_BITS": "2"}, None, "ignored without KV=kvarn"),
    ],
)
def test_kvarn_v_bits_reach_the_backend_through_its_env(mode, values, expected, warning):
    """KVarN's value bits become the variable its backend builds its tiles with (unset: 2),
    only with KV=kvarn; set without it, the launch warns."""
    plan = build_launch(loaded(**values), mode, None)
    assert plan.env.get(KVARN_V_BITS.env) == expected
    said = [w for w in plan.warnings if "KVARN_V_BITS" in w]
    assert (warning is None and not said) or any(warning in w for w in said)


@pytest.mark.parametrize(
    ("mode", "values", "expected", "warning"),
    [
        ("single", {}, None, None),  # off by default
        ("single", {"DRAFT_HEAD_INT8": "1"}, "1", None),
        ("single", {"DRAFT_HEAD_INT8": "1", "DRAFT_VOCAB": "off"}, None, "with DRAFT_VOCAB=off"),
        ("single", {"DRAFT_HEAD_INT8": "1", "SPEC": "ngram"}, None, "with SPEC=ngram"),
        ("batch", {"DRAFT_HEAD_INT8": "1"}, None, "single-mode knob"),
    ],
)
def test_int8_draft_head_is_set_only_where_mtp_drafts_from_the_draft_vocabulary(
    mode, values, expected, warning
):
    plan = build_launch(loaded(**values), mode, None)
    assert plan.env.get(DRAFT_HEAD_INT8.env) == expected
    named = [w for w in plan.warnings if "DRAFT_HEAD_INT8" in w]
    assert (warning is None and not named) or (len(named) == 1 and warning in named[0])


@pytest.mark.parametrize(
    ("mode", "values", "expected"),
    [
        ("single", {}, "marlin"),  # Marlin is the faster kernel at a decode step's few rows
        ("single", {"CTX": "huge"}, "marlin"),
        ("single", {"LINEAR_BACKEND": "machete"}, "machete"),
        ("batch", {}, "auto"),  # vLLM's choice: Machete on Hopper, faster at 64 rows
        ("batch", {"LINEAR_BACKEND": "marlin"}, "marlin"),
        ("single", {"LINEAR_BACKEND": "hyperqwen"}, "marlin"),  # what our kernel leaves
        ("batch", {"LINEAR_BACKEND": "hyperqwen"}, "marlin"),
    ],
)
def test_linear_backend_defaults_per_mode_and_reaches_vllm(vllm_serve, mode, values, expected):
    plan = build_launch(loaded(**values), mode, None)
    args = vllm_serve(plan.argv)
    assert args.linear_backend == expected
    ours = values.get("LINEAR_BACKEND") == "hyperqwen"
    assert (plan.env.get(W4A16_LINEAR.env) == "1") == ours


def test_linear_backend_values_are_vllms_but_ours():
    from vllm.config.kernel import LinearBackend as VllmLinearBackend

    assert set(get_args(LinearBackend)) - {"hyperqwen"} <= set(get_args(VllmLinearBackend))
    assert "hyperqwen" not in get_args(VllmLinearBackend)


@pytest.mark.parametrize(
    ("mode", "values", "expected"),
    [
        ("single", {"SPEC": "lookup"}, "fill"),  # LOOKUP_FILL=auto: every step proposes
        ("single", {"SPEC": "lookup", "LOOKUP_FILL": "0"}, "1"),
        ("single", {"LOOKUP": "1"}, "1"),  # fused into MTP's drafts
        ("single", {"LOOKUP": "auto"}, "auto"),  # the engine decides: MTP with greedy drafts
        ("single", {"LOOKUP": "auto", "DRAFT_SAMPLE": "probabilistic"}, "auto"),  # engine: off
        ("single", {"LOOKUP": "auto", "SPEC": "ngram"}, None),  # vLLM's own n-gram search
        ("single", {"LOOKUP": "auto", "SPEC": "off"}, None),
        ("single", {"LOOKUP": "0", "SPEC": "lookup"}, "fill"),  # SPEC=lookup is the search itself
        ("batch", {"LOOKUP": "auto"}, None),
        ("single", {"SPEC": "ngram"}, None),  # vLLM's own n-gram search
        ("single", {}, "auto"),  # quoting on by default where MTP drafts greedily
        ("single", {"LOOKUP": "0"}, None),
        ("batch", {"SPEC": "lookup"}, None),  # batch never drafts
        ("single", {"SPEC": "lookup", "LOOKUP_DEVICE": "gpu"}, "gpu"),
        ("batch", {"SPEC": "lookup", "LOOKUP_DEVICE": "gpu"}, None),
    ],
)
def test_lookup_search_is_switched_on_through_the_engine_env(mode, values, expected):
    assert build_launch(loaded(**values), mode, None).env.get(LOOKUP.env) == expected


@pytest.mark.parametrize("mode", ["single", "batch"])
@pytest.mark.parametrize("split", [None, "tp", "dp"])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_every_split_parses_and_shards_as_asked(vllm_serve, mode, split, count):
    values = {"GPU_COUNT": str(count), **({"GPU_SPLIT": split} if split else {})}
    plan = build_launch(loaded(**values), mode, None)
    args = vllm_serve(plan.argv)
    effective = split or {"single": "tp", "batch": "dp"}[mode]
    assert args.tensor_parallel_size == (count if effective == "tp" else 1)
    assert plan.tensor_parallel == args.tensor_parallel_size
    assert args.data_parallel_size == (count if effective == "dp" else 1)
    assert ("--data-parallel-size" in plan.argv) is (effective == "dp" and count > 1)


@pytest.mark.parametrize(
    ("mode", "values", "expected"),
    [
        ("single", {}, "1"),  # on with prefix caching, both defaults
        ("single", {"PREFIX_CACHE_OVERLAP": "0"}, None),
        ("single", {"PREFIX_CACHE": "0"}, None),  # nothing to overlap
        ("batch", {}, None),  # batch never drafts
    ],
)
def test_prefix_cache_overlap_reaches_the_engine_env(mode, values, expected):
    assert build_launch(loaded(**values), mode, None).env.get(ALIGN_OVERLAP.env) == expected


@pytest.mark.parametrize("mode", ["single", "batch"])
@pytest.mark.parametrize(
    ("knob", "variable"), [("GDN_RECURRENT", GDN_RECURRENT.env), ("GDN_BA", GDN_BA.env)]
)
def test_gdn_kernel_knobs_reach_the_engine_env_in_both_modes(mode, knob, variable):
    assert variable not in build_launch(loaded(), mode, None).env  # off by default
    plan = build_launch(loaded(**{knob: "1"}), mode, None)
    assert plan.env[variable] == "1"
    assert variable not in " ".join(plan.argv)  # an environment variable, not a flag


@pytest.mark.parametrize(
    "values",
    [
        {"SPEC": "lookup", "DRAFT_TOKENS": "31"},
        {"SPEC": "lookup", "DRAFT_TOKENS": "24", "LOOKUP_FILL": "0"},
        {"SPEC": "ngram", "DRAFT_TOKENS": "31"},
        {"SPEC": "off", "DRAFT_TOKENS": "31"},  # nothing drafts: nothing to refuse
    ],
)
def test_host_searches_take_drafts_past_the_gpu_kernels_width(vllm_serve, values):
    """SPEC=ngram and SPEC=lookup on the CPU draft on the host: up to 31 reach vLLM."""
    args = vllm_serve(build_launch(loaded(**values), "single", None).argv)
    if values["SPEC"] == "off":
        assert args.speculative_config is None
    else:
        assert args.speculative_config["num_speculative_tokens"] == int(values["DRAFT_TOKENS"])


@pytest.mark.parametrize(
    ("values", "path"),
    [
        ({"DRAFT_TOKENS": "16"}, "SPEC=mtp"),
        ({"SPEC": "lookup", "LOOKUP_DEVICE": "gpu", "DRAFT_TOKENS": "31"}, "LOOKUP_DEVICE=gpu"),
        ({"SPEC": "lookup", "GDN_REPLAY": "1", "DRAFT_TOKENS": "31"}, "GDN_REPLAY=1"),
        ({"SPEC": "ngram", "GDN_REPLAY": "1", "DRAFT_TOKENS": "16"}, "GDN_REPLAY=1"),
    ],
)
def test_drafts_past_the_gpu_kernels_width_are_refused_by_name(values, path):
    with pytest.raises(DraftWidthRefusal) as refusal:
        build_launch(loaded(**values), "single", None)
    message = str(refusal.value)
    assert f"DRAFT_TOKENS={values['DRAFT_TOKENS']} is wider than" in message and path in message
    assert "DRAFT_TOKENS=15 or fewer" in message
    # batch mode never drafts: the knob is only warned about there
    build_launch(loaded(**values), "batch", None)


def test_drafts_past_the_settings_bound_are_refused(tmp_path):
    with pytest.raises(SettingsError, match="DRAFT_TOKENS"):
        load_settings({"SPEC": "lookup", "DRAFT_TOKENS": "32"}, tmp_path / "none.env")
