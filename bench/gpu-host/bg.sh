#!/bin/bash
# bench/gpu-host/bg.sh NAME COMMAND: run COMMAND detached from this device call, from a copy of
# the repository taken now ($R/tree-NAME); its output in $R/NAME.log, its exit status in
# $R/NAME.rc, and the GPU tests' logs in $R/NAME/ (HYPERQWEN_TEST_LOGS). Poll with wait_all.sh.
# The copy, because every device call lays the working tree down again: a server importing a
# module lazily during a later call found it missing (ModuleNotFoundError at graph capture).
# shellcheck disable=SC1091
source bench/gpu-host/env.sh || exit 1
name=$1
shift
tree=$R/tree-$name
rm -rf "$tree"
mkdir -p "$R/$name" "$tree"
tar --exclude='./.gpu-kit/part-*' -cf - . | tar -xf - -C "$tree" || exit 1
cd "$tree" || exit 1
source bench/gpu-host/env.sh || exit 1 # this copy's src/ first on the path
rm -f "$R/$name.rc"
setsid nohup bash -c "export HYPERQWEN_TEST_LOGS=$R/$name; ( $* ) > $R/$name.log 2>&1; echo \$? > $R/$name.rc" \
  > /dev/null 2>&1 < /dev/null &
echo "started $name in $tree: $*"
