#!/usr/bin/env bash
# The GPU path, checked in one short run on a machine with NVIDIA GPUs, from a copy of the checkout
# that holds gpu_bundle/ (made by scripts/gpu_bundle.sh on the build machine; the GPU host needs no
# Bazel). It uses that host's torch 2.11 (TORCH_PYTHON, default /opt/torch/.venv/bin/python3) for
# the libraries, the Python twin and torchrun, and runs, each bounded by `timeout`:
#   1. the CUDA unit tests (tests/trainer/cuda_test.cc) at the GPU count;
#   2. the main job: elrun --nproc-per-node gpu, elrun-train on CUDA + NCCL, one epoch of
#      FashionNet with SyncBatchNorm (DDP), test accuracy;
#   3. FSDP (full shard, Adam) at the GPU count, with the memory report (caching allocator);
#   4. CUDA against CPU from the same seed (one rank, ATen's Linear, fp32 without TF32): after one
#      step (bound 1e-4) and after 50, next to the spread of two CPU runs (NCHW against NHWC);
#   5. samples/s of elrun-train (eager and --cuda-graph) against the Python twin (torchrun, DDP,
#      nccl) on one GPU at batch 64, 256 and 1024, medians of 3 alternating rounds;
#   6. PyTorch's profiler over 50 steps at batch 64 of both, summarised by
#      tests/support/trace_summary.py (the traces come back in traces.tar.gz).
# GPU_CHECK_SECTIONS="4 5" runs only those sections (device time is scarce); default all six.
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
sections=" ${GPU_CHECK_SECTIONS:-1 2 3 4 5 6} "
section() { [[ "$sections" == *" $1 "* ]]; }
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

if section 1; then
say "## 1. CUDA unit tests (cuda_test, $gpus rank(s))"
if run cuda_test 300 "$bin/cuda_test"; then say "- passed: $(grep -E 'test cases' "$out/cuda_test.log" | tail -1)"; fi

fi
if section 2; then
say "## 2. Main job: elrun --nproc-per-node gpu, FashionNet + SyncBatchNorm, 1 epoch, CUDA + NCCL"
if run main_job 400 "$bin/elrun" --standalone --nproc-per-node gpu "$bin/elrun-train" "${data[@]}" --device cuda --sync-bn \
    --epochs 1 --batch-size 64 --metrics-file "$work/main.jsonl"; then
  rec=$(end_record "$work/main.jsonl")
  say "- $(field "$rec" steps) steps, $(field "$rec" seconds) s, $(field "$rec" samples_per_s) samples/s, test accuracy $(field "$rec" test_accuracy), device $(field "$rec" device), backend $(field "$rec" backend)"
fi

fi
if section 3; then
say "## 3. FSDP (full shard), Adam, $gpus rank(s), memory report"
if run fsdp 300 "$bin/elrun" --standalone --nproc-per-node gpu "$bin/elrun-train" "${data[@]}" --device cuda --strategy fsdp \
    --optimizer adam --max-steps 200 --report-memory --metrics-file "$work/fsdp.jsonl"; then
  rec=$(end_record "$work/fsdp.jsonl")
  say "- test accuracy after 200 steps $(field "$rec" test_accuracy), $(field "$rec" samples_per_s) samples/s"
  grep '^memory rank' "$out/fsdp.log" | sed 's/^/    /' | tee -a "$report"
fi
# The same in bf16 and fp16 (--precision: fsdp gathers in it, ddp runs under autocast; fp16 with
# dynamic loss scaling), and with the shards and Adam's state offloaded to CPU memory: accuracy
# against the fp32 run above, fp16's skipped steps, and the caching allocator's peak per rank.
for variant in "bf16:fsdp:--precision bf16" "fp16:fsdp:--precision fp16" "ddp_bf16:ddp:--precision bf16" \
    "ddp_fp16:ddp:--precision fp16" "offload:fsdp:--offload-optimizer"; do
  name=${variant%%:*}
  rest=${variant#*:}
  strategy=${rest%%:*}
  flags=${rest#*:}
  # shellcheck disable=SC2086
  if run "fsdp_$name" 300 "$bin/elrun" --standalone --nproc-per-node gpu "$bin/elrun-train" "${data[@]}" --device cuda \
      --strategy "$strategy" --optimizer adam --max-steps 200 --report-memory $flags --metrics-file "$work/fsdp_$name.jsonl"; then
    rec=$(end_record "$work/fsdp_$name.jsonl")
    say "- --strategy $strategy $flags: test accuracy after 200 steps $(field "$rec" test_accuracy), $(field "$rec" samples_per_s) samples/s"
    { grep '^fp16:' "$out/fsdp_$name.log" || true; } | sed 's/^/    /' | tee -a "$report"
    grep '^memory rank' "$out/fsdp_$name.log" | sed 's/^/    /' | tee -a "$report"
  fi
done

fi
if section 4; then
say "## 4. CUDA against CPU from the same seed (one rank, ATen's Linear, fp32: no TF32)"
say ""
say "Training amplifies rounding: two correct CPU runs that only sum in another order (NCHW and"
say "NHWC convolutions) drift apart too. So the bound is on one step; 50 steps are reported next to"
say "that CPU-against-CPU spread."
say ""
say "| steps | max abs CUDA - CPU | max abs CPU NHWC - CPU NCHW | loss CUDA / CPU | verdict |"
say "|---:|---:|---:|---:|---|"
compare() {
  "$python" - "$1" "$2" <<'PY2'
import sys, torch
a, b = (torch.load(p, map_location="cpu", weights_only=False)["model"] for p in sys.argv[1:3])
print("%.3g" % max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point()))
PY2
}
last_loss() { grep '"event":"step"' "$1" | tail -1 | "$python" -c 'import json, sys; print("%.4f" % json.loads(sys.stdin.read())["loss"])' 2>/dev/null || echo "?"; }
for steps in 1 50; do
  common=(--max-steps "$steps" --lr-schedule constant --linear aten --batch-size 64 --seed 3 --log-every 1)
  ok=1
  for variant in cuda:cuda:contiguous cpu_nchw:cpu:contiguous cpu_nhwc:cpu:channels-last; do
    IFS=: read -r name device format <<<"$variant"
    run "same_seed_${name}_$steps" 300 "$bin/elrun" --standalone --nproc-per-node 1 "$bin/elrun-train" "${data[@]}" \
      --device "$device" --memory-format "$format" "${common[@]}" --checkpoint-dir "$work/${name}_$steps" \
      --metrics-file "$work/${name}_$steps.jsonl" || ok=0
  done
  [ $ok -eq 1 ] || continue
  cuda_cpu=$(compare "$work/cuda_$steps/checkpoint.pt" "$work/cpu_nchw_$steps/checkpoint.pt")
  cpu_cpu=$(compare "$work/cpu_nhwc_$steps/checkpoint.pt" "$work/cpu_nchw_$steps/checkpoint.pt")
  losses="$(last_loss "$work/cuda_$steps.jsonl") / $(last_loss "$work/cpu_nchw_$steps.jsonl")"
  if [ "$steps" = 1 ]; then
    verdict=$("$python" -c "print('within 1e-4' if float('$cuda_cpu') < 1e-4 else 'OUTSIDE 1e-4')" 2>/dev/null || echo "?")
    [ "$verdict" = "within 1e-4" ] || failed=1
  else
    verdict="reported (no bound)"
  fi
  say "| $steps | $cuda_cpu | $cpu_cpu | $losses | $verdict |"
done

say ""
fi
if section 5; then
say "## 5. samples/s on one GPU: elrun-train vs the Python twin (DDP, nccl, 300 steps, median of 3)"
say ""
say "Both with cuDNN's TF32 convolutions (PyTorch's default) and NCHW; the three runs of a row"
say "alternate (elrun-train, elrun-train --cuda-graph, twin) three times; medians, with the range."
say ""
say "| batch | elrun-train | elrun-train --cuda-graph | Python twin | ratio | ratio, --cuda-graph |"
say "|---:|---:|---:|---:|---:|---:|"
rate() { field "$(end_record "$1" 2>/dev/null)" samples_per_s; }
median() { "$python" -c 'import statistics, sys
v = sorted(float(x) for x in sys.argv[1:] if x != "?")
print("%.0f (%.0f-%.0f)" % (statistics.median(v), v[0], v[-1]) if v else "?")' "$@"; }
ratio() { "$python" -c 'import sys; a, b = (float(x.split()[0]) for x in sys.argv[1:3]); print("%.2fx" % (a / b))' "$1" "$2" 2>/dev/null || echo "?"; }
for batch in 64 256 1024; do
  e=() g=() t=()
  for round in 1 2 3; do
    common=(--device cuda --batch-size "$batch" --max-steps 300 --lr-schedule constant --log-every 0)
    run "elrun_b${batch}_$round" 200 "$bin/elrun" --standalone --nproc-per-node 1 "$bin/elrun-train" "${data[@]}" \
      --allow-tf32 --linear aten "${common[@]}" --metrics-file "$work/elrun_b${batch}_$round.jsonl"
    run "graph_b${batch}_$round" 200 "$bin/elrun" --standalone --nproc-per-node 1 "$bin/elrun-train" "${data[@]}" \
      --allow-tf32 --linear aten --cuda-graph "${common[@]}" --metrics-file "$work/graph_b${batch}_$round.jsonl"
    run "twin_b${batch}_$round" 300 "$python" tests/support/torchrun_compat.py --standalone --nproc_per_node 1 \
      bench/fashion_twin.py "${data[@]}" "${common[@]}" --metrics-file "$work/twin_b${batch}_$round.jsonl"
    e+=("$(rate "$work/elrun_b${batch}_$round.jsonl")")
    g+=("$(rate "$work/graph_b${batch}_$round.jsonl")")
    t+=("$(rate "$work/twin_b${batch}_$round.jsonl")")
  done
  me=$(median "${e[@]}") mg=$(median "${g[@]}") mt=$(median "${t[@]}")
  say "| $batch | $me | $mg | $mt | $(ratio "$me" "$mt") | $(ratio "$mg" "$mt") |"
done
say ""
fi
if section 6; then
say "## 6. Where a step's time goes at batch 64 (PyTorch's profiler, steps 150-199 of 200)"
say ""
profile=(--device cuda --batch-size 64 --max-steps 200 --lr-schedule constant --log-every 0 --profile-steps 150:200)
if run profile_elrun 200 "$bin/elrun" --standalone --nproc-per-node 1 "$bin/elrun-train" "${data[@]}" --allow-tf32 \
     --linear aten "${profile[@]}" --profile-trace "$work/elrun_trace.json" &&
   run profile_twin 300 "$python" tests/support/torchrun_compat.py --standalone --nproc_per_node 1 \
     bench/fashion_twin.py "${data[@]}" "${profile[@]}" --profile-trace "$work/twin_trace.json" &&
   run trace_summary 120 "$python" tests/support/trace_summary.py "$work/elrun_trace.json.0" "$work/twin_trace.json.0" \
     --labels elrun-train twin --top 15; then
  sed 's/^/    /' "$out/trace_summary.log" >>"$report"
  tar -czf "$out/traces.tar.gz" -C "$work" elrun_trace.json.0 twin_trace.json.0 2>/dev/null
fi
fi
say ""
say "Logs: $(ls "$out" | tr '\n' ' ')"
rm -rf "$work"
[ $failed -eq 0 ] && say "All checks passed." || say "Some checks FAILED."
exit $failed
