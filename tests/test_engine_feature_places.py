"""Issue 23's rule: no engine feature is named in more than two places outside its own code and
the tests: its declaration (engine/features.py, or features_gdn.py, features_kv.py or
features_lookup.py, which it imports: one place) and the docs generated from it.

What names a feature (its *spellings*, all read from its declaration, matched case-sensitively
and never as part of a longer identifier, so `prompt_lookup_min` or a dict lookup in prose is no
hit): its variable (HYPERQWEN_LOOKUP), its own knob (LOOKUP, LOOKUP=auto; a knob Settings
declares, such as LINEAR_BACKEND, is Settings', whose help says what its values do), the
declaration's constant (features.SPLIT_QKV), and its module: `engine/NAME`, `engine.NAME`,
`import NAME`, `NAME.py`, and, where NAME is an identifier rather than a word (it holds an `_`
or a digit: split_qkv, draft_vocab), NAME itself. A knob's value (SPEC=lookup) and a command's
flag (prepare's --draft-vocab, the file its step cuts from) are not spellings of a feature.

Its own code, where it may be named: its module, and the files its declaration lists as
`own_files` (what exists only for it and goes with it: its kernels, parts, notes, the
benchmark of it; no two features own the same file). Reading the declarations generically
(FEATURES, a seam's features, a feature's field) names nothing; naming the constant does. So a
benchmark of one feature's code against vLLM's (`bench quoting`, `bench gdn`) is that feature's
own file, and one of several (`bench ab`) reads the declarations. A feature's own code may use
another feature's (PDL's launch lives in the other features' kernels, `bench kernels` times
INT8_ACT's kernels beside the W4A16 one): that is code depending on code, not wiring, and is
no place of either; a model-folder
file a feature needs is written by its own prepare step (its declaration's prepare_step), which
prepare runs, and counted by the capacity budget, through FEATURES.

Places: the declaration counts one, the generated docs (the parts of files
`hyperqwen settings --write-docs` writes, between its markers: docs.generated_docs) one
together, every other file one. Scanned: src/, patches/, the top-level files and every
hand-written Markdown, shell and unit file. Not scanned: the tests, and measurement records
(docs/results/, */measurements/, and docs/benchmarks.md and README.md's headline that
`hyperqwen bench docs` generates from them): they say what ran, spelled as it was then, and are
not edited when a feature changes; nor the GPU host's plans (bench/gpu-host/plans/), which
say what is to run, knobs by name: tests/test_gpu_plans.py holds each of their knobs to the
settings and the launcher, so a renamed or removed knob fails there.

`python tests/test_engine_feature_places.py` prints each feature's places.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hyperqwen.bench import results
from hyperqwen.docs import generated_docs
from hyperqwen.engine.features import FEATURES, Feature

ROOT = Path(__file__).resolve().parents[1]
DECLARATION = "src/hyperqwen/engine/features.py"
# the registry's other declaration files: one place with features.py (which imports from them)
DECLARATIONS = (
    DECLARATION,
    "src/hyperqwen/engine/features_gdn.py",
    "src/hyperqwen/engine/features_kv.py",
    "src/hyperqwen/engine/features_lookup.py",
)
GENERATED = "generated docs"
MOST_PLACES = 2
SCANNED_FOLDERS = ("src", "patches", ".ci", ".github")
SCANNED_SUFFIXES = (".md", ".sh", ".service")
NOT_SCANNED = ("tests", "docs/results", "bench/gpu-host/plans", ".git", ".venv")
RECORDS_DOC = results.BENCHMARKS_DOC.relative_to(results.REPO_ROOT).as_posix()


def spellings(feature: Feature) -> re.Pattern[str]:
    """What names the feature (the module docstring), as one pattern."""
    words = [feature.env, feature.name.upper()]
    if feature.owned_knob is not None:
        words.append(feature.knob)
    name = re.escape(feature.name)
    forms = [re.escape(word) for word in words]
    forms += [rf"engine[./]{name}", rf"import {name}", rf"{name}\.py"]
    if re.search(r"[_\d]", feature.name):
        forms.append(name)
    return re.compile(rf"(?<![\w-])(?:{'|'.join(forms)})(?![\w-])")


def _scanned(path: Path, root: Path) -> bool:
    relative = path.relative_to(root)
    top = relative.parts[0]
    if any(relative.as_posix().startswith(prefix) for prefix in NOT_SCANNED):
        return False
    if "measurements" in relative.parts or "__pycache__" in relative.parts:
        return False
    return len(relative.parts) == 1 or top in SCANNED_FOLDERS or path.suffix in SCANNED_SUFFIXES


def _candidates(root: Path) -> list[Path]:
    """The repository's files, tracked or new but not ignored (not what an install or a run
    leaves, such as src/hyperqwen.egg-info); every file where root is not a git checkout."""
    if not (root / ".git").exists():
        return sorted(root.rglob("*"))
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=root, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    return sorted(root / name for name in listed.split("\0") if name)


def scanned_files(root: Path) -> Iterator[tuple[str, str]]:
    """(path relative to root, its text less the records `hyperqwen bench docs` generates)."""
    for path in _candidates(root):
        if not path.is_file() or not _scanned(path, root):
            continue
        relative = path.relative_to(root).as_posix()
        if relative == RECORDS_DOC:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if relative == "README.md":
            text = _without(text, results.HEADLINE_BEGIN, results.HEADLINE_END)
        yield relative, text


def _without(text: str, begin: str, end: str) -> str:
    start = text.find(begin)
    return text if start < 0 else text[:start] + text[text.index(end, start) + len(end) :]


def _generated_parts(relative: str, text: str) -> tuple[str, str]:
    """(the hand-written text, the generated text) of one file."""
    generated = []
    for doc in generated_docs():
        if doc.path != relative:
            continue
        if doc.begin is None:
            return "", text
        start = text.find(doc.begin)
        if start >= 0:
            stop = text.index(doc.end, start) + len(doc.end)
            generated.append(text[start:stop])
            text = text[:start] + text[stop:]
    return text, "".join(generated)


def _own(relative: str, feature: Feature) -> bool:
    owned = (f"src/hyperqwen/{feature.module}", *feature.own_files)
    return any(relative == own or relative.startswith(own + "/") for own in owned)


def places(feature: Feature, root: Path = ROOT) -> dict[str, list[int]]:
    """Each place that names the feature, with the lines that do (generated docs: together)."""
    pattern = spellings(feature)
    found: dict[str, list[int]] = {}
    for relative, text in scanned_files(root):
        if any(_own(relative, owner) for owner in FEATURES):
            continue
        written, generated = _generated_parts(relative, text)
        if pattern.search(generated):
            found.setdefault(GENERATED, []).append(0)
        lines = [n for n, line in enumerate(written.splitlines(), 1) if pattern.search(line)]
        if lines:  # the registry's declaration files are one place
            place = DECLARATION if relative in DECLARATIONS else relative
            found.setdefault(place, []).extend(lines)
    return found


def report(root: Path = ROOT) -> str:
    rows = []
    for feature in FEATURES:
        found = places(feature, root)
        named = ", ".join(
            place if place == GENERATED else f"{place}:{','.join(map(str, lines[:8]))}"
            for place, lines in found.items()
        )
        rows.append(f"{feature.name:14} {len(found)} place(s): {named}")
    return "\n".join(rows)


@pytest.mark.parametrize("feature", FEATURES, ids=lambda feature: feature.name)
def test_a_feature_is_named_only_in_its_declaration_and_the_generated_docs(feature):
    found = places(feature)
    assert DECLARATION in found and GENERATED in found, found
    others = {place: n for place, n in found.items() if place not in (DECLARATION, GENERATED)}
    assert len(found) <= MOST_PLACES, (
        f"{feature.name} is named in {len(found)} places; beyond its declaration and the "
        f"generated docs at {others} (path: lines). Move what it says there into the feature's "
        "module or declaration (or declare the file in its own_files if it exists only for it)"
    )


def test_own_files_exist_and_no_two_features_own_one():
    owners: dict[str, str] = {}
    for feature in FEATURES:
        for own in (f"src/hyperqwen/{feature.module}", *feature.own_files):
            assert (ROOT / own).exists(), f"{feature.name} owns {own}, which is not there"
            assert own not in owners, f"{own} is owned by {owners[own]} and {feature.name}"
            owners[own] = feature.name


def _copy_of_the_scanned_tree(tmp_path: Path) -> Path:
    for relative, text in scanned_files(ROOT):
        target = tmp_path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "mention",
    [
        "export HYPERQWEN_LOOKUP=1",
        "LOOKUP=auto hyperqwen serve single",
        "from hyperqwen.engine import lookup",
        "see src/hyperqwen/engine/lookup.py",
        "from hyperqwen.engine.features import LOOKUP",
    ],
)
@pytest.mark.parametrize("where", ["src/hyperqwen/planted.py", "batch/planted.md", "planted.sh"])
def test_a_planted_mention_in_a_new_file_is_a_place(tmp_path, mention, where):
    root = _copy_of_the_scanned_tree(tmp_path)
    lookup = next(feature for feature in FEATURES if feature.name == "lookup")
    before = places(lookup, root)
    (root / where).write_text(f"# a new file\n{mention}\n")
    after = places(lookup, root)
    assert after == {**before, where: [2]}


@pytest.mark.parametrize(
    ("name", "text", "names"),
    [
        ("lookup", "the dict lookup finds the knob", False),
        ("lookup", "prompt_lookup_min=3, SPEC=lookup", False),
        ("lookup", "DEFAULT_LOOKUP_KNOBS and hyperqwen-lookup-knobs", False),
        ("lookup", "kernels/lookup.py", True),
        ("lookup", "LOOKUP=0", True),
        ("split_qkv", "test_kernel_split_qkv.py", False),
        ("split_qkv", "engine.split_qkv", True),
        ("split_qkv", "the split_qkv feature", True),
        ("split_qkv", "GDN_SPLIT_QKV=0", True),
        ("split_qkv", "HYPERQWEN_GDN_SPLIT_QKV", True),
        ("draft_vocab", "--draft-vocab FILE", False),
        ("draft_vocab", "args.draft_vocab", True),
        ("w4a16_linear", "LINEAR_BACKEND=hyperqwen", False),
        ("w4a16_linear", "features.W4A16_LINEAR.env", True),
    ],
)
def test_spellings_are_identifiers_not_words(name, text, names):
    (feature,) = (feature for feature in FEATURES if feature.name == name)
    assert bool(spellings(feature).search(text)) is names


def test_a_generated_table_counts_once_and_hand_written_text_beside_it_counts(tmp_path):
    root = _copy_of_the_scanned_tree(tmp_path)
    split_qkv = next(feature for feature in FEATURES if feature.name == "split_qkv")
    readme = root / "batch/README.md"
    assert "batch/README.md" not in places(split_qkv, root)
    readme.write_text(readme.read_text() + "\nSet GDN_SPLIT_QKV=0 to compare.\n")
    assert "batch/README.md" in places(split_qkv, root)


if __name__ == "__main__":
    sys.exit(print(report()))
