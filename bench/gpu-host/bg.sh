#!/bin/bash
# bench/gpu-host/bg.sh NAME COMMAND: run COMMAND detached from this device call, from the
# repository root; its output in $R/NAME.log, its exit status in $R/NAME.rc, and the GPU tests'
# logs in $R/NAME/ (HYPERQWEN_TEST_LOGS). Poll with wait_all.sh.
# shellcheck disable=SC1091
source bench/gpu-host/env.sh || exit 1
name=$1
shift
mkdir -p "$R/$name"
rm -f "$R/$name.rc"
setsid nohup bash -c "export HYPERQWEN_TEST_LOGS=$R/$name; ( $* ) > $R/$name.log 2>&1; echo \$? > $R/$name.rc" \
  > /dev/null 2>&1 < /dev/null &
echo "started $name: $*"
