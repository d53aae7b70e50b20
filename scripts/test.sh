#!/usr/bin/env bash
# The README's test command: setup, then every Bazel test, then one closing line
# "N passed, N failed" counting test targets. Exits non-zero when anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh || { echo "0 passed, 1 failed"; exit 1; }

log=$(mktemp)
trap 'rm -f "$log"' EXIT
# Tests always run: a result cached from another checkout (the disk cache keeps test results
# too) would say nothing about this machine's processes, signals and ports.
bazel test //... --cache_test_results=no "$@" 2>&1 | tee "$log"
bazel_rc=${PIPESTATUS[0]}

# Bazel's summary has one line per test target: "//pkg:name   (cached) PASSED in 0.3s".
passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|FLAKY|NO STATUS|INCOMPLETE|FAILED TO BUILD)' "$log")
if [ "$bazel_rc" -ne 0 ] && [ "$failed" -eq 0 ]; then
  failed=1  # The build itself broke before any test ran.
fi
if [ "${CI:-}" = "true" ]; then
  bazel shutdown >/dev/null 2>&1 || true  # CI leaves no server behind.
fi
echo "${passed} passed, ${failed} failed"
[ "$failed" -eq 0 ] && [ "$bazel_rc" -eq 0 ]
