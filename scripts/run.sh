#!/usr/bin/env bash
# The README's main-job command: setup, build, then elrun --standalone with 2 workers training
# FashionNet with DDP + SyncBatchNorm on Fashion-MNIST (elrun-train, LibTorch, Gloo on CPU),
# printing the test accuracy at the end. EPOCHS (default 2) sets the length; extra arguments go
# to elrun-train (see bazel-bin/trainer/app/elrun-train --help).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh run
bazel build //launcher:elrun //trainer/app:elrun-train
run_dir=${RUN_DIR:-$(mktemp -d /tmp/elrun-run.XXXXXX)}
echo "checkpoints and metrics in $run_dir"
exec bazel-bin/launcher/elrun --standalone --nproc-per-node 2 --max-restarts 1 \
  bazel-bin/trainer/app/elrun-train --model fashionnet --sync-bn --epochs "${EPOCHS:-2}" \
  --batch-size 64 --threads 1 --checkpoint-dir "$run_dir/checkpoints" --checkpoint-every 200 \
  --metrics-file "$run_dir/metrics.jsonl" "$@"
