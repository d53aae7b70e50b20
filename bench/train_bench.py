#!/usr/bin/python3
"""Training benchmark: elrun-train (LibTorch, C++ DDP) against its Python PyTorch DDP twin."""
import shlex
import sys
import time

from bench import results, runner, train_report
from bench.machine import binary_id, loadavg, machine_info, runs_share, wait_idle
from bench.runner import RunError
from bench.train_jobs import (
    ELRUN,
    GLOO,
    LABELS,
    NCHW,
    PAIR,
    PY,
    SYNC,
    TAG_VAR,
    Config,
    add_job_options,
    check_job_options,
    command,
    run_once,
    shown,
)
from tests.support.procs import clean_env, log

BENCH = "train_bench"
SMOKE = ["--max-steps", "20", "--runs", "1"]


def bench(args, workdir):
    """Every configuration, --runs rounds round-robin; (configs, commands by key, seconds)."""
    configs = [Config(ELRUN, 1), Config(PY, 1), Config(ELRUN, 2), Config(PY, 2), Config(SYNC, 2),
               Config(PAIR, 2), Config(NCHW, 1), Config(NCHW, 2), Config(GLOO, 2)]
    env = clean_env((TAG_VAR,))
    commands = {}
    t0 = time.monotonic()
    for rnd in range(args.runs):
        wait_idle(args.wait_idle)
        shift = rnd % len(configs)
        order = configs[shift:] + configs[:shift]
        log(f"round {rnd + 1}/{args.runs}: " + ", ".join(c.key for c in order))
        for c in order:
            try:
                wall, end, share, argv = run_once(args, c, env, workdir, rnd)
            except RunError as ex:
                raise RunError(f"{LABELS[c.kind]}, {c.nproc} rank(s), round {rnd + 1}: {ex}\n"
                               f"  command: {shlex.join(shown(args, command(args, c, 'METRICS')))}"
                               ) from None
            commands[c.key] = argv
            c.runs.append({"round": rnd + 1, "wall_s": wall, "end": end, "foreign": share})
            log(f"  {c.key}: {end['samples_per_s']:.1f} samples/s, train {end['seconds']:.1f} s, "
                f"wall {wall:.1f} s, test acc {end['test_accuracy']:.4f}"
                + (f", others {100 * share:.0f}% CPU" if share is not None else ""))
    return configs, commands, time.monotonic() - t0


def main():
    ap = runner.parser(BENCH, __doc__)
    add_job_options(ap, max_steps=300)
    ap.add_argument("--runs", type=int, default=3, help="runs per configuration (default 3)")
    args = runner.parse(ap, SMOKE)
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    check_job_options(ap, args, "train_bench")
    return runner.on_copies(args, "train_bench", lambda tmp: run(args, tmp))


def run(args, tmp):
    load_start = loadavg()
    ids = (binary_id(args.elrun_copy), binary_id(args.train_copy))
    info = machine_info([("elrun", args.elrun), ("elrun-train", args.train)])
    configs, commands, elapsed = bench(args, tmp)
    walls = sum(r["wall_s"] for c in configs for r in c.runs)
    shares = [(r["foreign"], r["wall_s"]) for c in configs for r in c.runs if r["foreign"] is not None]
    share, load = runs_share(shares, walls)
    load += f"; loadavg (1/5/15 min) {load_start} at start, {loadavg()} at end"
    if share is not None and share > 0.10:
        load += " — **the machine was busy; the rates are noisy**"
        log("warning: other processes used more than 10% of the CPUs; the rates are noisy")
    if (binary_id(args.elrun), binary_id(args.train)) != ids:
        load += (" — the elrun or elrun-train binary was rebuilt during the benchmark; the runs "
                 "used copies taken at its start (the builds described above)")
        log("warning: the elrun or elrun-train binary was rebuilt during the benchmark; the runs "
            "used copies taken at its start")
    record = dict(results.stamp(BENCH), machine=dict(info), options=runner.options_record(args),
                  load=load, elapsed_s=elapsed, summary=train_report.summary(configs),
                  configs=[{"kind": c.kind, "nproc": c.nproc, "runs": c.runs,
                            "command": commands.get(c.key)} for c in configs])
    results.publish(args, record, train_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
