#!/usr/bin/env bash
# The Python lint of scripts/test.sh: ruff (ruff.toml: pyflakes and pycodestyle) over every Python
# file in git (third_party/ aside). ruff comes from scripts/setup.sh (test mode), pinned, in its own
# environment under ~/.cache/elrun; RUFF overrides the path. Prints what it finds and exits 1 on
# any finding; with --fix, applies ruff's safe fixes first.
set -uo pipefail
cd "$(dirname "$0")/.."
ruff=${RUFF:-${ELRUN_CACHE:-$HOME/.cache/elrun}/lint-tools/bin/ruff}
if [ ! -x "$ruff" ]; then
  echo "lint: $ruff is missing: run scripts/setup.sh test" >&2
  exit 1
fi
mapfile -t files < <(git ls-files '*.py' | grep -v '^third_party/')
if [ "${1:-}" = "--fix" ]; then
  "$ruff" check --fix "${files[@]}"
  exit
fi
if "$ruff" check --quiet "${files[@]}"; then
  echo "lint: ${#files[@]} Python files clean ($("$ruff" --version))"
else
  echo "lint: findings above (scripts/lint.sh --fix applies ruff's safe fixes)" >&2
  exit 1
fi
