#!/usr/bin/env bash
# Builds elrun's wheel: dist/elrun-<version>-py3-none-<manylinux tag>.whl with the elrun and
# elrun-rdzv programs (installed onto PATH by pip) and the `elrun` Python package, repaired by
# auditwheel (release/wheel.py). Prints one JSON line: the wheel, its tag and glibc floor.
#   scripts/build_wheel.sh && pip install dist/elrun-*.whl
# DIST=DIR puts it elsewhere. Installs what it needs first (scripts/setup.sh wheel).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh wheel >&2
bazel build //launcher:elrun //agent/daemon:elrun-rdzv >&2
/usr/bin/python3 release/wheel.py --elrun bazel-bin/launcher/elrun \
  --elrun-rdzv bazel-bin/agent/daemon/elrun-rdzv --dist "${DIST:-dist}" \
  --auditwheel "${ELRUN_CACHE:-$HOME/.cache/elrun}/wheel-tools/bin/auditwheel"
