"""The patch-series machinery on a pristine vLLM unpacked from the pinned wheel, with real
patches: the series' root probe (also checked on the real OpenAI app) and small patches made
here on top of it."""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import py_compile
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from vllm_trees import copy_vllm_tree

from hyperqwen.patches.cli import add_subcommand, render_markdown
from hyperqwen.patches.series import PatchSeriesError, load_series
from hyperqwen.patches.tree import PatchState, apply_series, check_series, series_status
from hyperqwen.settings import PINNED_VLLM

ROOT = Path(__file__).resolve().parents[1]
SERIES_DIR = ROOT / "patches"
PROBE = "root-probe.patch"
BASIC = "entrypoints/serve/instrumentator/basic.py"
SELECT_CPU_PLATFORM = (
    "import vllm.platforms as platforms\n"
    "from vllm.platforms.cpu import CpuPlatform\n"
    "platforms._current_platform = CpuPlatform()\n"
)


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under root, by relative path (bytecode caches left out)."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def run_on_tree(vllm_dir: Path, code: str) -> dict:
    """Run code in a fresh interpreter that imports vllm from vllm_dir (CPU platform first);
    the code prints one JSON object as its last line."""
    prelude = f"import sys\nsys.path.insert(0, {str(vllm_dir.parent)!r})\n" + SELECT_CPU_PLATFORM
    done = subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=vllm_dir.parent,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="hyperqwen")
    add_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["patches", *argv])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def make_series(folder: Path, patches: dict[str, str]) -> Path:
    """A series folder holding `patches` (name -> text) in the given order."""
    folder.mkdir(parents=True)
    (folder / "series").write_text("# test series\n" + "".join(f"{n}\n" for n in patches))
    for name, text in patches.items():
        (folder / name).write_text(text)
    return folder


def make_patch(what: str, relative: str, old: str | None, new: str | None) -> str:
    """A real unified diff of one file (None = the file does not exist) with its preamble."""
    body = difflib.unified_diff(
        (old or "").splitlines(keepends=True),
        (new or "").splitlines(keepends=True),
        fromfile=f"a/{relative}" if old is not None else "/dev/null",
        tofile=f"b/{relative}" if new is not None else "/dev/null",
    )
    preamble = f"Kind: local\nWhat: {what}\nUpstream: none\nRetires-when: never (a test patch)\n"
    return preamble + "\n" + "".join(body)


def probe_text() -> str:
    return (SERIES_DIR / PROBE).read_text()


@pytest.fixture(scope="module")
def patched_vllm_dir(pristine_vllm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the pristine tree with the repository's whole series applied."""
    target = tmp_path_factory.mktemp("patched-vllm") / "vllm"
    copy_vllm_tree(pristine_vllm_dir, target)
    apply_series(load_series(SERIES_DIR), target)
    return target


def test_patches_md_matches_the_series():
    assert (ROOT / "PATCHES.md").read_text() == render_markdown(load_series(SERIES_DIR)), (
        "PATCHES.md drifted from patches/: hyperqwen patches list --markdown > PATCHES.md"
    )


def test_series_applies_to_pristine_and_changes_only_what_it_touches(
    pristine_vllm_dir, patched_vllm_dir
):
    series = load_series(SERIES_DIR)
    before, after = tree_digest(pristine_vllm_dir), tree_digest(patched_vllm_dir)
    changed = {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}
    assert changed == set(series.touched_paths)
    assert [c.state for c in check_series(series, patched_vllm_dir)] == [PatchState.APPLIED] * len(
        series.patches
    )
    # A patch that is already "applied" on pristine vLLM is upstream now: retire it.
    assert [c.state for c in check_series(series, pristine_vllm_dir)] == [PatchState.MISSING] * len(
        series.patches
    )


def test_touched_files_compile(patched_vllm_dir, tmp_path):
    for relative in load_series(SERIES_DIR).touched_paths:
        if relative.endswith(".py"):
            py_compile.compile(
                str(patched_vllm_dir / relative), cfile=str(tmp_path / "out.pyc"), doraise=True
            )


def test_touched_modules_import_from_the_patched_tree(patched_vllm_dir):
    modules = [
        "vllm." + relative.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for relative in load_series(SERIES_DIR).touched_paths
        if relative.endswith(".py")
    ]
    files = run_on_tree(
        patched_vllm_dir,
        "import importlib, json\n"
        f"names = ['vllm', *{modules!r}]\n"
        "print(json.dumps({n: importlib.import_module(n).__file__ for n in names}))\n",
    )
    assert set(files) == {"vllm", *modules}
    for name, file in files.items():
        assert Path(file).is_relative_to(patched_vllm_dir), f"{name} came from {file}"


def test_root_probe_answers_keyless_on_the_real_app(patched_vllm_dir):
    result = run_on_tree(
        patched_vllm_dir,
        "import json\n"
        "from starlette.testclient import TestClient\n"
        "import vllm\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.openai.cli_args import make_arg_parser\n"
        "from vllm.entrypoints.openai.api_server import build_app\n"
        "args = make_arg_parser(FlexibleArgumentParser()).parse_args(\n"
        "    ['--model', 'm', '--api-key', 'k'])\n"
        "client = TestClient(build_app(args, ('generate',), None))\n"
        "get, head = client.get('/'), client.head('/')\n"
        "models = client.get('/v1/models')\n"
        "key = {'Authorization': 'Bearer k'}\n"
        "client.get('/openapi.json', headers=key)\n"
        "metrics = client.get('/metrics', headers=key).text\n"
        "print(json.dumps({'vllm': vllm.__file__, 'get': [get.status_code, get.json()],\n"
        "    'head': [head.status_code, head.text], 'models': models.status_code,\n"
        "    'handlers': sorted({line.split('handler=\"')[1].split('\"')[0]\n"
        "        for line in metrics.splitlines() if 'handler=\"' in line})}))\n",
    )
    assert Path(result["vllm"]).is_relative_to(patched_vllm_dir)
    assert result["get"] == [200, {"status": "ok", "version": PINNED_VLLM}]
    assert result["head"] == [200, ""]
    assert result["models"] == 401  # the API itself still needs the key
    assert "/openapi.json" in result["handlers"]  # metrics work ...
    assert "/" not in result["handlers"]  # ... and leave the root probes out


def test_applying_twice_changes_nothing(patched_vllm_dir, capsys):
    before = tree_digest(patched_vllm_dir)
    code, out, _ = cli(capsys, "apply", str(patched_vllm_dir), "--series-dir", str(SERIES_DIR))
    assert code == 0
    assert f"unchanged   {PROBE} (already applied)" in out
    assert tree_digest(patched_vllm_dir) == before


def test_broken_patch_is_refused_by_name_and_hunk(vllm_tree_copy, tmp_path, capsys):
    broken = probe_text().replace(" async def show_version():", " async def show_versions():")
    assert broken != probe_text()
    series = make_series(tmp_path / "series", {PROBE: broken})
    before = tree_digest(vllm_tree_copy)
    code, _, err = cli(capsys, "apply", str(vllm_tree_copy), "--series-dir", str(series))
    assert code == 1
    assert f"conflicting {PROBE}" in err
    assert f"{BASIC}: hunk #1 @@ -54,3 +54,11 @@ does not apply at line 54 with zero fuzz" in err
    assert "nothing was changed" in err
    assert tree_digest(vllm_tree_copy) == before


def test_a_conflict_late_in_the_series_leaves_the_tree_untouched(
    vllm_tree_copy, patched_vllm_dir, tmp_path, capsys
):
    patched = (patched_vllm_dir / BASIC).read_text()
    follow_up = make_patch(
        "say ready", BASIC, patched.replace("status", "STATUS"), patched.replace('"ok"', '"ready"')
    )
    series = make_series(tmp_path / "series", {PROBE: probe_text(), "ready.patch": follow_up})
    before = tree_digest(vllm_tree_copy)
    code, _, err = cli(capsys, "apply", str(vllm_tree_copy), "--series-dir", str(series))
    assert code == 1
    assert "conflicting ready.patch" in err
    assert PROBE not in err
    assert tree_digest(vllm_tree_copy) == before  # root-probe, which did apply, was not kept
    code, out, _ = cli(capsys, "verify", str(vllm_tree_copy), "--series-dir", str(series))
    assert code == 1
    assert f"missing     {PROBE}" in out
    assert "conflicting ready.patch" in out


def test_patches_build_on_earlier_ones_and_create_files(
    vllm_tree_copy, patched_vllm_dir, tmp_path, capsys
):
    patched = (patched_vllm_dir / BASIC).read_text()
    note = "entrypoints/serve/hyperqwen_note/__init__.py"
    docs = "entrypoints/serve/instrumentator/offline_docs.py"
    series = make_series(
        tmp_path / "series",
        {
            PROBE: probe_text(),
            "ready.patch": make_patch(
                "say ready", BASIC, patched, patched.replace('"ok"', '"rdy"')
            ),
            "note.patch": make_patch("add a module", note, None, 'NOTE = "from a patch"\n'),
            "gone.patch": make_patch(
                "drop a module", docs, (vllm_tree_copy / docs).read_text(), None
            ),
        },
    )
    code, out, _ = cli(capsys, "verify", str(vllm_tree_copy), "--series-dir", str(series))
    assert code == 1  # each judged on top of the ones before it, so none conflicts
    assert out.splitlines()[:4] == [
        f"missing     {PROBE}",
        "missing     ready.patch",
        "missing     note.patch",
        "missing     gone.patch",
    ]
    code, out, _ = cli(capsys, "apply", str(vllm_tree_copy), "--series-dir", str(series))
    assert code == 0, out
    assert '"status": "rdy"' in (vllm_tree_copy / BASIC).read_text()
    assert (vllm_tree_copy / note).read_text() == 'NOTE = "from a patch"\n'
    assert not (vllm_tree_copy / docs).exists()
    assert not list(vllm_tree_copy.rglob(".*.py.*"))  # no temporary files left behind
    digest = tree_digest(vllm_tree_copy)
    code, out, _ = cli(capsys, "apply", str(vllm_tree_copy), "--series-dir", str(series))
    assert (code, out.count("(already applied)")) == (0, 4)
    assert tree_digest(vllm_tree_copy) == digest

    (vllm_tree_copy / note).write_text("NOTE = 'someone else put this file here'\n")
    code, out, _ = cli(capsys, "verify", str(vllm_tree_copy), "--series-dir", str(series))
    assert code == 1
    assert "conflicting note.patch" in out
    assert "would create the file" in out


def test_offsets_are_allowed_and_reported(vllm_tree_copy, patched_vllm_dir, tmp_path, capsys):
    shifted = probe_text().replace("@@ -54,3 +54,11 @@", "@@ -50,3 +50,11 @@")
    series = make_series(tmp_path / "series", {PROBE: shifted})
    code, out, _ = cli(capsys, "apply", str(vllm_tree_copy), "--series-dir", str(series))
    assert code == 0
    assert f"{BASIC}: hunk #1 applies at line 54 (offset 4)" in out
    assert (vllm_tree_copy / BASIC).read_bytes() == (patched_vllm_dir / BASIC).read_bytes()


def test_verify_reports_applied_missing_and_conflicting(vllm_tree_copy, capsys):
    def verify() -> tuple[int, str]:
        code, out, _ = cli(capsys, "verify", str(vllm_tree_copy), "--series-dir", str(SERIES_DIR))
        return code, out

    names = [patch.name for patch in load_series(SERIES_DIR).patches]
    code, out = verify()
    assert (code, out.splitlines()[0]) == (1, f"missing     {PROBE}")
    missing = ", ".join(f"{name} missing" for name in names)
    assert series_status(vllm_tree_copy, SERIES_DIR) == (
        False,
        f"{len(names)} of {len(names)} patches not applied: {missing}",
    )

    assert cli(capsys, "apply", str(vllm_tree_copy), "--series-dir", str(SERIES_DIR))[0] == 0
    code, out = verify()
    assert (code, out.splitlines()[0]) == (0, f"applied     {PROBE}")
    assert series_status(vllm_tree_copy, SERIES_DIR) == (
        True,
        f"all {len(names)} patches of the series applied",
    )

    basic = vllm_tree_copy / BASIC
    basic.write_text(basic.read_text().replace("ver = {", "ver = {'build': 1, "))
    code, out = verify()
    assert (code, out.splitlines()[0]) == (1, f"conflicting {PROBE}")
    assert f"{BASIC}: hunk #1 @@ -54,3 +54,11 @@ does not apply" in out
    assert "previously applied" in out  # metrics.py still has its half
    assert series_status(vllm_tree_copy, SERIES_DIR)[0] is False


@pytest.mark.parametrize("action", ["apply", "verify", "list"])
def test_series_and_folder_mismatch_refuses_to_start(action, pristine_vllm_dir, tmp_path, capsys):
    where = [str(pristine_vllm_dir)] if action != "list" else []
    unlisted = make_series(tmp_path / "unlisted", {PROBE: probe_text()})
    (unlisted / "extra.patch").write_text(probe_text())
    code, _, err = cli(capsys, action, *where, "--series-dir", str(unlisted))
    assert code == 2
    assert "extra.patch is in" in err and "refusing to start" in err

    ghost = make_series(tmp_path / "ghost", {PROBE: probe_text()})
    (ghost / "series").write_text(f"{PROBE}\nghost.patch  # forgot to add the file\n")
    code, _, err = cli(capsys, action, *where, "--series-dir", str(ghost))
    assert code == 2
    assert "ghost.patch is listed in" in err


@pytest.mark.parametrize(
    ("edit", "complaint"),
    [
        (lambda t: t.replace("Kind: feature\n", ""), "preamble lacks Kind"),
        (lambda t: t.replace("Kind: feature", "Kind: bugfix"), "'bugfix' is not one of"),
        (lambda t: t.replace("Upstream: none", "Upstream: PR 123"), "must be a PR/issue URL"),
        (lambda t: t.replace("Kind: feature", "Kind: fix\nKind: fix"), "appears twice"),
        (lambda t: t.replace("--- a/", "--- ", 1), "must be a/<path inside the vllm/ package>"),
        (lambda t: t.replace("+++ b/", "+++ b/../", 1), "must be b/<path"),
        (lambda t: t.replace("@@ -54,3 +54,11 @@", "@@ -54,3 +54,12 @@"), "line counts do not"),
        (lambda t: t.replace("@@ -70,6 +70,8 @@", "@@ -70,6 +70,9 @@"), "ends inside a hunk"),
        (
            lambda t: t.replace(f"--- a/{BASIC}", f"--- a/{BASIC}\t1970-01-01 00:00:00 +0000"),
            "write that side as /dev/null",
        ),
        (lambda t: "Kind: fix\n", "no unified diff found"),
    ],
)
def test_malformed_patches_are_refused_with_the_fix(edit, complaint, tmp_path):
    series = make_series(tmp_path / "series", {PROBE: edit(probe_text())})
    with pytest.raises(PatchSeriesError, match=PROBE) as refused:
        load_series(series)
    assert complaint in str(refused.value)


def test_an_empty_series_is_valid(pristine_vllm_dir, tmp_path, capsys):
    empty = make_series(tmp_path / "series", {})
    code, out, _ = cli(capsys, "list", "--series-dir", str(empty))
    assert (code, "is empty" in out) == (0, True)
    code, out, _ = cli(capsys, "list", "--markdown", "--series-dir", str(empty))
    assert f"_The series is empty: vLLM {PINNED_VLLM} runs unpatched._" in out
    before = tree_digest(pristine_vllm_dir / "entrypoints")
    for action in ("apply", "verify"):
        code, _, _ = cli(capsys, action, str(pristine_vllm_dir), "--series-dir", str(empty))
        assert code == 0
    assert tree_digest(pristine_vllm_dir / "entrypoints") == before
    assert series_status(pristine_vllm_dir, empty)[0] is True


def test_default_dir_is_this_pythons_vllm_found_without_importing_it():
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\nfrom hyperqwen.patches.tree import default_vllm_dir\n"
            "print(default_vllm_dir())\nprint('vllm' in sys.modules)\n",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT / "src")},
        timeout=120,
    )
    assert done.stdout.splitlines() == [
        str(Path(sysconfig.get_paths()["purelib"]) / "vllm"),
        "False",
    ]
