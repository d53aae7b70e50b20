#!/usr/bin/env bash
# The formatting check of scripts/test.sh: every C++ file in git (third_party/ aside) must be as
# clang-format leaves it under .clang-format. Lists each file that is not and exits 1; with
# --fix, formats them in place instead.
set -uo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.h' '*.cc' | grep -v '^third_party/')
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  printf 'check_format: not formatted (run scripts/check_format.sh --fix): %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check_format: ${#files[@]} C++ files formatted"
