#!/bin/bash
# Stop every plan, test, server and bench this host runs, never this command's own shell or its
# parents (a pattern on the command line would match the shell that runs it). Plans first: a
# plan whose step is killed goes on to its next step; killed itself, its bg.sh wrapper records
# the exit status, so wait_all.sh stops waiting for it.
ancestors=" "
pid=$$
while [ "${pid:-1}" -gt 1 ]; do
  ancestors="$ancestors$pid "
  pid=$(ps -o ppid= -p "$pid" | tr -d ' ')
done
for signal in TERM KILL; do
  for pattern in gpu-host/plans/ pytest vllm.entrypoints hyperqwen.cli EngineCore "vllm serve"; do
    for pid in $(pgrep -f "$pattern"); do
      case "$ancestors" in *" $pid "*) ;; *) kill -"$signal" "$pid" 2> /dev/null ;; esac
    done
  done
  sleep 4
done
nvidia-smi --query-gpu=memory.used --format=csv,noheader
