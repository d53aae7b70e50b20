#!/usr/bin/python3
"""Scaling efficiency of elrun-train's DDP from adjacent runs, robust to a drifting machine.

train_bench.py takes the median 1-rank and 2-rank rates over rounds minutes apart. On a machine
whose speed drifts by 10-20% from minute to minute (this virtual machine's does), their ratio
moves with the drift: its full runs there gave scaling efficiencies from 0.85 to 1.04. This
benchmark instead runs, N times over, a 1-rank job, a 2-rank job and the pair (two independent
1-rank jobs at once) back to back, and ends with one more 1-rank job. Each 2-rank job and each
pair is judged against the mean of the two 1-rank jobs around it, seconds away:

  scaling_i = rate(2 ranks)_i / (2 x mean(rate(1)_i, rate(1)_i+1))

and likewise the pair's ceiling and its synchronous ceiling (the pair's rate over its lock-step
factor, see train_bench.py [e]: what a job whose ranks wait for each other every step could
have reached). The report gives every triple and the median and quartiles over them, the share
of triples at or above the 0.95 target, and elrun's 2-rank rate as a share of the synchronous
ceiling of the same triple.

Every run: FashionNet, batch 64 per rank, --threads 1, --max-steps S (200), --lr-schedule
constant, seed 0 (train_bench.py's elrun-train command). Prints a markdown report on stdout,
progress on stderr, writes a PNG. A failed run stops the benchmark with exit status 1.

  /usr/bin/python3 scripts/bench/scaling_bench.py [--triples 8] [--max-steps 200] [--wait-idle 60]
"""
import argparse
import os
import statistics
import sys
import time

import train_bench
import bench_common
from bench_common import RunError, binary_id, clean_env, fmt, log, loadavg, wait_idle
from bench_common import machine_info as _machine_info
from train_bench import ELRUN, PAIR, TAG_VAR, TARGET_SCALING, Config

DEFAULT_PNG = os.path.join(train_bench.HERE, "scaling_bench.png")


def quartiles(xs):
    """(q1, median, q3) of xs, by the inclusive method (the median of one value is itself)."""
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


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
            wall, end, share, argv = train_bench.run_once(args, c, env, workdir, i)
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


def pooled(rows, key):
    """All triples as one: the sum of a rate over the sum of 2 x its references. Unlike the
    median of per-triple ratios, a triple's share counts by its rates, and a slow 1-rank pair
    cannot skew the figure by dividing by a small number."""
    return sum(r[key] for r in rows) / sum(r["one_before"] + r["one_after"] for r in rows)


def summary(rows):
    s = {"pooled": pooled(rows, "two"), "pooled_ceiling": pooled(rows, "pair"),
         "pooled_sync": pooled(rows, "sync")}
    for key in ("scaling", "ceiling", "sync_ceiling", "of_sync", "lockstep"):
        s[key] = quartiles([r[key] for r in rows])
    s["met"] = sum(r["scaling"] >= TARGET_SCALING for r in rows)
    s["sync_met"] = sum(r["sync_ceiling"] >= TARGET_SCALING for r in rows)
    return s


def q_cell(q, digits=3):
    return f"{q[1]:.{digits}f} ({q[0]:.{digits}f}–{q[2]:.{digits}f})"


def report(args, rows, s, commands, info, load, elapsed):
    n = len(rows)
    out = train_bench.report_header(
        "Scaling efficiency of elrun-train's DDP, from adjacent runs", args, info,
        f"{n} triples (1 rank, 2 ranks, the pair) and a closing 1-rank run", "triple", load, elapsed)

    def verdict(x):
        return f"(target ≥ {TARGET_SCALING:g}: **{'yes' if x >= TARGET_SCALING else 'NO'}**)"

    out += ["| | pooled over all triples | median (quartiles) over triples | triples ≥ 0.95 |",
            "|---|---:|---:|---:|",
            f"| elrun-train DDP, scaling efficiency rate(2) / (2 × rate(1)) | {s['pooled']:.3f} "
            f"{verdict(s['pooled'])} | {q_cell(s['scaling'])} {verdict(s['scaling'][1])} | "
            f"{s['met']} of {n} |",
            f"| ceiling: the pair (two 1-rank jobs at once, no communication) | "
            f"{s['pooled_ceiling']:.3f} | {q_cell(s['ceiling'])} | |",
            f"| synchronous ceiling: the pair in lock step | {s['pooled_sync']:.3f} | "
            f"{q_cell(s['sync_ceiling'])} | {s['sync_met']} of {n} |",
            f"| elrun-train DDP ÷ synchronous ceiling | {s['pooled'] / s['pooled_sync']:.3f} | "
            f"{q_cell(s['of_sync'])} | |",
            f"| lock-step factor of the pair | | {q_cell(s['lockstep'])} | |", ""]
    out += ["Each triple's 2-rank job and pair are judged against the mean of the 1-rank jobs run "
            "just before and just after them (samples/s from each run's end record, as in "
            "train_bench.py). Pooled: the sum of the triples' rates over the sum of 2 × their "
            "references (all triples as one long run). The synchronous ceiling is the pair's rate over its lock-step "
            "factor: sum over steps k of max(a_k, b_k) of the two jobs' `--step-times-file` "
            "step times, over the mean of their sums — the best a job whose ranks wait for each "
            "other every step could have reached in that triple.", "", "Every triple:", "",
            "| triple | 1 rank before / after | 2 ranks | off CPU, per rank | pair | lock step | "
            "synchronous | scaling | ceiling | synchronous ceiling | 2 ranks ÷ synchronous |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(rows):
        off = " / ".join(f"{100 * x:.1f}%" for x in r["off_cpu"])
        out.append(f"| {i + 1} | {fmt(r['one_before'])} / {fmt(r['one_after'])} | {fmt(r['two'])} | "
                   f"{off} | {fmt(r['pair'])} | {r['lockstep']:.3f}× | {fmt(r['sync'])} | "
                   f"{r['scaling']:.3f} | {r['ceiling']:.3f} | {r['sync_ceiling']:.3f} | "
                   f"{r['of_sync']:.3f} |")
    out += train_bench.commands_block(args, [(key, argv, key.startswith(PAIR))
                                             for key, argv in commands.items()])
    return "\n".join(out)


def plot(rows, s, path):
    plt = bench_common.pyplot()

    x = range(1, len(rows) + 1)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(x, [r["ceiling"] for r in rows], "s--", color="#999999", label="ceiling: the pair")
    ax.plot(x, [r["sync_ceiling"] for r in rows], "^-", color="#666666",
            label="synchronous ceiling: the pair in lock step")
    ax.plot(x, [r["scaling"] for r in rows], "o-", color="#2a7ab0", linewidth=2,
            label=f"elrun-train DDP (pooled {s['pooled']:.3f}, median {s['scaling'][1]:.3f})")
    ax.axhline(TARGET_SCALING, color="green", linestyle=":", label=f"target ≥ {TARGET_SCALING:g}")
    ax.set_xticks(list(x))
    ax.set_xlabel("triple (1 rank, 2 ranks, pair; against the 1-rank runs around it)")
    ax.set_ylabel("rate(2) / (2 × rate(1))")
    ax.set_title("Scaling efficiency from adjacent runs: FashionNet, batch 64/rank, 1 thread/rank",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    bench_common.save_figure(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    train_bench.add_job_options(ap, max_steps=200, unit="triple")
    ap.add_argument("--triples", type=int, default=8,
                    help="1-rank, 2-rank and pair runs, back to back, this many times (default 8)")
    bench_common.add_output_options(ap, DEFAULT_PNG,
                                    json_help="also write every triple's figures to this file")
    args = ap.parse_args()
    if args.triples < 1:
        ap.error("--triples must be >= 1")
    train_bench.check_job_options(ap, args, "scaling_bench")
    try:
        with bench_common.private_copies(args, "scaling_bench", {"elrun": "elrun", "train": "elrun-train"}) as tmp:
            return run(args, tmp)
    except RunError as ex:
        log(f"scaling_bench: FAILED: {ex}")
        return 1


def run(args, tmp):
    info = _machine_info([("elrun", args.elrun), ("elrun-train", args.train)])
    load_start = loadavg()
    rows, commands, elapsed = bench(args, tmp)
    load = f"loadavg (1/5/15 min) {load_start} at start, {loadavg()} at end"
    if (binary_id(args.elrun), binary_id(args.train)) != (binary_id(args.elrun_copy),
                                                          binary_id(args.train_copy)):
        load += " — a binary was rebuilt during the benchmark; the runs used copies taken at its start"
    s = summary(rows)
    train_bench.publish(args, report(args, rows, s, commands, info, load, elapsed),
                        lambda path: plot(rows, s, path), {"machine": dict(info), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
