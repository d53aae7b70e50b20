#!/usr/bin/env bash
# The README's test command: setup, then every Bazel test (the launcher's and the rendezvous'
# unit tests a second time under ASan + UBSan), the formatting check and the Python lint, then
# one closing line "N passed, N failed, N skipped" counting test targets. A target that printed a line
# "ELRUN_SKIP: <reason>" (a GPU test on a machine without one) counts as skipped, never as passed,
# and its reason is shown. Exits non-zero when anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh test || { echo "0 passed, 1 failed"; exit 1; }

log=$(mktemp)
trap 'rm -f "$log"' EXIT
# Tests always run: a result cached from another checkout (the disk cache keeps test results
# too) would say nothing about this machine's processes, signals and ports.
bazel test //... --cache_test_results=no "$@" 2>&1 | tee "$log"
bazel_rc=${PIPESTATUS[0]}

# Bazel's summary has one line per test target: "//pkg:name   (cached) PASSED in 0.3s".
# Counted now, while bazel-testlogs still points at this run's logs.
passed=0
skipped=0
count_passed() {
  for target in $(grep -oE '^//[^ ]+ +(\(cached\) )?PASSED' "$1" | awk '{print $1}'); do
    path=${target#//}
    test_log="bazel-testlogs/${path/://}/test.log"
    reason=$(grep -m1 '^ELRUN_SKIP:' "$test_log" 2>/dev/null || true)
    if [ -n "$reason" ]; then
      skipped=$((skipped + 1))
      echo "skipped $target: ${reason#ELRUN_SKIP: }"
    else
      passed=$((passed + 1))
    fi
  done
}
count_passed "$log"

# The formatting check (.clang-format, scripts/check_format.sh) counts as one test target.
if bash scripts/check_format.sh; then
  passed=$((passed + 1))
else
  echo "//scripts:check_format FAILED" >>"$log"
fi

# The Python lint (ruff.toml, scripts/lint.sh) counts as one test target too.
if bash scripts/lint.sh; then
  passed=$((passed + 1))
else
  echo "//scripts:lint FAILED" >>"$log"
fi

# The launcher's and the rendezvous' unit tests again under AddressSanitizer and
# UndefinedBehaviorSanitizer (.bazelrc's --config=sanitize, its own output tree); each counts
# as a test target of its own.
sanitize_log=$(mktemp)
trap 'rm -f "$log" "$sanitize_log"' EXIT
bazel test --config=sanitize //tests/agent/... //tests/launcher/... --cache_test_results=no "$@" \
  2>&1 | tee "$sanitize_log"
sanitize_rc=${PIPESTATUS[0]}
count_passed "$sanitize_log"
cat "$sanitize_log" >> "$log"
[ "$bazel_rc" -eq 0 ] && bazel_rc=$sanitize_rc

failed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|FLAKY|NO STATUS|INCOMPLETE|FAILED TO BUILD)' "$log")
if [ "$bazel_rc" -ne 0 ] && [ "$failed" -eq 0 ]; then
  failed=1  # The build itself broke before any test ran.
fi
if [ "${CI:-}" = "true" ]; then
  bazel shutdown >/dev/null 2>&1 || true  # CI leaves no server behind.
fi
echo "${passed} passed, ${failed} failed, ${skipped} skipped"
[ "$failed" -eq 0 ] && [ "$bazel_rc" -eq 0 ]
