#!/bin/bash
# Wait until every job bg.sh started has ended, or LIMIT seconds (default 500); then print each
# job's status and log tail (TAILN lines) and pack $R's files under MAXKB KiB into $OUT/hq.tgz:
# the device tool brings back only a few files per call.
# shellcheck disable=SC1091
source bench/gpu-host/env.sh || exit 1
limit=${LIMIT:-500}
start=$(date +%s)
while :; do
  pending=""
  for log in "$R"/*.log; do
    name=$(basename "$log" .log)
    [ -d "$R/$name" ] && [ ! -f "$R/$name.rc" ] && pending="$pending $name"
  done
  [ -z "$pending" ] && break
  [ $(($(date +%s) - start)) -ge "$limit" ] && break
  sleep 10
done
echo "pending:${pending:- none}"
for rc in "$R"/*.rc; do [ -f "$rc" ] && echo "$(basename "$rc" .rc) rc=$(cat "$rc")"; done
for log in "$R"/*.log; do echo "=== $log"; tail -n "${TAILN:-15}" "$log"; done
(cd "$R" && find . -type f -size -"${MAXKB:-3000}"k | grep -v '/cache/\|/site/\|^./tree-\|\.safetensors$\|tokenizer' |
  tar -czf "$OUT/hq.tgz" -T -)
nvidia-smi --query-gpu=memory.used --format=csv,noheader
