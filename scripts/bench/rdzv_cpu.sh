#!/bin/bash
# CPU time of one elrun agent alone (3 runs, /usr/bin/time), and of the elrun-rdzv daemon
# serving a 128-agent job (/proc/PID/stat). Run from the repo root after
# `bazel build //launcher:elrun //agent/daemon:elrun-rdzv`. Traffic stays on 127.0.0.1.
set -u
cd "$(dirname "$0")/../.."
ELRUN=$(python3 -m tests.support.paths elrun) RDZV=$(python3 -m tests.support.paths elrun-rdzv)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$RDZV" --listen 127.0.0.1:0 --port-file "$tmp/pf" >/dev/null & D=$!
for _ in $(seq 200); do [ -s "$tmp/pf" ] && break; sleep 0.05; done  # at most 10 s
[ -s "$tmp/pf" ] || { echo "elrun-rdzv did not start" >&2; kill $D; exit 1; }
P=$(cat "$tmp/pf")
for i in 1 2 3; do
  /usr/bin/env time -f "one agent alone: user %U s, sys %S s" "$ELRUN" --nnodes 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$P --rdzv-id one$i --no-python /bin/true 2>&1 | tail -1
done
tck=$(getconf CLK_TCK); before=$(awk '{print $14+$15}' /proc/$D/stat)
pids=(); for i in $(seq 128); do "$ELRUN" --nnodes 128 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$P --rdzv-id big --no-python /bin/true & pids+=($!); done
fails=0; for p in "${pids[@]}"; do wait $p || fails=$((fails+1)); done
after=$(awk '{print $14+$15}' /proc/$D/stat)
echo "128 agents: $fails failed; daemon CPU $(awk -v t="$tck" -v a="$after" -v b="$before" 'BEGIN {printf "%.2f", (a - b) / t}') s"
kill $D
