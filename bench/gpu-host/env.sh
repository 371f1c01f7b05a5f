#!/bin/bash
# Sourced from the repository root on the GPU kit's host (../shared/gpu-kit): the kit's paths,
# a patched copy of its vLLM (made once per host), and the package's plugin entry point.
# shellcheck disable=SC1091
bash .gpu-kit/recv.sh > /dev/null || { echo "gpu-host: the kit is not unpacked" >&2; return 1; }
source /tmp/gpu-kit/env.sh
export R=/tmp/hq  # job logs and outputs; they outlive one device call on a warm host
mkdir -p "$R"
export HYPERQWEN_STOCK_VLLM=/tmp/gpu-kit/vllm-stock HYPERQWEN_PATCHED_VLLM=/tmp/gpu-kit/vllm-patched
# patched_vllm_copy DIR SERIES_DIR LOG: DIR/vllm is the kit's stock vLLM with SERIES_DIR's
# patch series applied, made once (DIR/PATCHED marks it done); the apply's output in LOG.
patched_vllm_copy() {
  [ -f "$1/PATCHED" ] && return 0
  rm -rf "$1"
  if cp -a "$HYPERQWEN_STOCK_VLLM" "$1" && HYPERQWEN_PATCHES_DIR="$2" \
    PYTHONPATH="$PWD/src:$PYTHONPATH" python3 -m hyperqwen.cli patches apply "$1/vllm" > "$3" 2>&1; then
    touch "$1/PATCHED"
  else
    echo "gpu-host: patching $1 with $2 failed:" >&2
    tail "$3" >&2
    return 1
  fi
}
patched_vllm_copy "$HYPERQWEN_PATCHED_VLLM" "$PWD/patches" "$R/patch.log"
# py-spy for bench ab's host stacks (src/hyperqwen/bench/host_stacks.py): the kit has none, so a
# run carries the binary as .gpu-kit/py-spy (an ignored path); kept in $R for later calls
if [ -x .gpu-kit/py-spy ]; then cp .gpu-kit/py-spy "$R/py-spy"; fi
if [ -x "$R/py-spy" ]; then export HYPERQWEN_PY_SPY=$R/py-spy; fi
# vLLM finds the plugin through the installed package's entry point; here src/ is only on the
# path, so the GPU tests' writer (tests/gpu_server.py) gives it pyproject.toml's entry points.
# The kit's data folder holds SmolLM2's package (`bench smollm2`) where the kit was built with it.
export KIT_PYTHONPATH="/tmp/gpu-kit/data:$PYTHONPATH" # the kit alone, for another checkout's servers
export PYTHONPATH="$R/site:$PWD/src:$KIT_PYTHONPATH"
if [ ! -d "$R/site" ]; then
  PYTHONPATH="$PWD/tests:$PYTHONPATH" python3 -c 'import sys; from pathlib import Path
from gpu_server import write_plugin_metadata; write_plugin_metadata(Path(sys.argv[1]))' "$R/site" ||
    { echo "gpu-host: could not write the plugin's entry-point metadata" >&2; return 1; }
fi
