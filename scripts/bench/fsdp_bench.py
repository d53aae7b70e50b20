#!/usr/bin/python3
"""Sharding benchmark: per-rank memory and step time of elrun-train's data-parallel strategies.

On this machine, in one invocation, for each --strategy of elrun-train (ddp, zero1, zero2, fsdp,
and no_shard: the FSDP code path without sharding), R (3) runs interleaved round-robin (the order
rotates by one strategy each round) of

  bazel-bin/launcher/elrun --standalone --nproc-per-node 2 --no-python bazel-bin/trainer/elrun-train
      --model mlp --mlp-hidden 4096,4096,4096,4096 --dataset synthetic --optimizer adam
      --threads 1 --batch-size 64 --max-steps S --report-memory --lr-schedule constant
      --log-every 1 --strategy STRATEGY

(S = 20; an MLP 784-4096-4096-4096-4096-10 of P = 53,600,266 fp32 parameters). Each rank prints a
`memory-json {...}` line after its last step: the bytes of parameters, gradients and optimizer
state it holds then, the peak of its accounting (params + grads + transient buffers, + state), its
peak RSS (VmHWM) and step_time_s (training time / steps, first step included). Both ranks' lines
are read from elrun's stdout. The table gives per strategy, medians over the runs of the maximum
over the ranks: model state (params + grads + optimizer) against the ZeRO paper's fp32 Adam
formula (16P, 8P + 8P/N, 4P + 12P/N, 16P/N; N = 2), peak (accounting), peak RSS, step time, and
ratios to ddp, with verdicts on the targets (fsdp state <= 0.55 x ddp's, fsdp step time <= 1.3 x
ddp's). With --log-every 1 (the default; --no-trace runs --log-every 0) rank 0 prints a progress
line per step and the benchmark timestamps each on arrival, which splits step_time_s into the
first step (allocation of gradients and optimizer state) and the steady-state step.

Prints a markdown report on stdout, progress on stderr, writes a PNG chart. A run that exits
non-zero, times out or lacks a rank's memory-json line stops the benchmark with exit status 1.

  /usr/bin/python3 scripts/bench/fsdp_bench.py [--max-steps 20] [--runs 3] [--wait-idle 900]
  /usr/bin/python3 scripts/bench/fsdp_bench.py --mlp-hidden 256,256 --max-steps 3 --runs 1
"""
import argparse
import json
import os
import re
import select
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import bench_common
from bench_common import (HERE, REPO, ForeignCpu, RunError, binary_id, clean_env, cpu_snapshot,
                          foreign_cpu_share, log, loadavg, mem_available_mib,
                          verdict)
from bench_common import machine_info as _machine_info

DEFAULT_ELRUN = os.path.join(REPO, "bazel-bin", "launcher", "elrun")
DEFAULT_TRAIN = os.path.join(REPO, "bazel-bin", "trainer", "elrun-train")
DEFAULT_PNG = os.path.join(HERE, "fsdp_bench.png")

# Every process a run starts carries FSDP_BENCH_TAG=<benchmark tag>:<run> in its environment, and
# so do the workers: after each run (and on timeout or Ctrl-C) whatever still carries it is killed.
TAG_VAR = "FSDP_BENCH_TAG"

STRATEGIES = ["ddp", "zero1", "zero2", "fsdp", "no_shard"]
LABELS = {
    "ddp": "ddp (bucketed DDP, trainer/ddp.cc)",
    "zero1": "zero1 (FSDP SHARD_OPTIMIZER)",
    "zero2": "zero2 (FSDP SHARD_GRAD_OP)",
    "fsdp": "fsdp (FSDP FULL_SHARD, ZeRO-3)",
    "no_shard": "no_shard (FSDP code path, no sharding)",
}
TARGET_STATE_RATIO = 0.55  # fsdp per-rank model state <= 0.55 x ddp's
TARGET_STEP_RATIO = 1.3    # fsdp step time <= 1.3 x ddp's

MIB = 1024.0 * 1024.0
MEMORY_JSON = re.compile(r"memory-json (\{.*\})")
STEP_LINE = re.compile(r"^epoch (\d+)\s+step (\d+)\s")


def mlp_parameters(hidden, inputs=28 * 28, classes=10):
    """Parameters of elrun-train's --model mlp (Linear layers with bias)."""
    widths = [inputs] + list(hidden) + [classes]
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def zero_formula_bytes(strategy, p, n):
    """The ZeRO paper's fp32 Adam model state per rank (no_shard and ddp: 16P)."""
    return {"zero1": 8 * p + 8 * p / n, "zero2": 4 * p + 12 * p / n,
            "fsdp": 16 * p / n}.get(strategy, 16 * p)


def formula_text(strategy):
    return {"zero1": "8P + 8P/N", "zero2": "4P + 12P/N", "fsdp": "16P/N"}.get(strategy, "16P")


# --- running ---------------------------------------------------------------------------------

def tagged_pids(prefix):
    return bench_common.tagged_pids(TAG_VAR, prefix)


def kill_tagged(prefix):
    return bench_common.kill_tagged(TAG_VAR, prefix)


def other_benchmarks():
    """Python processes (not this one) running a script from a scripts/bench directory: another
    benchmark, possibly sleeping in its own wait for an idle machine between runs."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if (argv and "python" in os.path.basename(argv[0])
                and any(a.endswith(".py") and "scripts/bench/" in a for a in argv[1:3])):
            found.append(f"{name} {' '.join(argv)[:120]}")
    return found


def wait_quiet(limit_s, quiet_s):
    """Waits (at most limit_s) until, for quiet_s seconds in a row, other processes used under
    10% of the CPUs in every second and no other benchmark script ran. bench_common.wait_idle's
    single idle second can fall between two runs of another benchmark."""
    if limit_s <= 0:
        return True
    t0 = time.monotonic()
    quiet_since = None
    reason = ""
    while time.monotonic() - t0 < limit_s:
        others = other_benchmarks()
        before = cpu_snapshot()
        time.sleep(1.0)  # A measurement window, not a synchronisation.
        share = foreign_cpu_share(before, cpu_snapshot())
        now = time.monotonic()
        if others:
            quiet_since, reason = None, f"another benchmark is running: {others[0]}"
        elif share is not None and share >= 0.10:
            quiet_since, reason = None, f"other processes use {100 * share:.0f}% of the CPUs"
        elif quiet_since is None:
            quiet_since = now - 1.0
        if quiet_since is not None and now - quiet_since >= quiet_s:
            if now - t0 > quiet_s + 1.5:
                log(f"  waited {now - t0:.0f} s for an idle machine")
            return True
    log(f"  machine still busy after {time.monotonic() - t0:.0f} s ({reason}); going on")
    return False


def last_lines(text, n=12):
    lines = [l.rstrip() for l in text.splitlines() if l.strip()]
    return "\n".join("    | " + l[-300:] for l in lines[-n:]) or "    (nothing)"


def command(args, strategy, train=None, elrun=None):
    return ([elrun or args.elrun, "--standalone", "--nproc-per-node", str(args.nproc),
             "--no-python", train or args.train,
             "--model", "mlp", "--mlp-hidden", ",".join(str(h) for h in args.mlp_hidden),
             "--dataset", "synthetic", "--optimizer", "adam", "--threads", "1",
             "--batch-size", str(args.batch_size), "--max-steps", str(args.max_steps),
             "--report-memory", "--lr-schedule", "constant",
             "--log-every", "1" if args.trace else "0", "--strategy", strategy])


def read_until_exit(p, deadline):
    """[(monotonic arrival time, line)] of p's stdout until EOF and exit; raises on deadline."""
    fd = p.stdout.fileno()
    os.set_blocking(fd, False)
    buf, lines = b"", []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise subprocess.TimeoutExpired(p.args, 0)
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        now = time.monotonic()
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            continue
        if not chunk:
            break
        buf += chunk
        *complete, buf = buf.split(b"\n")
        lines += [(now, l.decode(errors="replace")) for l in complete]
    if buf:
        lines.append((time.monotonic(), buf.decode(errors="replace")))
    p.wait(timeout=max(deadline - time.monotonic(), 1.0))
    return lines


def run_once(args, strategy, env, rnd):
    """One run: dict with the ranks' memory records, trace and wall time. Raises RunError."""
    argv = command(args, strategy, args.train_copy, args.elrun_copy)
    tag = f"{args.tag}:{strategy}:{rnd}"
    env = dict(env, **{TAG_VAR: tag})
    foreign = ForeignCpu()
    with tempfile.TemporaryFile() as err:
        def go():
            t0 = time.monotonic()
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=err, env=env, cwd=REPO, start_new_session=True)
            try:
                lines = read_until_exit(p, t0 + args.timeout)
            except subprocess.TimeoutExpired:
                bench_common.stop_launcher(p, TAG_VAR, tag)
                raise RunError(f"timed out after {args.timeout:g} s")
            except BaseException:  # Ctrl-C: the launcher is in its own session; stop it here.
                bench_common.stop_launcher(p, TAG_VAR, tag)
                raise
            finally:
                p.stdout.close()
            wall = time.monotonic() - t0
            left = bench_common.stop_launcher(p, TAG_VAR, tag)  # Stragglers (there should be none).
            if left:
                log(f"  warning: {left} process(es) of {strategy} outlived the launcher; killed")
            return p.returncode, t0, wall, lines

        rc, t0, wall, lines = foreign.phase(go)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    stdout = "\n".join(l for _, l in lines)
    if rc != 0:
        raise RunError(f"exit status {rc}; stdout ends:\n{last_lines(stdout)}\n"
                       f"stderr ends:\n{last_lines(stderr)}")
    ranks = {}
    for _, line in lines:
        m = MEMORY_JSON.search(line)
        if m:
            rec = json.loads(m.group(1))
            ranks[rec["rank"]] = rec
    if sorted(ranks) != list(range(args.nproc)) or any(r["strategy"] != strategy
                                                       for r in ranks.values()):
        raise RunError(f"expected one memory-json line of strategy {strategy} from each of ranks "
                       f"0..{args.nproc - 1}; got {sorted(ranks)}\nstdout ends:\n"
                       f"{last_lines(stdout)}")
    run = {"round": rnd + 1, "wall_s": wall, "ranks": [ranks[r] for r in sorted(ranks)],
           "foreign": foreign.share}
    if args.trace:
        arrivals = {}
        for when, line in lines:
            m = STEP_LINE.match(line)
            if m:
                arrivals[int(m.group(2))] = when - t0
        if sorted(arrivals) != list(range(1, args.max_steps + 1)):
            raise RunError(f"expected rank 0's progress lines of steps 1..{args.max_steps}; got "
                           f"steps {sorted(arrivals)}")
        gaps = [arrivals[k] - arrivals[k - 1] for k in range(2, args.max_steps + 1)]
        # Training time (rank 0's step_time_s x steps) ends at the last step's line: what comes
        # before step 1's line of it is the first step.
        train_s = ranks[0]["step_time_s"] * args.max_steps
        run["trace"] = {"arrivals": arrivals, "gaps": gaps,
                        "first_step_s": train_s - (arrivals[args.max_steps] - arrivals[1]),
                        "steady_step_s": statistics.median(gaps) if gaps else None}
    return run


def bench(args):
    runs = {s: [] for s in args.strategies}
    busy_rounds = []
    env = clean_env((TAG_VAR,))
    t0 = time.monotonic()
    for rnd in range(args.runs):
        if not wait_quiet(args.wait_idle, args.quiet):
            busy_rounds.append(rnd + 1)
        shift = rnd % len(args.strategies)
        order = args.strategies[shift:] + args.strategies[:shift]
        log(f"round {rnd + 1}/{args.runs}: " + ", ".join(order))
        for s in order:
            try:
                run = run_once(args, s, env, rnd)
            except RunError as ex:
                raise RunError(f"strategy {s}, round {rnd + 1}: {ex}\n  command: "
                               f"{shlex.join(command(args, s))}") from None
            runs[s].append(run)
            r = run["ranks"]
            trace = run.get("trace")
            log(f"  {s}: state {max(x['state_bytes'] for x in r) / MIB:.1f} MiB/rank, peak RSS "
                f"{max(x['peak_rss_bytes'] for x in r) / MIB:.0f} MiB, step "
                f"{max(x['step_time_s'] for x in r):.3f} s"
                + (f" (first {trace['first_step_s']:.3f}, steady {trace['steady_step_s']:.3f})"
                   if trace and trace["steady_step_s"] is not None else "")
                + f", wall {run['wall_s']:.1f} s"
                + (f", others {100 * run['foreign']:.0f}% CPU" if run["foreign"] is not None
                   else ""))
    return runs, busy_rounds, time.monotonic() - t0


# --- report ----------------------------------------------------------------------------------

def per_run(runs, field):
    """Per run, the maximum over the ranks of a memory-json field."""
    return [max(r[field] for r in run["ranks"]) for run in runs]


def summarize(args, runs):
    """{strategy: {metric: median over runs}} plus ratios to ddp."""
    p, n = args.params, args.nproc
    out = {}
    for s, rs in runs.items():
        if not rs:
            continue
        med = lambda xs: statistics.median(xs)  # noqa: E731
        row = {"state": med(per_run(rs, "state_bytes")),
               "params": med(per_run(rs, "params_bytes")), "grads": med(per_run(rs, "grads_bytes")),
               "optimizer": med(per_run(rs, "optimizer_bytes")),
               "peak": med(per_run(rs, "peak_bytes")), "rss": med(per_run(rs, "peak_rss_bytes")),
               "step": med(per_run(rs, "step_time_s")),
               "step_min": min(per_run(rs, "step_time_s")),
               "step_max": max(per_run(rs, "step_time_s")),
               "formula": zero_formula_bytes(s, p, n), "wall": med([r["wall_s"] for r in rs])}
        traces = [r["trace"] for r in rs if r.get("trace") and r["trace"]["steady_step_s"]]
        if traces:
            row["first"] = med([t["first_step_s"] for t in traces])
            row["steady"] = med([t["steady_step_s"] for t in traces])
            # Stability: the spread of the steady-state steps within each run, worst run.
            row["spread"] = max((max(t["gaps"]) - min(t["gaps"])) / t["steady_step_s"]
                                for t in traces)
        out[s] = row
    base = out.get("ddp")
    for row in out.values():
        row["state_x"] = row["state"] / base["state"] if base else None
        row["step_x"] = row["step"] / base["step"] if base else None
        if base and "steady" in row and "steady" in base:
            row["steady_x"] = row["steady"] / base["steady"]
    return out


def mib(x):
    return f"{x / MIB:.1f}"


def table(args, summary):
    lines = ["| Strategy | State/rank MiB (params + grads + optimizer) | ZeRO formula MiB | "
             "÷ formula | ÷ ddp | Peak (accounting) MiB | Peak RSS MiB | Step time s, median "
             "(min–max) | ÷ ddp |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in args.strategies:
        r = summary.get(s)
        if r is None:
            continue
        state_x = f"{r['state_x']:.3f}" if r["state_x"] is not None else "—"
        step_x = f"{r['step_x']:.2f}" if r["step_x"] is not None else "—"
        lines.append(
            f"| {LABELS[s]} | {mib(r['state'])} ({mib(r['params'])} + {mib(r['grads'])} + "
            f"{mib(r['optimizer'])}) | {mib(r['formula'])} ({formula_text(s)}) | "
            f"{r['state'] / r['formula']:.3f} | {state_x} | {mib(r['peak'])} | {mib(r['rss'])} | "
            f"{r['step']:.3f} ({r['step_min']:.3f}–{r['step_max']:.3f}) | {step_x} |")
    return lines


def trace_table(args, summary):
    lines = ["| Strategy | step_time_s (as reported) | first step s | steady step s (median of "
             "steps 2..S) | steady ÷ ddp | steady-step spread (max−min) ÷ median, worst run |",
             "|---|---:|---:|---:|---:|---:|"]
    for s in args.strategies:
        r = summary.get(s)
        if r is None or "steady" not in r:
            continue
        x = f"{r['steady_x']:.2f}" if r.get("steady_x") is not None else "—"
        lines.append(f"| {s} | {r['step']:.3f} | {r['first']:.3f} | {r['steady']:.3f} | {x} | "
                     f"{100 * r['spread']:.0f}% |")
    return lines


def verdicts(summary):
    f, d = summary.get("fsdp"), summary.get("ddp")
    if not f or not d:
        return ["(no verdicts: the fsdp and ddp rows are both needed)"]
    out = [f"- fsdp per-rank model state {mib(f['state'])} MiB = {f['state_x']:.3f} × ddp's "
           f"{mib(d['state'])} MiB (target ≤ {TARGET_STATE_RATIO:g}×): "
           f"**{verdict(f['state_x'], TARGET_STATE_RATIO)}**",
           f"- fsdp step time {f['step']:.3f} s = {f['step_x']:.2f} × ddp's {d['step']:.3f} s "
           f"(target ≤ {TARGET_STEP_RATIO:g}×): **{verdict(f['step_x'], TARGET_STEP_RATIO)}**"]
    if "steady_x" in f:
        out.append(f"- (steady-state steps only: fsdp {f['steady']:.3f} s = {f['steady_x']:.2f} × "
                   f"ddp's {d['steady']:.3f} s: "
                   f"{verdict(f['steady_x'], TARGET_STEP_RATIO)})")
    return out


def runs_table(args, runs):
    lines = ["| Strategy | Round | Rank | state MiB | peak MiB | peak RSS MiB | step_time_s | "
             "wall s | others' CPU |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in args.strategies:
        for run in runs.get(s, []):
            share = f"{100 * run['foreign']:.0f}%" if run["foreign"] is not None else "?"
            for r in run["ranks"]:
                lines.append(f"| {s} | {run['round']} | {r['rank']} | {mib(r['state_bytes'])} | "
                             f"{mib(r['peak_bytes'])} | {mib(r['peak_rss_bytes'])} | "
                             f"{r['step_time_s']:.3f} | {run['wall_s']:.1f} | {share} |")
    return lines


def notes(args, summary):
    out = []
    d = summary.get("ddp")
    if d:
        extra = d["peak"] - d["state"]
        out.append(
            f"- ddp's state is the 16P of the formula; its gradient buckets (`--bucket-cap-mb` 25, "
            f"a flat copy of every gradient: 4P = {mib(4 * args.params)} MiB) are outside it. They "
            f"are in ddp's peak (accounting): {mib(d['peak'])} MiB = state + {mib(extra)} MiB, and "
            f"in its RSS. The FSDP strategies reduce in their flat gradient buffers (no copy); "
            f"their peak adds the transient unsharded units (a gathered layer, its prefetched "
            f"neighbour, a full gradient buffer in flight).")
    out.append("- Peak RSS (VmHWM) is the allocator's high-water mark, not the model state: it "
               "also holds LibTorch itself (~150 MiB), the data sets, and every transient buffer "
               "ever resident: the model built in full on every rank and BroadcastFromRank0's "
               "flat copy of it at start, gathered units, unsharded gradient buffers, the "
               "reduce-scatter's receive buffer (all-to-all of a whole unit) and autograd's "
               "weight-gradient temporaries (67 MiB per 4096×4096 layer). elrun-train keeps "
               "allocations under 256 MiB in glibc's heap and never trims it (`mallopt` in "
               "`train_main.cc`), so freed memory stays resident; compare the strategies' peak "
               "(accounting) for what they hold by design.")
    out.append(f"- step_time_s is elrun-train's own: training time / steps, measured from just "
               f"before the first step to after the last, so it includes the first step's "
               f"allocation of gradients and Adam state (first-touch page faults); with "
               f"{args.max_steps} steps that is 1/{args.max_steps} of it."
               + (" The second table splits it using the arrival time of rank 0's progress "
                  "line of each step." if args.trace else ""))
    return out


def report(args, runs, summary, info, load, elapsed):
    out = ["## Sharding benchmark: elrun-train ddp / zero1 / zero2 / fsdp / no_shard", ""]
    out += [f"- **{k}**: {v}" for k, v in info]
    out += [f"- **workload**: MLP 784-{'-'.join(map(str, args.mlp_hidden))}-10, "
            f"P = {args.params:,} fp32 parameters ({mib(4 * args.params)} MiB), Adam, "
            f"{args.nproc} ranks × batch {args.batch_size} × 1 thread, --max-steps "
            f"{args.max_steps}; {args.runs} runs per strategy, interleaved round-robin"
            + (f", waited up to {args.wait_idle:g} s before each round for {args.quiet:g} idle "
               f"seconds in a row (other processes < 10% CPU, no other benchmark script)"
               if args.wait_idle > 0 else "") + f"; benchmark took {elapsed:.0f} s",
            f"- **load**: {load}", ""]
    out += table(args, summary)
    out += ["", "Medians over the runs of the largest value over the ranks (the ranks hold the "
            "same amounts, up to the shard padding). State = params + grads + optimizer bytes "
            "held after the last step; peak (accounting) = the highest params + grads + "
            "transient buffers seen, plus the optimizer state; N = "
            f"{args.nproc}, P = {args.params:,}.", ""]
    out += verdicts(summary)
    if args.trace:
        out += ["", "Step time, split (rank 0):", ""]
        out += trace_table(args, summary)
    out += ["", "Notes:", ""]
    out += notes(args, summary)
    out += ["", "Every run:", ""]
    out += runs_table(args, runs)
    out += ["", "Commands (run from the repository root):", "", "```"]
    for s in args.strategies:
        out.append(shlex.join(command(args, s)).replace(REPO + "/", ""))
    out += ["```", ""]
    return "\n".join(out)


def plot(args, summary, path):
    plt = bench_common.pyplot()

    names = [s for s in args.strategies if s in summary]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.8))
    x = range(len(names))
    bottom = [0.0] * len(names)
    for part, color in (("params", "#2a7ab0"), ("grads", "#7fb3d5"), ("optimizer", "#e8a33d")):
        vals = [summary[s][part] / MIB for s in names]
        ax1.bar(x, vals, 0.6, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.scatter(x, [summary[s]["formula"] / MIB for s in names], marker="_", s=900, color="black",
                zorder=3, label="ZeRO formula")
    for i, s in enumerate(names):
        ax1.text(i, bottom[i] * 1.02, f"{bottom[i]:.0f}", ha="center", va="bottom", fontsize=8)
    if "ddp" in summary:
        ax1.axhline(TARGET_STATE_RATIO * summary["ddp"]["state"] / MIB, color="green",
                    linestyle="--", linewidth=1,
                    label=f"fsdp target ≤ {TARGET_STATE_RATIO:g}× ddp")
    ax1.set_ylim(0, max(bottom) * 1.35)
    ax1.set_title("Model state per rank (MiB)", fontsize=10)
    ax1.legend(fontsize=8, loc="upper center", ncol=2)

    w = 0.38
    ax2.bar([i - w / 2 for i in x], [summary[s]["peak"] / MIB for s in names], w,
            color="#7fb3d5", label="peak (accounting)")
    ax2.bar([i + w / 2 for i in x], [summary[s]["rss"] / MIB for s in names], w,
            color="#c0504d", label="peak RSS (VmHWM)")
    ax2.set_title("Peak memory per rank (MiB, max over ranks)", fontsize=10)
    ax2.legend(fontsize=8)

    steps = [summary[s]["step"] for s in names]
    err = [[summary[s]["step"] - summary[s]["step_min"] for s in names],
           [summary[s]["step_max"] - summary[s]["step"] for s in names]]
    ax3.bar(x, steps, 0.6, color="#2a7ab0", yerr=err, capsize=4, label="step_time_s")
    if all("steady" in summary[s] for s in names):
        ax3.scatter(x, [summary[s]["steady"] for s in names], marker="_", s=900, color="black",
                    zorder=3, label="steady-state step")
    for i, s in enumerate(names):
        ax3.text(i + 0.32, summary[s]["step"], f"{summary[s]['step']:.2f}", ha="left",
                 va="center", fontsize=8)
    if "ddp" in summary:
        ax3.axhline(TARGET_STEP_RATIO * summary["ddp"]["step"], color="green", linestyle="--",
                    linewidth=1, label=f"fsdp target ≤ {TARGET_STEP_RATIO:g}× ddp")
    top = max([summary[s]["step_max"] for s in names]
              + ([TARGET_STEP_RATIO * summary["ddp"]["step"]] if "ddp" in summary else []))
    ax3.set_ylim(0, top * 1.4)
    ax3.set_title("Step time (s; median, whiskers min/max)", fontsize=10)
    ax3.legend(fontsize=8, loc="upper left")
    for ax in (ax1, ax2, ax3):
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, fontsize=9)
    fig.suptitle(f"elrun-train strategies: MLP of {args.params / 1e6:.1f}M params, Adam, "
                 f"{args.nproc} ranks × batch {args.batch_size} × 1 thread", fontsize=11)
    bench_common.save_figure(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elrun", default=DEFAULT_ELRUN, help="elrun binary (default: %(default)s)")
    ap.add_argument("--train", default=DEFAULT_TRAIN,
                    help="elrun-train binary (default: %(default)s)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help="comma-separated --strategy values (default: %(default)s)")
    ap.add_argument("--mlp-hidden", default="4096,4096,4096,4096",
                    help="hidden widths of the MLP (default: %(default)s)")
    ap.add_argument("--max-steps", type=int, default=20, help="steps per run (default 20)")
    ap.add_argument("--batch-size", type=int, default=64, help="samples per rank per step (64)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--runs", type=int, default=3, help="runs per strategy (default 3)")
    ap.add_argument("--no-trace", dest="trace", action="store_false",
                    help="run with --log-every 0 (no per-step progress lines, no split of the "
                         "step time into first and steady-state steps)")
    ap.add_argument("--timeout", type=float, default=600,
                    help="seconds before one run is killed, which fails the benchmark (600)")
    bench_common.add_output_options(ap, DEFAULT_PNG, png_help="chart to write",
                                    json_help="also write every run's records to this file")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="before each round, wait up to SECONDS until, for --quiet seconds in a "
                         "row, other processes used < 10%% of the CPUs and no other "
                         "scripts/bench/*.py ran (default 0: do not wait)")
    ap.add_argument("--quiet", type=float, default=15, metavar="SECONDS",
                    help="idle seconds in a row that --wait-idle needs (default 15)")
    args = ap.parse_args()
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
    for name, path in (("elrun", args.elrun), ("elrun-train", args.train)):
        if not os.access(path, os.X_OK):
            ap.error(f"{name} binary {path} not found: bazel build //launcher:elrun "
                     f"//trainer:elrun-train")
    args.elrun, args.train = os.path.abspath(args.elrun), os.path.abspath(args.train)
    args.params = mlp_parameters(args.mlp_hidden)
    args.tag = f"fsdp_bench.{os.getpid()}.{time.time_ns()}"

    # Rough need: ddp holds 20P bytes per rank (+ LibTorch, data, activations).
    need = args.nproc * (20 * args.params / MIB + 300)
    avail = mem_available_mib()
    if avail is not None and need > avail:
        log(f"warning: the runs may need ~{need:.0f} MiB; MemAvailable is {avail:.0f} MiB")

    try:
        with bench_common.private_copies(args, "fsdp_bench", {"elrun": "elrun", "train": "elrun-train"}):
            return run(args)
    except RunError as ex:
        log(f"fsdp_bench: FAILED: {ex}")
        return 1


def run(args):
    load_start = loadavg()
    ids = (binary_id(args.elrun_copy), binary_id(args.train_copy))
    info = _machine_info([("elrun", args.elrun), ("elrun-train", args.train)])
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
    summary = summarize(args, runs)
    print(report(args, runs, summary, info, load, elapsed), flush=True)
    if args.png:
        plot(args, summary, args.png)
        log(f"wrote {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": dict(info), "params": args.params, "summary": summary,
                       "runs": runs, "commands": {s: command(args, s) for s in args.strategies}},
                      f, indent=1)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
