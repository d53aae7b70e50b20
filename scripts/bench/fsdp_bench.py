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

Prints a markdown report on stdout, progress on stderr, writes a PNG chart. A benchmark run that
exits non-zero, times out or lacks a rank's memory-json line stops the benchmark with exit status 1.

  /usr/bin/python3 scripts/bench/fsdp_bench.py [--max-steps 10] [--runs 3] [--wait-idle 900]
  /usr/bin/python3 scripts/bench/fsdp_bench.py --mlp-hidden 256,256 --max-steps 3 --runs 1
  /usr/bin/python3 scripts/bench/fsdp_bench.py --runs 1 --strategies ddp,fsdp --oom-demo
  /usr/bin/python3 scripts/bench/fsdp_bench.py --oom-only --memory-limit-mib 4096
"""
import argparse
import json
import os
import re
import select
import shlex
import signal
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
DEFAULT_TRAIN = os.path.join(REPO, "bazel-bin", "trainer", "app", "elrun-train")
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
TARGET_RSS_RATIO = 0.6     # fsdp peak RSS <= 0.6 x ddp's peak RSS
TARGET_ZERO2_RSS_RATIO = 0.8  # zero2 peak RSS <= 0.8 x ddp's peak RSS
TARGET_RSS_OVERHEAD = 1.3  # fsdp peak RSS <= 1.3 x (fsdp's peak (accounting) + its baseline RSS)
DEFAULT_HIDDEN = [2048] * 32  # 32 layers of 16 MiB: small units against the sharded state.

MIB = 1024.0 * 1024.0
MEMORY_JSON = re.compile(r"memory-json (\{.*\})")
STEP_LINE = re.compile(r"^epoch (\d+)\s+step (\d+)\s")


def mlp_parameters(hidden, inputs=28 * 28, classes=10):
    """Parameters of elrun-train's --model mlp (Linear layers with bias)."""
    widths = [inputs] + list(hidden) + [classes]
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def mlp_text(hidden, inputs=28 * 28, classes=10):
    """784-2048×32-10: the MLP's widths, runs of equal widths as width×count."""
    parts = []
    for h in hidden:
        if parts and parts[-1][0] == h:
            parts[-1][1] += 1
        else:
            parts.append([h, 1])
    return "-".join([str(inputs)] + [f"{h}×{k}" if k > 1 else str(h) for h, k in parts]
                    + [str(classes)])


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


def command(args, strategy, train=None, elrun=None, trace=None):
    trace = args.trace if trace is None else trace
    return ([elrun or args.elrun, "--standalone", "--nproc-per-node", str(args.nproc),
             "--no-python", train or args.train,
             "--model", "mlp", "--mlp-hidden", ",".join(str(h) for h in args.mlp_hidden),
             "--dataset", "synthetic", "--optimizer", "adam", "--threads", "1",
             "--batch-size", str(args.batch_size), "--max-steps", str(args.max_steps),
             "--report-memory", "--lr-schedule", "constant",
             "--log-every", "1" if trace else "0", "--strategy", strategy])


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
    if any("baseline_rss_bytes" not in r for r in ranks.values()):
        raise RunError("memory-json lacks baseline_rss_bytes: elrun-train predates it; rebuild it "
                       "(bazel build //trainer/app:elrun-train)")
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
                f"{max(x['peak_rss_bytes'] for x in r) / MIB:.0f} MiB (baseline "
                f"{max(x['baseline_rss_bytes'] for x in r) / MIB:.0f}), step "
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
               "baseline": med(per_run(rs, "baseline_rss_bytes")),
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
        row["rss_x"] = row["rss"] / base["rss"] if base else None
        # What the RSS holds beyond what the accounting explains plus what the process had
        # before the model existed: the allocator's and autograd's share.
        row["rss_over"] = row["rss"] / (row["peak"] + row["baseline"])
        if base and "steady" in row and "steady" in base:
            row["steady_x"] = row["steady"] / base["steady"]
    return out


def mib(x):
    return f"{x / MIB:.1f}"


def table(args, summary):
    lines = ["| Strategy | State/rank MiB (params + grads + optimizer) | ZeRO formula MiB | "
             "÷ formula | ÷ ddp | Peak (accounting) MiB | Baseline RSS MiB | Peak RSS MiB | "
             "Peak RSS ÷ ddp's peak RSS | Peak RSS ÷ (peak (accounting) + baseline) | "
             "Step time s, median (min–max) | ÷ ddp |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in args.strategies:
        r = summary.get(s)
        if r is None:
            continue
        state_x = f"{r['state_x']:.3f}" if r["state_x"] is not None else "—"
        step_x = f"{r['step_x']:.2f}" if r["step_x"] is not None else "—"
        rss_x = f"{r['rss_x']:.3f}" if r["rss_x"] is not None else "—"
        lines.append(
            f"| {LABELS[s]} | {mib(r['state'])} ({mib(r['params'])} + {mib(r['grads'])} + "
            f"{mib(r['optimizer'])}) | {mib(r['formula'])} ({formula_text(s)}) | "
            f"{r['state'] / r['formula']:.3f} | {state_x} | {mib(r['peak'])} | "
            f"{mib(r['baseline'])} | {mib(r['rss'])} | {rss_x} | {r['rss_over']:.3f} | "
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
    out.append(f"- fsdp peak RSS {mib(f['rss'])} MiB = {f['rss_x']:.3f} × ddp's {mib(d['rss'])} "
               f"MiB (target ≤ {TARGET_RSS_RATIO:g}×): "
               f"**{verdict(f['rss_x'], TARGET_RSS_RATIO)}**")
    z = summary.get("zero2")
    if z:
        out.append(f"- zero2 peak RSS {mib(z['rss'])} MiB = {z['rss_x']:.3f} × ddp's "
                   f"{mib(d['rss'])} MiB (target ≤ {TARGET_ZERO2_RSS_RATIO:g}×): "
                   f"**{verdict(z['rss_x'], TARGET_ZERO2_RSS_RATIO)}**")
    out.append(f"- fsdp peak RSS {mib(f['rss'])} MiB = {f['rss_over']:.3f} × (its peak "
               f"(accounting) {mib(f['peak'])} MiB + its baseline RSS {mib(f['baseline'])} MiB = "
               f"{mib(f['peak'] + f['baseline'])} MiB) (target ≤ {TARGET_RSS_OVERHEAD:g}×): "
               f"**{verdict(f['rss_over'], TARGET_RSS_OVERHEAD)}**")
    return out


def runs_table(args, runs):
    lines = ["| Strategy | Round | Rank | state MiB | peak MiB | baseline RSS MiB | peak RSS MiB | "
             "step_time_s | wall s | others' CPU |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in args.strategies:
        for run in runs.get(s, []):
            share = f"{100 * run['foreign']:.0f}%" if run["foreign"] is not None else "?"
            for r in run["ranks"]:
                lines.append(f"| {s} | {run['round']} | {r['rank']} | {mib(r['state_bytes'])} | "
                             f"{mib(r['peak_bytes'])} | {mib(r['baseline_rss_bytes'])} | "
                             f"{mib(r['peak_rss_bytes'])} | "
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
            f"their peak (accounting) includes their buffer pool (below).")
    out.append("- Model construction: for the sharded strategies (zero1, zero2, fsdp, no_shard) "
               "elrun-train no longer builds the whole model on every rank: "
               "`FullyShardedDataParallel::Builder` flattens and shards each layer as the model's "
               "constructor builds it (under fsdp only the rank's shard stays), and the ranks "
               "compare a hash of each unit's initial values instead of broadcasting the model. "
               "ddp builds the whole model on every rank and broadcasts it from rank 0.")
    out.append("- FSDP's gathered parameters, unsharded gradients and reduce-scatter receive "
               "buffers come from a persistent, size-classed pool (`trainer/buffer_pool.h`): at "
               "most two units' parameters (the one in use and the prefetched one) and two units' "
               "gradients are lent at once, and the same buffers serve every step. On Gloo the "
               "all-gather is in place (one broadcast per rank's chunk, into the pooled buffer) "
               "and the reduce-scatter is an all-to-all into a pooled receive buffer.")
    out.append("- elrun-train serves CPU tensors of 1 MiB and more from a caching allocator "
               "(`--cpu-allocator caching`, the default; `default` is glibc's malloc): freed "
               "blocks are kept per size and reused, so peak RSS follows the live tensors (per "
               "size, the most ever live at once) rather than the layout of glibc's heap. Smaller "
               "allocations stay in glibc's heap (`mallopt` in `train_main.cc`: mmap threshold "
               "256 MiB, trim threshold 1 GiB, one arena for the sharded strategies).")
    widths = [28 * 28] + list(args.mlp_hidden) + [10]
    layer = max(a * b for a, b in zip(widths, widths[1:])) * 4
    out.append(f"- Peak RSS (VmHWM) still includes the baseline (LibTorch, the data sets, the "
               f"process group: the Baseline RSS column, measured just before the model is built) "
               f"and transients outside the accounting: autograd's weight-gradient temporaries "
               f"(one layer at a time, up to {mib(layer)} MiB here) and Adam's temporaries. Peak "
               f"RSS ÷ (peak (accounting) + baseline) is what those add; compare the strategies' "
               f"peak (accounting) for what they hold by design.")
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
    out += [f"- **workload**: MLP {mlp_text(args.mlp_hidden)}, "
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
    rss = [summary[s]["rss"] / MIB for s in names]
    ax2.bar([i + w / 2 for i in x], rss, w, color="#c0504d", label="peak RSS (VmHWM)")
    # The baseline (resident before the model was built) as the hatched bottom of the RSS bar.
    ax2.bar([i + w / 2 for i in x], [summary[s]["baseline"] / MIB for s in names], w,
            color="#e6b0ae", edgecolor="#7f2a27", hatch="///", linewidth=0.5,
            label="of which baseline RSS")
    for i, v in enumerate(rss):
        ax2.text(i + w / 2, v * 1.01, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    top2 = max(rss + [summary[s]["peak"] / MIB for s in names])
    if "ddp" in summary:
        ax2.axhline(TARGET_RSS_RATIO * summary["ddp"]["rss"] / MIB, color="green",
                    linestyle="--", linewidth=1,
                    label=f"fsdp target ≤ {TARGET_RSS_RATIO:g}× ddp's peak RSS")
    ax2.set_ylim(0, top2 * 1.4)
    ax2.set_title("Peak memory per rank (MiB, max over ranks)", fontsize=10)
    ax2.legend(fontsize=8, loc="upper center", ncol=2)

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
    fig.suptitle(f"elrun-train strategies: MLP {mlp_text(args.mlp_hidden)} "
                 f"({args.params / 1e6:.1f}M params), Adam, "
                 f"{args.nproc} ranks × batch {args.batch_size} × 1 thread", fontsize=11)
    bench_common.save_figure(fig, path)


# --- out-of-memory demonstration -------------------------------------------------------------

CGROUP_V1 = "/sys/fs/cgroup/memory"
CGROUP_PREFIX = "elrun-fsdp-bench"
OOM_STRATEGIES = ("ddp", "fsdp")


def read_text(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def keyed_value(text, key):
    """N of a `key N` line (memory.oom_control, memory.events), or None."""
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            try:
                return int(parts[1])
            except ValueError:
                return None
    return None


def int_file(path):
    text = read_text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def cgroup2_mounts():
    """Mount points of cgroup2 file systems, /sys/fs/cgroup first."""
    found = []
    for line in (read_text("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if right.split()[:1] == ["cgroup2"] and len(fields) > 4:
            found.append(fields[4].replace("\\040", " "))
    return sorted(set(found), key=lambda m: (m != "/sys/fs/cgroup", m))


class MemoryCgroup:
    """A memory cgroup of this benchmark's own (v1 or v2) with a hard limit and no swap; every
    process started with its preexec_fn, and their children, run in it."""

    def __init__(self, version, path):
        self.version, self.path = version, path

    def file(self, name):
        return os.path.join(self.path, name)

    @classmethod
    def create(cls, name, limit_bytes):
        """(MemoryCgroup, None), or (None, why no memory cgroup can be made here)."""
        reasons = []
        if os.path.isfile(os.path.join(CGROUP_V1, "memory.limit_in_bytes")):
            if os.access(CGROUP_V1, os.W_OK):
                cg = cls("v1", os.path.join(CGROUP_V1, name))
                try:
                    os.mkdir(cg.path)
                    write_text(cg.file("memory.limit_in_bytes"), str(limit_bytes))
                    # Also memory + swap, so that swap cannot hide the limit.
                    if os.path.exists(cg.file("memory.memsw.limit_in_bytes")):
                        write_text(cg.file("memory.memsw.limit_in_bytes"), str(limit_bytes))
                    return cg, None
                except OSError as ex:
                    cg.remove()
                    reasons.append(f"cgroup v1 at {CGROUP_V1}: {ex.strerror or ex}")
            else:
                reasons.append(f"cgroup v1 at {CGROUP_V1} is not writable")
        else:
            reasons.append(f"no cgroup v1 memory hierarchy at {CGROUP_V1}")
        mounts = cgroup2_mounts()
        if not mounts:
            reasons.append("no cgroup2 mount")
        for mount in mounts:
            controllers = (read_text(os.path.join(mount, "cgroup.controllers")) or "").split()
            if "memory" not in controllers:
                reasons.append(f"cgroup v2 at {mount} lacks the memory controller")
                continue
            cg = cls("v2", os.path.join(mount, name))
            try:
                subtree = os.path.join(mount, "cgroup.subtree_control")
                if "memory" not in (read_text(subtree) or "").split():
                    write_text(subtree, "+memory")
                os.mkdir(cg.path)
                write_text(cg.file("memory.max"), str(limit_bytes))
                if os.path.exists(cg.file("memory.swap.max")):
                    write_text(cg.file("memory.swap.max"), "0")
                return cg, None
            except OSError as ex:
                cg.remove()
                reasons.append(f"cgroup v2 at {mount}: {ex.strerror or ex}")
        return None, "; ".join(reasons)

    def join(self):
        """preexec_fn: moves the starting process (before it runs anything) into the cgroup."""
        fd = os.open(self.file("cgroup.procs"), os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def pids(self):
        text = read_text(self.file("cgroup.procs")) or ""
        return [int(p) for p in text.split() if p.isdigit()]

    def stats(self):
        """OOM kills (None when the kernel does not count them), limit hits, max usage bytes."""
        if self.version == "v1":
            return {"oom_kills": keyed_value(read_text(self.file("memory.oom_control")),
                                             "oom_kill"),
                    "failcnt": int_file(self.file("memory.failcnt")),
                    "max_usage": int_file(self.file("memory.max_usage_in_bytes"))}
        events = read_text(self.file("memory.events"))
        return {"oom_kills": keyed_value(events, "oom_kill"),
                "failcnt": keyed_value(events, "max"),
                "max_usage": int_file(self.file("memory.peak"))}

    def remove(self):
        """Kills what is left in it (only this run's processes can be) and removes it; bounded."""
        for _ in range(50):
            if not os.path.isdir(self.path):
                return True
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                os.rmdir(self.path)
                return True
            except FileNotFoundError:
                return True
            except OSError:
                time.sleep(0.1)  # Bounded retry: killed processes take a moment to leave it.
        log(f"  warning: could not remove the cgroup {self.path}")
        return False


def root_cause_lines(stderr):
    """elrun's failure report, condensed: its FAILED header and the root cause's rank and exitcode
    lines."""
    lines = [l.rstrip() for l in stderr.splitlines()]
    out = [l.strip() for l in lines if " FAILED (run_id " in l][:1]
    for i, line in enumerate(lines):
        if line.startswith("Root Cause"):
            out.append(line.strip())
            for detail in lines[i + 1:]:
                if detail.startswith(("---", "===")):
                    break
                if detail.strip().startswith(("rank ", "exitcode ", "error ")):
                    out.append(detail.strip())
            break
    return out


def oom_run(args, strategy, env, limit_bytes):
    """One run of `strategy` in a fresh memory cgroup of limit_bytes; never raises RunError: a
    failed run is a result here."""
    res = {"strategy": strategy, "limit_bytes": limit_bytes, "rc": None, "timed_out": False,
           "last_step": None, "oom_kills": None, "failcnt": None, "max_usage": None,
           "root_cause": [], "error": None, "cgroup": None}
    cg, why = MemoryCgroup.create(f"{CGROUP_PREFIX}-{os.getpid()}-{strategy}", limit_bytes)
    if cg is None:
        res["error"] = why
        return res
    res["cgroup"] = f"{cg.version} {cg.path}"
    tag = f"{args.tag}:oom:{strategy}"
    env = dict(env, **{TAG_VAR: tag})
    argv = command(args, strategy, args.train_copy, args.elrun_copy, trace=True)
    lines = []
    try:
        with tempfile.TemporaryFile() as err:
            t0 = time.monotonic()
            try:
                p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=err, env=env, cwd=REPO, start_new_session=True,
                                     preexec_fn=cg.join)
            except (OSError, subprocess.SubprocessError) as ex:
                res["error"] = f"could not start elrun in the cgroup {cg.path}: {ex}"
                return res
            try:
                lines = read_until_exit(p, t0 + args.timeout)
                res["rc"] = p.returncode
            except subprocess.TimeoutExpired:
                res["timed_out"] = True
            finally:  # Also on Ctrl-C: the launcher is in its own session; stop it here.
                p.stdout.close()
                bench_common.stop_launcher(p, TAG_VAR, tag)
            res["wall_s"] = time.monotonic() - t0
            err.seek(0)
            stderr = err.read().decode(errors="replace")
        res.update(cg.stats())
    finally:
        kill_tagged(tag)
        cg.remove()
    steps = [int(m.group(2)) for _, l in lines for m in [STEP_LINE.match(l)] if m]
    res["last_step"] = max(steps) if steps else 0
    if res["rc"] != 0:
        res["root_cause"] = root_cause_lines(stderr)
        res["stderr_tail"] = last_lines(stderr, 6)
    return res


def oom_killed(r):
    """Whether the kernel's OOM killer acted in r's cgroup (where the kernel does not count its
    kills: the limit was hit and the root cause is a SIGKILL elrun did not send)."""
    if r["oom_kills"] is not None:
        return r["oom_kills"] > 0
    return bool(r["failcnt"]) and any("-9 (SIGKILL)" in l and "not sent by elrun" in l
                                      for l in r["root_cause"])


def exit_text(r):
    if r["error"]:
        return "not run"
    if r["timed_out"]:
        return f"timed out after {r.get('wall_s', 0):.0f} s"
    rc = r["rc"]
    if rc is not None and rc < 0:
        return f"{rc} ({signal.Signals(-rc).name})" if -rc in signal.valid_signals() else str(rc)
    return str(rc)


def oom_demo(args, limit_bytes, limit_source):
    """Runs ddp and fsdp under one memory limit; (markdown lines, results)."""
    env = clean_env((TAG_VAR,))
    results = []
    for s in OOM_STRATEGIES:
        log(f"oom demo: {s} under a {limit_bytes / MIB:.0f} MiB memory cgroup")
        r = oom_run(args, s, env, limit_bytes)
        results.append(r)
        if r["error"]:
            log(f"  cannot run the out-of-memory demonstration here: {r['error']}")
            break
        log(f"  {s}: exit {exit_text(r)}, OOM kills {r['oom_kills']}, last step "
            f"{r['last_step']}/{args.max_steps}"
            + (f", cgroup max usage {r['max_usage'] / MIB:.0f} MiB" if r["max_usage"] else ""))
    out = ["## Out-of-memory demonstration: ddp and fsdp under one memory limit", ""]
    if results and results[0]["error"]:
        out += [f"- The demonstration cannot run here: {results[0]['error']}.", ""]
        return out, results
    cg = results[0]["cgroup"].split()[0]
    controls = ("memory.limit_in_bytes = memory.memsw.limit_in_bytes (no swap)" if cg == "v1"
                else "memory.max, memory.swap.max = 0")
    out += [f"- **limit**: {limit_bytes / MIB:.0f} MiB for the whole job (elrun and its "
            f"{args.nproc} workers, put in the cgroup before elrun starts), cgroup {cg} "
            f"{controls}; {limit_source}",
            f"- **command**: the benchmark's (--log-every 1), --max-steps {args.max_steps}, one "
            f"run each; --timeout {args.timeout:g} s", "",
            "| Strategy | Limit MiB | Exit status | OOM kills | Last step reached (of "
            "--max-steps) | Cgroup max usage MiB |", "|---|---:|---|---:|---:|---:|"]
    for r in results:
        kills = "?" if r["oom_kills"] is None else str(r["oom_kills"])
        if r["oom_kills"] is None and r["failcnt"] is not None:
            kills += f" (limit hit {r['failcnt']} times)"
        usage = f"{r['max_usage'] / MIB:.0f}" if r["max_usage"] is not None else "?"
        out.append(f"| {r['strategy']} | {r['limit_bytes'] / MIB:.0f} | {exit_text(r)} | {kills} | "
                   f"{r['last_step']} of {args.max_steps} | {usage} |")
    for r in results:
        if r["rc"] != 0 and (r["root_cause"] or r.get("stderr_tail")):
            out += ["", f"elrun's report of the {r['strategy']} run:", "", "```"]
            out += r["root_cause"] or [l[6:] for l in r["stderr_tail"].splitlines()]
            out.append("```")
    d = next((r for r in results if r["strategy"] == "ddp"), None)
    f = next((r for r in results if r["strategy"] == "fsdp"), None)
    why = []
    if d is None or d["rc"] == 0:
        why.append("ddp did not fail (the limit is not below what it needs"
                   + (f": its cgroup max usage was {d['max_usage'] / MIB:.0f} MiB; a limit "
                      f"between fsdp's and ddp's cgroup max usage may show it"
                      if d and d["max_usage"] else "") + ")")
    elif not oom_killed(d):
        why.append(f"ddp failed ({exit_text(d)}) but not by the OOM killer")
    if f is None:
        why.append("fsdp did not run")
    elif f["rc"] != 0:
        why.append(f"fsdp failed too ({exit_text(f)}"
                   + (", OOM-killed" if oom_killed(f) else "") + ")")
    elif f["last_step"] != args.max_steps:
        why.append(f"fsdp reached step {f['last_step']} of {args.max_steps}")
    out += ["", "- ddp fails for lack of memory and fsdp trains under the same limit: "
            + ("**shown**" if not why else f"**not shown**: {'; '.join(why)}"),
            f"- The cgroup's usage is not {args.nproc} × peak RSS: a rank's RSS counts the shared "
            f"file pages it maps (LibTorch's libraries) while the cgroup is charged once, and only "
            f"for the pages the job brings into memory; nor do the ranks' peaks need to coincide. "
            f"A limit from the peak RSS figures can be above what ddp needs.", ""]
    return out, results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elrun", default=DEFAULT_ELRUN, help="elrun binary (default: %(default)s)")
    ap.add_argument("--train", default=DEFAULT_TRAIN,
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
    bench_common.add_output_options(ap, DEFAULT_PNG, png_help="chart to write",
                                    json_help="also write every run's records (and the "
                                              "demonstration's) to this file")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="before each round, wait up to SECONDS until, for --quiet seconds in a "
                         "row, other processes used < 10%% of the CPUs and no other "
                         "scripts/bench/*.py ran (default 0: do not wait)")
    ap.add_argument("--quiet", type=float, default=15, metavar="SECONDS",
                    help="idle seconds in a row that --wait-idle needs (default 15)")
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
            ap.error(f"{name} binary {path} not found: bazel build //launcher:elrun "
                     f"//trainer/app:elrun-train")
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
    summary, record = None, {}
    if not args.oom_only:
        summary, record = run_bench(args)
    if args.oom_demo:
        record["oom_demo"] = run_oom_demo(args, summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        log(f"wrote {args.json}")
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
    lines, results = oom_demo(args, limit, source)
    print("\n".join(lines), flush=True)
    return {"limit_bytes": limit, "limit_source": source, "results": results,
            "commands": {s: command(args, s, trace=True) for s in OOM_STRATEGIES}}


def run_bench(args):
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
    return summary, {"machine": dict(info), "params": args.params, "summary": summary,
                     "runs": runs, "commands": {s: command(args, s) for s in args.strategies}}


if __name__ == "__main__":
    sys.exit(main())
