"""The launcher's argv, environment and warnings for every profile, mode and engine switch,
against a committed golden file: a refactor of how knobs become flags and variables must leave
each one byte-identical.

The golden file is generated from the launcher, so it holds what the code did when it was
written; after a deliberate change, regenerate it and review its diff:

    PYTHONPATH=src python tests/test_launch_golden.py --write
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import get_args

import pytest

from hyperqwen.engine.features import LOOKUP, PDL
from hyperqwen.kv_choices import KV_CHOICES
from hyperqwen.launch import build_launch
from hyperqwen.settings import LoadedSettings, Settings, StateDtype

GOLDEN = Path(__file__).with_name("data") / "launch_golden.json"

# Each engine switch flipped from its default alone, the warning paths they have, and all at once.
SWITCH_VARIANTS: dict[str, dict[str, str]] = {
    "defaults": {},
    "gdn-recurrent": {"GDN_RECURRENT": "1"},
    "gdn-ba": {"GDN_BA": "1"},
    "linear-hyperqwen": {"LINEAR_BACKEND": "hyperqwen"},
    "linear-machete": {"LINEAR_BACKEND": "machete"},
    "lookup": {"LOOKUP": "1"},
    # LOOKUP=auto (issue 24) added these cases; they differ from their base case only in
    # LOOKUP's own variable (test_lookup_auto_changes_only_its_own_variable)
    "lookup-auto": {"LOOKUP": "auto"},
    "lookup-auto-probabilistic": {"LOOKUP": "auto", "DRAFT_SAMPLE": "probabilistic"},
    "lookup-probabilistic": {"LOOKUP": "1", "DRAFT_SAMPLE": "probabilistic"},
    "overlap-off": {"PREFIX_CACHE_OVERLAP": "0"},
    "prefix-cache-off": {"PREFIX_CACHE": "0"},
    "prefix-cache-off-overlap-asked": {"PREFIX_CACHE": "0", "PREFIX_CACHE_OVERLAP": "1"},
    "draft-vocab-off": {"DRAFT_VOCAB": "off"},
    # DRAFT_HEAD_INT8 (issue 27) added this case; it differs from its base case only in its
    # own variable or a warning
    "draft-head-int8": {"DRAFT_HEAD_INT8": "1"},
    "split-qkv-off": {"GDN_SPLIT_QKV": "0"},
    # INT8_ACT (issue 26) added this case; a batch-mode knob, single mode only warns
    "int8-act-mlp": {"INT8_ACT": "mlp"},
    # PDL (issue 27) added these cases; they differ from their base case only in HYPERQWEN_PDL
    "pdl-auto": {"PDL": "auto"},
    "all-switches": {
        "GDN_RECURRENT": "1",
        "GDN_BA": "1",
        "LINEAR_BACKEND": "hyperqwen",
        "LOOKUP": "1",
        "DRAFT_VOCAB": "off",
        "PREFIX_CACHE_OVERLAP": "0",
    },
}
SPECS = ("mtp", "ngram", "lookup", "off")


def cases() -> dict[str, tuple[str, dict[str, str]]]:
    """case id -> (mode, knob values): single mode at every CTX x SPEC, batch at every SPEC (a
    single-mode knob there only warns), each with every switch variant; then every KV choice."""
    found = {}
    profiles = [("single", {"CTX": ctx}) for ctx in ("fast", "long", "huge")] + [("batch", {})]
    for (mode, profile), spec, (variant, switches) in itertools.product(
        profiles, SPECS, SWITCH_VARIANTS.items()
    ):
        values = {**profile, "SPEC": spec, **switches}
        found["-".join([mode, *profile.values(), spec, variant])] = (mode, values)
    # Each KV choice set explicitly: single mode at fast and huge with MTP (SPEC=off for
    # TurboQuant, which refuses to speculate) and batch.
    for kv, choice in KV_CHOICES.items():
        spec = "mtp" if choice.speculation else "off"
        knobs = {"KV": kv}
        for ctx in ("fast", "huge"):
            found[f"single-{ctx}-{spec}-kv-{kv}"] = ("single", {"CTX": ctx, "SPEC": spec, **knobs})
        found[f"batch-kv-{kv}"] = ("batch", knobs)
    # Each GDN state dtype set explicitly, in single mode and batch.
    for dtype in get_args(StateDtype):
        found[f"single-fast-mtp-state-{dtype}"] = ("single", {"STATE_DTYPE": dtype})
        found[f"batch-state-{dtype}"] = ("batch", {"STATE_DTYPE": dtype})
    return found


def launched(mode: str, values: dict[str, str]) -> dict:
    loaded = LoadedSettings(Settings.model_validate(values), frozenset(values))
    plan = build_launch(loaded, mode, api_key=None)  # type: ignore[arg-type]
    return {"argv": plan.argv, "env": plan.env, "warnings": plan.warnings}


def generate() -> dict[str, dict]:
    return {case: launched(mode, values) for case, (mode, values) in cases().items()}


@pytest.fixture(scope="module")
def golden() -> dict[str, dict]:
    return json.loads(GOLDEN.read_text())


def test_every_case_is_in_the_golden_file(golden):
    assert set(golden) == set(cases()), "regenerate: python tests/test_launch_golden.py --write"


@pytest.mark.parametrize(("case", "mode_values"), cases().items(), ids=list(cases()))
def test_launch_matches_the_golden_file(golden, case, mode_values):
    now, then = launched(*mode_values), golden[case]
    assert now["argv"] == then["argv"]
    assert now["env"] == then["env"]
    # "X is a single-mode knob" warnings come in knob declaration order, which the engine
    # features' own knobs changed (they follow the others); the warnings themselves may not
    assert sorted(now["warnings"]) == sorted(then["warnings"])


@pytest.mark.parametrize("case", [c for c in cases() if "-lookup-auto" in c])
def test_lookup_auto_changes_only_its_own_variable(golden, case):
    """LOOKUP=auto reaches vLLM through HYPERQWEN_LOOKUP alone: the same argv and warnings as
    the case without it (defaults, or probabilistic drafts alone), but for batch mode's
    "single-mode knob" warning every explicit single-mode knob gets."""
    mode, values = cases()[case]
    base = launched(mode, {k: v for k, v in values.items() if k != "LOOKUP"})
    now = golden[case]
    assert now["argv"] == base["argv"]
    own = ["LOOKUP is a single-mode knob; ignored in batch mode."] if mode == "batch" else []
    assert sorted(now["warnings"]) == sorted(base["warnings"] + own)
    others = {name: value for name, value in now["env"].items() if name != LOOKUP.env}
    assert others == {name: v for name, v in base["env"].items() if name != LOOKUP.env}
    single_mtp = mode == "single" and values["SPEC"] == "mtp"
    # SPEC=lookup is the search itself (LOOKUP_FILL=auto: it proposes every step)
    expected = "fill" if mode == "single" and values["SPEC"] == "lookup" else None
    assert now["env"].get(LOOKUP.env) == ("auto" if single_mtp else expected)


@pytest.mark.parametrize("case", [c for c in cases() if c.endswith("-pdl-auto")])
def test_pdl_auto_changes_only_its_own_variable(golden, case):
    """PDL=auto reaches vLLM as HYPERQWEN_PDL=auto alone, in both modes; the default (0)
    sets nothing, so every other case is as it was before the knob."""
    mode, values = cases()[case]
    base = launched(mode, {k: v for k, v in values.items() if k != "PDL"})
    now = golden[case]
    assert now["argv"] == base["argv"] and now["warnings"] == base["warnings"]
    assert now["env"] == {**base["env"], PDL.env: "auto"}
    assert PDL.env not in base["env"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: PYTHONPATH=src python tests/test_launch_golden.py --write")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(generate(), indent=1) + "\n")
    print(f"wrote {len(cases())} cases to {GOLDEN}")
