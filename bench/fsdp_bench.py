#!/usr/bin/python3
"""Sharding benchmark: per-rank memory and step time of elrun-train's data-parallel strategies."""
import os
import sys
import time

from bench import fsdp_report, results, runner
from bench.fsdp_model import DEFAULT_HIDDEN, MIB, STRATEGIES, mlp_parameters
from bench.fsdp_oom import OOM_STRATEGIES, oom_demo
from bench.fsdp_runs import bench, command
from bench.machine import binary_id, loadavg, machine_info, mem_available_mib, runs_share
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

    return runner.on_copies(args, "fsdp_bench", lambda tmp: run(args))


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
    share, load = runs_share(shares, walls)
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
