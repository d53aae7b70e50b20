#!/usr/bin/python3
"""Scaling efficiency of elrun-train's DDP from adjacent runs, robust to a drifting machine."""
import sys
import time

from bench import results, runner, scaling_report
from bench.machine import binary_id, loadavg, machine_info, wait_idle
from bench.runner import RunError
from bench.train_jobs import (
    ELRUN,
    PAIR,
    TAG_VAR,
    Config,
    add_job_options,
    check_job_options,
    run_once,
)
from tests.support.procs import clean_env, log

BENCH = "scaling_bench"
SMOKE = ["--triples", "1", "--max-steps", "20"]


def triple_ratios(ones, twos, pairs):
    """Per triple i: the 2-rank job, the pair and its synchronous rate against the mean of the
    1-rank jobs i and i + 1 around them."""
    out = []
    for i, (two, pair) in enumerate(zip(twos, pairs)):
        ref = (ones[i] + ones[i + 1]) / 2
        out.append({"one_before": ones[i], "one_after": ones[i + 1], "two": two["rate"],
                    "pair": pair["rate"], "sync": pair["sync"], "lockstep": pair["lockstep"],
                    "scaling": two["rate"] / (2 * ref), "ceiling": pair["rate"] / (2 * ref),
                    "sync_ceiling": pair["sync"] / (2 * ref), "of_sync": two["rate"] / pair["sync"],
                    "off_cpu": two["off_cpu"]})
    return out


def bench(args, workdir):
    one, two, pair = Config(ELRUN, 1), Config(ELRUN, 2), Config(PAIR, 2)
    env = clean_env((TAG_VAR,))
    ones, twos, pairs, commands = [], [], [], {}

    def run(c, i):
        try:
            wall, end, share, argv = run_once(args, c, env, workdir, i)
        except RunError as ex:
            raise RunError(f"{c.key}, triple {i + 1}: {ex}") from None
        commands[c.key] = argv
        log(f"  {c.key}: {end['samples_per_s']:.1f} samples/s"
            + (f", lock step {end['lockstep']:.3f}x" if "lockstep" in end else "")
            + (f", others {100 * share:.0f}% CPU" if share is not None else ""))
        return end

    t0 = time.monotonic()
    for i in range(args.triples):
        wait_idle(args.wait_idle)
        log(f"triple {i + 1}/{args.triples}")
        ones.append(run(one, i)["samples_per_s"])
        # Alternate which of the two comes first, so neither always runs right after a 1-rank job.
        for c in ((two, pair) if i % 2 == 0 else (pair, two)):
            end = run(c, i)
            if c is two:
                twos.append({"rate": end["samples_per_s"], "off_cpu": end["off_cpu"]})
            else:
                pairs.append({"rate": end["samples_per_s"], "sync": end["sync_rate"],
                              "lockstep": end["lockstep"]})
    ones.append(run(one, args.triples)["samples_per_s"])
    return triple_ratios(ones, twos, pairs), commands, time.monotonic() - t0


def main():
    ap = runner.parser(BENCH, __doc__)
    add_job_options(ap, max_steps=200)
    ap.add_argument("--triples", type=int, default=8,
                    help="1-rank, 2-rank and pair runs, back to back, this many times (default 8)")
    args = runner.parse(ap, SMOKE)
    if args.triples < 1:
        ap.error("--triples must be >= 1")
    check_job_options(ap, args, "scaling_bench")
    return runner.on_copies(args, "scaling_bench", lambda tmp: run(args, tmp))


def run(args, tmp):
    info = machine_info([("elrun", args.elrun), ("elrun-train", args.train)])
    load_start = loadavg()
    rows, commands, elapsed = bench(args, tmp)
    load = f"loadavg (1/5/15 min) {load_start} at start, {loadavg()} at end"
    if (binary_id(args.elrun), binary_id(args.train)) != (binary_id(args.elrun_copy),
                                                          binary_id(args.train_copy)):
        load += " — a binary was rebuilt during the benchmark; the runs used copies taken at its start"
    record = dict(results.stamp(BENCH), machine=dict(info), options=runner.options_record(args),
                  load=load, elapsed_s=elapsed, rows=rows, commands=commands)
    results.publish(args, record, scaling_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
