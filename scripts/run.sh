#!/usr/bin/env bash
# The README's main-job command: setup, build elrun, then launch a real 2-worker PyTorch DDP job
# (Gloo, CPU) on this machine with `elrun --standalone`. Extra arguments go to elrun's job.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
bazel build //launcher:elrun
export PYTHON_EXEC=${PYTHON_EXEC:-/usr/bin/python3}  # Debian's python3-torch lives here.
exec bazel-bin/launcher/elrun --standalone --nproc-per-node 2 --max-restarts 1 \
  scripts/jobs/ddp_regression.py "$@"
