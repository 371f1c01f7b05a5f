#!/bin/bash
# Sourced from the repository root on the GPU kit's host (../shared/gpu-kit): the kit's paths,
# a patched copy of its vLLM (made once per host), and the package's plugin entry point.
# shellcheck disable=SC1091
bash .gpu-kit/recv.sh > /dev/null || { echo "gpu-host: the kit is not unpacked" >&2; return 1; }
source /tmp/gpu-kit/env.sh
export R=/tmp/hq  # job logs and outputs; they outlive one device call on a warm host
mkdir -p "$R"
export HYPERQWEN_STOCK_VLLM=/tmp/gpu-kit/vllm-stock HYPERQWEN_PATCHED_VLLM=/tmp/gpu-kit/vllm-patched
if [ ! -f /tmp/gpu-kit/PATCHED ]; then
  rm -rf "$HYPERQWEN_PATCHED_VLLM"
  cp -a "$HYPERQWEN_STOCK_VLLM" "$HYPERQWEN_PATCHED_VLLM"
  if PYTHONPATH="$PWD/src:$PYTHONPATH" python3 -m hyperqwen.cli patches apply \
    "$HYPERQWEN_PATCHED_VLLM/vllm" > "$R/patch.log" 2>&1; then
    touch /tmp/gpu-kit/PATCHED
  else
    echo "gpu-host: patching failed:" >&2
    tail "$R/patch.log" >&2
  fi
fi
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
