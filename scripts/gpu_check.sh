#!/usr/bin/env bash
# The GPU path, checked in one short run on a machine with NVIDIA GPUs, from a copy of the checkout
# that holds gpu_bundle/ (made by scripts/gpu_bundle.sh on the build machine; the GPU host needs no
# Bazel). It uses that host's torch 2.11 (TORCH_PYTHON, default /opt/torch/.venv/bin/python3) for
# the libraries, the Python twin and torchrun, and runs, each bounded by `timeout`:
#   1. the CUDA unit tests (tests/trainer/cuda_test.cc) at the GPU count;
#   2. the main job: elrun --nproc-per-node gpu, elrun-train on CUDA + NCCL, one epoch of
#      FashionNet with SyncBatchNorm (DDP), test accuracy;
#   3. FSDP (full shard, Adam) at the GPU count, with the memory report (caching allocator);
#   4. CUDA against CPU from the same seed: 50 steps each (one rank, ATen's Linear, fp32 without
#      TF32), the largest difference of the final parameters;
#   5. samples/s of elrun-train against the Python twin (torchrun, DDP, nccl) on one GPU at batch
#      64, 256 and 1024.
# Writes $OUT/gpu_report.md (or gpu_check_out/) and the raw logs next to it; exits 1 if a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
python=${TORCH_PYTHON:-/opt/torch/.venv/bin/python3}
out=${OUT:-$repo/gpu_check_out}
mkdir -p "$out"
report=$out/gpu_report.md
bin=$repo/gpu_bundle/bin
[ -x "$bin/elrun-train" ] || { echo "gpu_check: no gpu_bundle/ (run scripts/gpu_bundle.sh where Bazel is)" >&2; exit 2; }
site=$("$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))') ||
  { echo "gpu_check: $python has no torch" >&2; exit 2; }
libs=$repo/gpu_bundle/lib:$site/torch/lib
for d in "$site"/nvidia/*/lib "$site"/nvidia/cu*/lib; do [ -d "$d" ] && libs=$libs:$d; done
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHON_EXEC=$python
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())')
# The bundle's copy of Fashion-MNIST (the GPU host has no Debian dataset package).
data=(--data-dir "$repo/gpu_bundle/fashion-mnist")
failed=0
work=$(mktemp -d /tmp/gpu_check.XXXXXX)

say() { echo "$*" | tee -a "$report"; }
end_record() { grep '"event":"end"' "$1" | tail -1; }
field() { "$python" -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2" 2>/dev/null || echo "?"; }
# run NAME SECONDS COMMAND...: the command's output goes to $out/NAME.log; a failure is reported.
run() {
  local name=$1 seconds=$2
  shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$seconds" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    failed=1
    say "- **$name failed** (exit $rc after $((SECONDS - start)) s); last lines:"
    tail -5 "$out/$name.log" | sed 's/^/    /' | tee -a "$report"
  fi
  return $rc
}

: >"$report"
say "# elrun GPU check ($(date -u +%Y-%m-%dT%H:%MZ))"
say ""
say "- host: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1), $gpus GPU(s) visible"
say "- torch: $("$python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "NCCL", ".".join(map(str, torch.cuda.nccl.version())))')"
say "- binaries: gpu_bundle/ of commit $(cat gpu_bundle/COMMIT 2>/dev/null || echo '?')"
say ""

say "## 1. CUDA unit tests (cuda_test, $gpus rank(s))"
if run cuda_test 300 "$bin/cuda_test"; then say "- passed: $(grep -E 'test cases' "$out/cuda_test.log" | tail -1)"; fi

say "## 2. Main job: elrun --nproc-per-node gpu, FashionNet + SyncBatchNorm, 1 epoch, CUDA + NCCL"
if run main_job 400 "$bin/elrun" --standalone --nproc-per-node gpu "$bin/elrun-train" "${data[@]}" --device cuda --sync-bn \
    --epochs 1 --batch-size 64 --metrics-file "$work/main.jsonl"; then
  rec=$(end_record "$work/main.jsonl")
  say "- $(field "$rec" steps) steps, $(field "$rec" seconds) s, $(field "$rec" samples_per_s) samples/s, test accuracy $(field "$rec" test_accuracy), device $(field "$rec" device), backend $(field "$rec" backend)"
fi

say "## 3. FSDP (full shard), Adam, $gpus rank(s), memory report"
if run fsdp 300 "$bin/elrun" --standalone --nproc-per-node gpu "$bin/elrun-train" "${data[@]}" --device cuda --strategy fsdp \
    --optimizer adam --max-steps 200 --report-memory --metrics-file "$work/fsdp.jsonl"; then
  rec=$(end_record "$work/fsdp.jsonl")
  say "- test accuracy after 200 steps $(field "$rec" test_accuracy), $(field "$rec" samples_per_s) samples/s"
  grep '^memory rank' "$out/fsdp.log" | sed 's/^/    /' | tee -a "$report"
fi

say "## 4. CUDA against CPU, same seed, 50 steps, one rank"
common=(--max-steps 50 --lr-schedule constant --linear aten --batch-size 64 --seed 3)
if run same_seed_cuda 200 "$bin/elrun" --standalone --nproc-per-node 1 "$bin/elrun-train" "${data[@]}" --device cuda "${common[@]}" \
    --checkpoint-dir "$work/cuda" &&
   run same_seed_cpu 300 "$bin/elrun" --standalone --nproc-per-node 1 "$bin/elrun-train" "${data[@]}" --device cpu "${common[@]}" \
    --checkpoint-dir "$work/cpu"; then
  diff=$("$python" - "$work/cuda/checkpoint.pt" "$work/cpu/checkpoint.pt" <<'PY'
import sys, torch
a, b = (torch.load(p, map_location="cpu", weights_only=False)["model"] for p in sys.argv[1:3])
print(max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point()))
PY
)
  verdict=$("$python" -c "print('within' if float('$diff') < 1e-3 else 'OUTSIDE')" 2>/dev/null || echo "?")
  [ "$verdict" = within ] || failed=1
  say "- largest |CUDA - CPU| over all parameters and buffers after 50 steps: $diff ($verdict the fp32 bound 1e-3)"
fi

say "## 5. samples/s on one GPU: elrun-train vs the Python twin (DDP, nccl, 300 steps)"
say ""
say "| batch | elrun-train | Python twin | ratio |"
say "|---:|---:|---:|---:|"
for batch in 64 256 1024; do
  # --allow-tf32: cuDNN's TF32 convolutions, the Python twin's (PyTorch's) default.
  run "elrun_b$batch" 200 "$bin/elrun" --standalone --nproc-per-node 1 "$bin/elrun-train" "${data[@]}" --device cuda --allow-tf32 \
    --batch-size "$batch" --max-steps 300 --lr-schedule constant --linear aten --log-every 0 \
    --metrics-file "$work/elrun_b$batch.jsonl"
  run "twin_b$batch" 300 "$python" scripts/bench/torchrun_compat.py --standalone --nproc_per_node 1 \
    scripts/bench/fashion_twin.py "${data[@]}" --device cuda --batch-size "$batch" --max-steps 300 --lr-schedule constant \
    --log-every 0 --metrics-file "$work/twin_b$batch.jsonl"
  e=$(field "$(end_record "$work/elrun_b$batch.jsonl" 2>/dev/null)" samples_per_s)
  t=$(field "$(end_record "$work/twin_b$batch.jsonl" 2>/dev/null)" samples_per_s)
  r=$("$python" -c "print(f'{float(\"$e\") / float(\"$t\"):.2f}x')" 2>/dev/null || echo "?")
  say "| $batch | $e | $t | $r |"
done
say ""
say "Logs: $(ls "$out" | tr '\n' ' ')"
rm -rf "$work"
[ $failed -eq 0 ] && say "All checks passed." || say "Some checks FAILED."
exit $failed
