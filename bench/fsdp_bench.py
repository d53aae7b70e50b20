#!/usr/bin/python3
"""Sharding benchmark: per-rank memory and step time of elrun-train's data-parallel strategies.

On this machine, in one invocation, for each --strategy of elrun-train (ddp, zero1, zero2, fsdp,
and no_shard: the FSDP code path without sharding), R (3) runs interleaved round-robin (the order
rotates by one strategy each round) of

  bazel-bin/launcher/elrun --standalone --nproc-per-node 2 --no-python bazel-bin/trainer/app/elrun-train
      --model mlp --mlp-hidden 2048,2048,...,2048 (32 entries) --dataset synthetic --optimizer adam
      --threads 1 --batch-size 64 --max-steps S --report-memory --lr-schedule constant
      --log-every 1 --strategy STRATEGY

(S = 10; an MLP 784-2048×32-10 of P = 131,715,082 fp32 parameters, 502 MiB; ddp's fp32 Adam state
16P is 2010 MiB per rank). A deep model, the case sharding is meant to help: each FSDP unit (one
2048×2048 layer, 16 MiB) is small against the sharded state (16P/N = 1005 MiB per rank for N = 2),
so the few unsharded units in flight add little to it. (The earlier default, 784-4096×4-10 of
P = 53,600,266, had four units of 64 MiB each.)

Each rank prints a `memory-json {...}` line after its last step: the bytes of parameters,
gradients and optimizer state it holds then, the peak of its accounting (params + grads +
transient buffers, + state), its peak RSS (VmHWM), its baseline RSS (the resident set just before
the model is built: LibTorch, the data set, the process group) and step_time_s (training time /
steps, first step included). Both ranks' lines are read from elrun's stdout. The table gives per
strategy, medians over the runs of the maximum over the ranks: model state (params + grads +
optimizer) against the ZeRO paper's fp32 Adam formula (16P, 8P + 8P/N, 4P + 12P/N, 16P/N), peak
(accounting), baseline RSS, peak RSS, peak RSS ÷ ddp's and ÷ (peak (accounting) + baseline), step
time, and ratios to ddp, with verdicts on the targets: fsdp state <= 0.55 x ddp's, fsdp step time
<= 1.3 x ddp's, fsdp peak RSS <= 0.6 x ddp's, zero2 peak RSS <= 0.8 x ddp's, fsdp peak RSS <=
1.3 x (its peak (accounting) + its baseline RSS). With --log-every 1 (the default; --no-trace runs
--log-every 0) rank 0 prints a progress line per step and the benchmark timestamps each on
arrival, which splits step_time_s into the first step (allocation of gradients and optimizer
state) and the steady-state step.

--oom-demo (after the benchmark) or --oom-only (instead of it) runs ddp once and fsdp once, the
same command, with the whole job (elrun and its workers) in a memory cgroup of --memory-limit-mib
(v1 memory.limit_in_bytes and memory.memsw.limit_in_bytes, or v2 memory.max with memory.swap.max
0; default after the benchmark: halfway between N x fsdp's and N x ddp's median peak RSS, rounded
down to 64 MiB), and reports whether ddp fails for lack of memory (the kernel's OOM killer) where
fsdp trains to --max-steps. Those runs may fail; that does not fail the benchmark.

A run that exits non-zero, times out or lacks a rank's memory-json line stops the benchmark with
exit status 1. Report: fsdp_report.py; the runs: fsdp_runs.py; the demonstration: fsdp_oom.py and
fsdp_cgroup.py; the workload and targets: fsdp_model.py.

  /usr/bin/python3 -m bench.fsdp_bench [--max-steps 10] [--runs 3] [--wait-idle 900]
  /usr/bin/python3 -m bench.fsdp_bench --runs 1 --strategies ddp,fsdp --oom-demo
  /usr/bin/python3 -m bench.fsdp_bench --oom-only --memory-limit-mib 4096
"""
import os
import sys
import time

from bench import fsdp_report, results, runner
from bench.fsdp_model import DEFAULT_HIDDEN, MIB, STRATEGIES, mlp_parameters
from bench.fsdp_oom import OOM_STRATEGIES, oom_demo
from bench.fsdp_runs import bench, command
from bench.machine import binary_id, loadavg, machine_info, mem_available_mib
from bench.runner import RunError
from tests.support import paths
from tests.support.procs import log

BENCH = "fsdp_bench"
SMOKE = ["--mlp-hidden", "256,256", "--max-steps", "3", "--runs", "1", "--quiet", "0"]


def main():
    ap = runner.parser(BENCH, __doc__)
    ap.add_argument("--elrun", default=paths.binary("elrun"), help="elrun binary (default: %(default)s)")
    ap.add_argument("--train", default=paths.binary("elrun-train"),
                    help="elrun-train binary (default: %(default)s)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help="comma-separated --strategy values (default: %(default)s)")
    ap.add_argument("--mlp-hidden", default=",".join(map(str, DEFAULT_HIDDEN)),
                    help="comma-separated hidden widths of the MLP (default: 32 layers of 2048, "
                         "P = 131,715,082)")
    ap.add_argument("--max-steps", type=int, default=10, help="steps per run (default 10)")
    ap.add_argument("--batch-size", type=int, default=64, help="samples per rank per step (64)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--runs", type=int, default=3, help="runs per strategy (default 3)")
    ap.add_argument("--no-trace", dest="trace", action="store_false",
                    help="run with --log-every 0 (no per-step progress lines, no split of the "
                         "step time into first and steady-state steps)")
    ap.add_argument("--timeout", type=float, default=600,
                    help="seconds before one run is killed, which fails the benchmark (600); "
                         "a demonstration run that times out is reported instead")
    ap.add_argument("--quiet", type=float, default=15, metavar="SECONDS",
                    help="idle seconds in a row that --wait-idle needs, with no other bench/*.py "
                         "running (default 15)")
    ap.add_argument("--oom-demo", action="store_true",
                    help="after the benchmark, run ddp once and fsdp once with the whole job in a "
                         "memory cgroup of --memory-limit-mib, to show ddp OOM-killed where fsdp "
                         "trains")
    ap.add_argument("--oom-only", action="store_true",
                    help="only the out-of-memory demonstration (needs --memory-limit-mib)")
    ap.add_argument("--memory-limit-mib", type=int, metavar="MIB",
                    help="the demonstration's cgroup limit for the whole job (default: halfway "
                         "between nproc x fsdp's and nproc x ddp's median peak RSS in the "
                         "benchmark, rounded down to 64 MiB)")
    args = runner.parse(ap, SMOKE)
    try:
        args.mlp_hidden = [int(h) for h in args.mlp_hidden.split(",")]
    except ValueError:
        ap.error(f"--mlp-hidden {args.mlp_hidden!r}: expected comma-separated integers")
    args.strategies = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in args.strategies if s not in STRATEGIES]
    if unknown or not args.strategies:
        ap.error(f"--strategies: unknown {unknown}; expected some of {STRATEGIES}")
    if args.runs < 1 or args.max_steps < 1 or args.batch_size < 1 or args.nproc < 1:
        ap.error("--runs, --max-steps, --batch-size and --nproc must be >= 1")
    args.oom_demo = args.oom_demo or args.oom_only
    if args.memory_limit_mib is not None and args.memory_limit_mib < 1:
        ap.error("--memory-limit-mib must be >= 1")
    if args.oom_only and args.memory_limit_mib is None:
        ap.error("--oom-only: pass --memory-limit-mib (the benchmark that would give the default "
                 "limit does not run): e.g. halfway between nproc x fsdp's and nproc x ddp's peak "
                 "RSS")
    if (args.oom_demo and args.memory_limit_mib is None
            and not all(s in args.strategies for s in OOM_STRATEGIES)):
        ap.error("--oom-demo without --memory-limit-mib takes its limit from the benchmark's ddp "
                 "and fsdp peak RSS: include both in --strategies, or pass --memory-limit-mib")
    for name, path in (("elrun", args.elrun), ("elrun-train", args.train)):
        if not os.access(path, os.X_OK):
            ap.error(f"{name} binary {path} not found: bazel build {paths.label('elrun')} "
                     f"{paths.label('elrun-train')}")
    args.elrun, args.train = os.path.abspath(args.elrun), os.path.abspath(args.train)
    args.params = mlp_parameters(args.mlp_hidden)
    args.tag = f"fsdp_bench.{os.getpid()}.{time.time_ns()}"

    # Rough need: ddp holds 20P bytes per rank (+ LibTorch, data, activations).
    need = args.nproc * (20 * args.params / MIB + 300)
    avail = mem_available_mib()
    if avail is not None and need > avail:
        log(f"warning: the runs may need ~{need:.0f} MiB; MemAvailable is {avail:.0f} MiB")

    try:
        with runner.private_copies(args, "fsdp_bench", {"elrun": "elrun", "train": "elrun-train"}):
            return run(args)
    except RunError as ex:
        log(f"fsdp_bench: FAILED: {ex}")
        return 1


def run(args):
    """The benchmark (unless --oom-only), then the demonstration (--oom-demo, --oom-only); each
    part's report printed as it ends, the result written and the chart drawn at the end."""
    record = dict(results.stamp(BENCH), options=runner.options_record(args))
    summary = None
    if not args.oom_only:
        summary = run_bench(args, record)
        print(fsdp_report.bench_markdown(record), flush=True)
    if args.oom_demo:
        record["oom_demo"] = run_oom_demo(args, summary)
        print(fsdp_report.oom_markdown(record), flush=True)
    if args.json:
        results.write(args.json, record)
    if args.png and not args.oom_only:
        fsdp_report.plot_result(record, args.png)
        log(f"wrote {args.png}")
    return 0


def run_oom_demo(args, summary):
    if args.memory_limit_mib is not None:
        limit = args.memory_limit_mib * 1024 * 1024
        source = "--memory-limit-mib"
    else:
        lo, hi = (args.nproc * summary[s]["rss"] for s in ("fsdp", "ddp"))
        limit = max(int((lo + hi) / 2) // (64 << 20), 1) * (64 << 20)
        source = (f"halfway between {args.nproc} × fsdp's median peak RSS ({lo / MIB:.0f} MiB) "
                  f"and {args.nproc} × ddp's ({hi / MIB:.0f} MiB) in the benchmark above, rounded "
                  f"down to 64 MiB")
        if hi <= lo:
            log("warning: fsdp's peak RSS is not below ddp's; the demonstration cannot show "
                "ddp failing where fsdp trains")
    return {"limit_bytes": limit, "limit_source": source, "results": oom_demo(args, limit),
            "commands": {s: command(args, s, trace=True) for s in OOM_STRATEGIES}}


def run_bench(args, record):
    """Runs the benchmark; adds its runs, summary and load to record; returns the summary."""
    load_start = loadavg()
    ids = (binary_id(args.elrun_copy), binary_id(args.train_copy))
    info = machine_info([("elrun", args.elrun), ("elrun-train", args.train)])
    runs, busy_rounds, elapsed = bench(args)
    for s, rs in runs.items():  # The reported parameters are P x 4 bytes under ddp/no_shard.
        if s in ("ddp", "no_shard"):
            reported = {r["params_bytes"] for run in rs for r in run["ranks"]}
            if reported != {4 * args.params}:
                raise RunError(f"{s} reported params_bytes {sorted(reported)}; expected "
                               f"4 x P = {4 * args.params} for P = {args.params:,}")
    walls = sum(run["wall_s"] for rs in runs.values() for run in rs)
    shares = [(run["foreign"], run["wall_s"]) for rs in runs.values() for run in rs
              if run["foreign"] is not None]
    share = sum(a * w for a, w in shares) / walls if shares else None
    load = ("CPU use of other processes unknown" if share is None else
            f"other processes used {100 * share:.0f}% of the CPUs during the runs (wall-weighted; "
            f"per run {min(100 * a for a, _ in shares):.0f}–"
            f"{max(100 * a for a, _ in shares):.0f}%; machine CPU time minus this benchmark's and "
            f"its children's)")
    load += f"; loadavg (1/5/15 min) {load_start} at start, {loadavg()} at end"
    if busy_rounds:
        load += (f" — rounds {busy_rounds} started on a machine that was not idle after "
                 f"--wait-idle {args.wait_idle:g} s")
    if share is not None and share > 0.10:
        load += " — **the machine was busy; the step times are noisy**"
        log("warning: other processes used more than 10% of the CPUs; the step times are noisy")
    if (binary_id(args.elrun), binary_id(args.train)) != ids:
        load += (" — the elrun or elrun-train binary was rebuilt during the benchmark; the runs "
                 "used copies taken at its start (the builds described above)")
    summary = fsdp_report.summarize(args, runs)
    record.update(machine=dict(info), params=args.params, summary=summary, runs=runs,
                  commands={s: command(args, s) for s in args.strategies}, load=load,
                  elapsed_s=elapsed)
    return summary


if __name__ == "__main__":
    sys.exit(main())
