#!/usr/bin/env bash
# Passes when clang's thread-safety analysis found nothing (the report's first line is PASS);
# otherwise prints clang's diagnostics: a lock not held where ABSL_GUARDED_BY or
# ABSL_EXCLUSIVE_LOCKS_REQUIRED says it must be.
set -euo pipefail
report="$1"
cat "$report"
[ "$(head -n 1 "$report")" = "PASS" ]
