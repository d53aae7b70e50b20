#!/usr/bin/env bash
# Bazel's --workspace_status_command (.bazelrc): the commit the binaries say they were built from
# (elrun --version, elrun-rdzv --version; //release:build_stamp). Prints nothing outside a git
# checkout, and the binaries then say "unknown".
commit=$(git rev-parse --short=12 HEAD 2>/dev/null) || exit 0
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  commit="$commit-dirty"
fi
echo "STABLE_ELRUN_COMMIT $commit"
