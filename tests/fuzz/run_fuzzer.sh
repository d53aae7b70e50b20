#!/usr/bin/env bash
# Runs the rendezvous fuzzer for FUZZ_SECONDS (20) from an empty corpus; any crash, sanitizer
# report or broken invariant fails the test with libFuzzer's reproducer in the log.
set -euo pipefail
corpus="${TEST_TMPDIR:-/tmp}/rendezvous_corpus"
mkdir -p "$corpus"
"$1" -max_total_time="${FUZZ_SECONDS:-20}" -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="${TEST_UNDECLARED_OUTPUTS_DIR:-/tmp}/" "$corpus"
echo "corpus: $(ls "$corpus" | wc -l) inputs"
