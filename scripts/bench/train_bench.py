#!/usr/bin/python3
"""Training benchmark: elrun-train (LibTorch, C++ DDP) against its Python PyTorch DDP twin.

On this machine, in one invocation:
  - elrun-train under `elrun --standalone --nproc-per-node K`, K = 1 and 2;
  - scripts/bench/fashion_twin.py (the same model, data, data order, optimizer and step, with
    torch.nn.parallel.DistributedDataParallel on gloo) under Debian's torchrun 1.13, started through
    scripts/bench/torchrun_compat.py --standalone --nproc_per_node K, K = 1 and 2;
  - extra rows: elrun-train --sync-bn at 2 ranks; elrun-train --memory-format contiguous at 1 and
    2 ranks (NCHW activations, as the Python twin's, instead of the default channels-last); and
    elrun-train --allreduce gloo at 2 ranks (DDP's buckets over Gloo's TCP loopback, as the twin's,
    instead of shared memory). They separate what the kernels and the transport contribute;
  - the machine's ceiling: two independent 1-rank elrun-train jobs started at the same moment
    (no communication between them, so they compete only for the cores, caches and memory
    bandwidth); their summed rate over 2 x rate(1 rank) is the best scaling efficiency this
    machine allows two ranks of this workload, whatever the data-parallel implementation;
  - the synchronous ceiling: every rank of a data-parallel step waits for the slowest, so on a host
    whose CPUs each slow down and speed up on their own (a busy virtual machine's do), two ranks
    in lock step lose what the slower CPU costs each step. Both pair jobs write their step times
    (--step-times-file); pairing their steps k, sum(max(a_k, b_k)) / mean(sum a, sum b) is the
    factor by which lock step would have slowed that pair, and the pair's rate over it is the
    best a synchronous 2-rank job could have reached in that round.
Every run: FashionNet, batch 64 per rank, --threads 1, --max-steps S (300), --lr-schedule constant,
seed 0. Each configuration runs R (3) times, interleaved round-robin (the order rotates by one
configuration each round); the throughput of a run is the samples_per_s of its --metrics-file end
record, which both trainers measure the same way (steps x batch x world size over the time from
just before the first step to the end of the last, data loading and process-group set-up
excluded). The table gives medians with min/max, scaling efficiency rate(2) / (2 x rate(1)) and
elrun / Python at 2 ranks, with verdicts against the targets; also every run's wall time (launch
to exit) and the share of the CPUs that other processes used during it.

Prints a markdown report on stdout, progress on stderr, writes a PNG bar chart. Any run that exits
non-zero, times out or leaves no end record stops the benchmark with exit status 1.

  /usr/bin/python3 scripts/bench/train_bench.py [--max-steps 300] [--runs 3] [--wait-idle 120]
"""
import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import bench_common
from bench_common import (HERE, PYTHON, REPO, TORCHRUN_COMPAT, ForeignCpu, RunError, binary_id,
                          clean_env, fmt, log, loadavg, stats, wait_idle)
from bench_common import machine_info as _machine_info

DEFAULT_ELRUN = os.path.join(REPO, "bazel-bin", "launcher", "elrun")
DEFAULT_TRAIN = os.path.join(REPO, "bazel-bin", "trainer", "app", "elrun-train")
TWIN = os.path.join(HERE, "fashion_twin.py")
DEFAULT_PNG = os.path.join(HERE, "train_bench.png")

# Every process a run starts carries TRAIN_BENCH_TAG=<benchmark tag>:<run> in its environment, and
# so do the workers: after each run (and on timeout or Ctrl-C) whatever still carries it is killed.
TAG_VAR = "TRAIN_BENCH_TAG"

TARGET_RATIO = 1.15    # elrun-train samples/s at 2 ranks >= 1.15 x the Python twin's
TARGET_SCALING = 0.95  # elrun-train rate(2 ranks) / (2 x rate(1 rank)) >= 0.95

ELRUN, PY, SYNC, PAIR = "elrun", "python", "elrun-syncbn", "elrun-pair"
NCHW, GLOO = "elrun-nchw", "elrun-gloo"
LABELS = {
    ELRUN: "elrun + elrun-train (C++ DDP, BatchNorm2d)",
    NCHW: "elrun + elrun-train --memory-format contiguous (NCHW, as the twin) [d]",
    GLOO: "elrun + elrun-train --allreduce gloo (buckets over Gloo, as the twin) [d]",
    PY: "torchrun + fashion_twin.py (Python DDP, BatchNorm2d)",
    SYNC: "elrun + elrun-train --sync-bn (C++ DDP, SyncBatchNorm)",
    PAIR: "2 × (elrun + elrun-train, 1 rank), at once, no communication [c]",
}


class Config:
    def __init__(self, kind, nproc):
        self.kind, self.nproc = kind, nproc
        self.runs = []  # dicts: round, wall_s, end record, foreign share

    @property
    def key(self):
        return f"{self.kind}@{self.nproc}"

    def rates(self):
        return [r["end"]["samples_per_s"] for r in self.runs]


def worker_args(args, metrics):
    return ["--model", "fashionnet", "--batch-size", str(args.batch_size), "--threads", "1",
            "--max-steps", str(args.max_steps), "--lr-schedule", "constant", "--seed", "0",
            "--log-every", "0", "--metrics-file", metrics]


def command(args, c, metrics):
    k = "1" if c.kind == PAIR else str(c.nproc)
    if c.kind == PY:
        return ([PYTHON, TORCHRUN_COMPAT, "--standalone", "--nproc_per_node", k, TWIN]
                + worker_args(args, metrics))
    argv = ([args.elrun_copy, "--standalone", "--nproc-per-node", k, "--no-python", args.train_copy]
            + worker_args(args, metrics) + ["--step-times-file", metrics + ".steps"])
    extra = {SYNC: ["--sync-bn"], NCHW: ["--memory-format", "contiguous"], GLOO: ["--allreduce", "gloo"]}
    return argv + extra.get(c.kind, [])


def tagged_pids(prefix):
    return bench_common.tagged_pids(TAG_VAR, prefix)


def kill_tagged(prefix):
    return bench_common.kill_tagged(TAG_VAR, prefix)


def last_lines(f, n=12):
    """The last n non-empty lines of a captured output file, indented."""
    f.seek(0)
    lines = [l.rstrip() for l in f.read().decode(errors="replace").splitlines() if l.strip()]
    return "\n".join("    | " + l[-300:] for l in lines[-n:]) or "    (nothing)"


def shown(args, argv):
    """argv with the private copies of the binaries named by their original paths."""
    return [{args.elrun_copy: args.elrun, args.train_copy: args.train}.get(a, a) for a in argv]


def read_end(args, metrics, world_size):
    """The end record of one run's metrics file. Raises RunError."""
    try:
        with open(metrics) as f:
            ends = [json.loads(l) for l in f if '"event":"end"' in l.replace(" ", "")]
    except (OSError, ValueError) as ex:
        raise RunError(f"no readable metrics file {metrics}: {ex}")
    if len(ends) != 1:
        raise RunError(f"{metrics}: {len(ends)} end records, expected 1")
    end = ends[0]
    if end.get("world_size") != world_size:
        raise RunError(f"{metrics}: world_size {end.get('world_size')}, expected {world_size}")
    if end.get("steps") != args.max_steps:
        raise RunError(f"{metrics}: {end.get('steps')} steps, expected {args.max_steps}")
    return end


def read_step_times(path, steps):
    """(wall ms, CPU ms) per step from one rank's --step-times-file. Raises RunError."""
    try:
        with open(path) as f:
            rows = [line.rstrip("\n").split("\t") for line in f]
        times = [(float(w), float(c)) for _, w, c in rows[1:]]
    except (OSError, ValueError) as ex:
        raise RunError(f"no readable step-times file {path}: {ex}")
    if len(times) != steps:
        raise RunError(f"{path}: {len(times)} steps, expected {steps}")
    return times


def lockstep_factor(a, b):
    """How much slower two independent jobs' steps (wall ms each) would have been in lock step:
    sum over k of max(a_k, b_k), over the mean of the two jobs' sums."""
    return sum(map(max, a, b)) / ((sum(a) + sum(b)) / 2)


def off_cpu_share(times):
    """The share of a rank's step time its training thread was not on a CPU."""
    return 1 - sum(c for _, c in times) / sum(w for w, _ in times)


def run_once(args, c, env, workdir, rnd):
    """One run of config c: (wall seconds, end record, foreign CPU share, argv). Raises RunError.
    PAIR starts two 1-rank launchers at once; its end record sums their rates."""
    copies = 2 if c.kind == PAIR else 1
    metrics = [os.path.join(workdir, f"{c.kind}_{c.nproc}_{rnd}_{i}.jsonl") for i in range(copies)]
    argvs = [command(args, c, m) for m in metrics]
    tags = [f"{args.tag}:{c.key}:{rnd}:{i}" for i in range(copies)]
    foreign = ForeignCpu()
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(copies)]
        errs = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(copies)]

        def stop_all(procs):
            return sum(bench_common.stop_launcher(p, TAG_VAR, t) for p, t in zip(procs, tags))

        def go():
            t0 = time.perf_counter()
            procs = []
            try:
                for argv, tag, out, err in zip(argvs, tags, outs, errs):
                    procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                                  stderr=err, env=dict(env, **{TAG_VAR: tag}),
                                                  cwd=REPO, start_new_session=True))
                rcs = [p.wait(timeout=max(0.0, t0 + args.timeout - time.perf_counter()))
                       for p in procs]
            except subprocess.TimeoutExpired:
                stop_all(procs)
                raise RunError(f"timed out after {args.timeout:g} s; stderr ends:\n"
                               f"{last_lines(errs[0])}")
            except BaseException:  # Ctrl-C: the launchers are in their own sessions; stop them.
                stop_all(procs)
                raise
            wall = time.perf_counter() - t0
            left = stop_all(procs)  # Stragglers (there should be none).
            if left:
                log(f"  warning: {left} process(es) of {c.key} outlived the launcher; killed")
            for rc, out, err in zip(rcs, outs, errs):
                if rc != 0:
                    raise RunError(f"exit status {rc}; stdout ends:\n{last_lines(out)}\n"
                                   f"stderr ends:\n{last_lines(err)}")
            return wall

        wall = foreign.phase(go)
    ends = [read_end(args, m, 1 if c.kind == PAIR else c.nproc) for m in metrics]
    end = ends[0]
    if c.kind != PY:
        ranks = 1 if c.kind == PAIR else c.nproc
        steps = [read_step_times(f"{m}.steps.{r}", args.max_steps) for m in metrics
                 for r in range(ranks)]
        end = dict(end, off_cpu=[off_cpu_share(t) for t in steps])
    if c.kind == PAIR:
        factor = lockstep_factor(*[[w for w, _ in t] for t in steps])
        rate = sum(e["samples_per_s"] for e in ends)
        end = dict(end, samples_per_s=rate, seconds=max(e["seconds"] for e in ends), world_size=2,
                   pair_rates=[e["samples_per_s"] for e in ends], lockstep=factor,
                   sync_rate=rate / factor)
    return wall, end, foreign.share, argvs[0]


def bench(args, workdir):
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


# --- report ----------------------------------------------------------------------------------

def get(configs, kind, nproc):
    return next((c for c in configs if c.kind == kind and c.nproc == nproc), None)


def med(c):
    return stats(c.rates())[0] if c and c.runs else None


def meets(value, target):
    return "yes" if value >= target else "NO"


def rate_cell(c):
    if c is None or not c.runs:
        return "—"
    m, lo, hi = stats(c.rates())
    return f"{fmt(m)} ({fmt(lo)}–{fmt(hi)})"


def summary(configs):
    e1, e2 = med(get(configs, ELRUN, 1)), med(get(configs, ELRUN, 2))
    p1, p2 = med(get(configs, PY, 1)), med(get(configs, PY, 2))
    s2, pair = med(get(configs, SYNC, 2)), med(get(configs, PAIR, 2))
    a1, a2, g2 = med(get(configs, NCHW, 1)), med(get(configs, NCHW, 2)), med(get(configs, GLOO, 2))
    sync = stats([r["end"]["sync_rate"] for r in get(configs, PAIR, 2).runs])[0]
    return {"e1": e1, "e2": e2, "p1": p1, "p2": p2, "s2": s2, "pair": pair,
            "a1": a1, "a2": a2, "g2": g2, "a_scaling": a2 / (2 * a1), "a_ratio": a2 / p2,
            "g_scaling": g2 / (2 * e1), "g_ratio": g2 / p2,
            "e_scaling": e2 / (2 * e1), "p_scaling": p2 / (2 * p1), "s_scaling": s2 / (2 * e1),
            "ceiling": pair / (2 * e1), "e_of_ceiling": e2 / pair,
            "lockstep": stats([r["end"]["lockstep"] for r in get(configs, PAIR, 2).runs])[0],
            "sync_ceiling": sync / (2 * e1), "e_of_sync": e2 / sync,
            "ratio": e2 / p2, "s_ratio": s2 / p2, "ratio1": e1 / p1}


def table(configs, s):
    lines = ["| Configuration | samples/s, 1 rank | samples/s, 2 ranks | scaling efficiency "
             "rate(2) / (2 × rate(1)) | ÷ Python at 2 ranks |",
             "|---|---:|---:|---:|---:|"]
    lines.append(f"| {LABELS[ELRUN]} | {rate_cell(get(configs, ELRUN, 1))} | "
                 f"{rate_cell(get(configs, ELRUN, 2))} | {s['e_scaling']:.3f} "
                 f"(target ≥ {TARGET_SCALING:g}: **{meets(s['e_scaling'], TARGET_SCALING)}**) | "
                 f"{s['ratio']:.2f}× (target ≥ {TARGET_RATIO:g}×: "
                 f"**{meets(s['ratio'], TARGET_RATIO)}**) |")
    lines.append(f"| {LABELS[PY]} | {rate_cell(get(configs, PY, 1))} | "
                 f"{rate_cell(get(configs, PY, 2))} | {s['p_scaling']:.3f} | 1.00× |")
    lines.append(f"| {LABELS[SYNC]} | — | {rate_cell(get(configs, SYNC, 2))} | "
                 f"{s['s_scaling']:.3f} [a] | {s['s_ratio']:.2f}× [b] |")
    lines.append(f"| {LABELS[PAIR]} | — | {rate_cell(get(configs, PAIR, 2))} | "
                 f"{s['ceiling']:.3f} [a] | — |")
    lines.append(f"| the synchronous ceiling: the pair's steps in lock step [e] | — | "
                 f"{fmt(s['sync_ceiling'] * 2 * s['e1'])} | {s['sync_ceiling']:.3f} [a] | — |")
    lines.append(f"| {LABELS[NCHW]} | {rate_cell(get(configs, NCHW, 1))} | "
                 f"{rate_cell(get(configs, NCHW, 2))} | {s['a_scaling']:.3f} | {s['a_ratio']:.2f}× |")
    lines.append(f"| {LABELS[GLOO]} | — | {rate_cell(get(configs, GLOO, 2))} | "
                 f"{s['g_scaling']:.3f} [a] | {s['g_ratio']:.2f}× |")
    return lines


def runs_table(configs):
    lines = ["| Configuration | Ranks | Round | samples/s | train s | step ms p10 / p50 / p90 | "
             "off CPU, per rank | rank 0: run queue / blocked s | lock step | "
             "wall s (launch to exit) | test accuracy | others' CPU |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in configs:
        for r in c.runs:
            e = r["end"]
            share = f"{100 * r['foreign']:.0f}%" if r["foreign"] is not None else "?"
            steps = (f"{e['step_ms_p10']:.1f} / {e['step_ms_p50']:.1f} / {e['step_ms_p90']:.1f}"
                     if "step_ms_p50" in e else "—")
            off = " / ".join(f"{100 * x:.1f}%" for x in e["off_cpu"]) if "off_cpu" in e else "—"
            loop = (f"{e['loop_runqueue_s']:.2f} / {e['loop_blocked_s']:.2f}"
                    if "loop_blocked_s" in e and c.kind != PAIR else "—")
            lock = f"{e['lockstep']:.3f}×" if "lockstep" in e else "—"
            lines.append(f"| {c.kind} | {c.nproc} | {r['round']} | {e['samples_per_s']:.1f} | "
                         f"{e['seconds']:.2f} | {steps} | {off} | {loop} | {lock} | {r['wall_s']:.1f} | "
                         f"{e['test_accuracy']:.4f} | {share} |")
    return lines


def wall_table(configs):
    lines = ["| Configuration | Ranks | wall s, median (min–max) | train s, median | "
             "wall − train, median |", "|---|---:|---:|---:|---:|"]
    for c in configs:
        walls = [r["wall_s"] for r in c.runs]
        trains = [r["end"]["seconds"] for r in c.runs]
        over = [w - t for w, t in zip(walls, trains)]
        m, lo, hi = stats(walls)
        lines.append(f"| {c.kind} | {c.nproc} | {m:.1f} ({lo:.1f}–{hi:.1f}) | "
                     f"{stats(trains)[0]:.1f} | {stats(over)[0]:.1f} |")
    return lines


def accuracy_check(configs):
    parts = []
    for nproc in (1, 2):
        accs = {kind: sorted({r["end"]["test_accuracy"] for r in get(configs, kind, nproc).runs})
                for kind in (NCHW, ELRUN, PY)}
        same = accs[NCHW] == accs[PY]
        parts.append(f"{nproc} rank(s): elrun-train --memory-format contiguous "
                     f"{', '.join(f'{a:.4f}' for a in accs[NCHW])}, Python "
                     f"{', '.join(f'{a:.4f}' for a in accs[PY])} ({'equal' if same else 'differ'}),"
                     f" elrun-train in channels-last {', '.join(f'{a:.4f}' for a in accs[ELRUN])}")
    return ("; ".join(parts) + " (NHWC convolutions sum in another order, so the default's accuracy may differ "
            "in the last digits; at 2 ranks all may differ slightly: Python's DDP broadcasts "
            "rank 0's BatchNorm running stats before every forward, elrun-train only at start, so "
            "rank 1 evaluates its shard with other running stats)")


def report_header(title, args, info, plan, unit, load, elapsed):
    """A report's title and its machine, workload (`plan`: how the runs were ordered) and load."""
    out = [f"## {title}", ""]
    out += [f"- **{k}**: {v}" for k, v in info]
    out += [f"- **workload**: FashionNet on Fashion-MNIST, batch {args.batch_size} per rank, "
            f"--threads 1, --max-steps {args.max_steps}, --lr-schedule constant, seed 0; {plan}"
            + (f", waited up to {args.wait_idle:g} s for an idle machine before each {unit}"
               if args.wait_idle > 0 else "") + f"; benchmark took {elapsed:.0f} s",
            f"- **load**: {load}", ""]
    return out


def report(args, configs, commands, s, info, load, elapsed):
    out = report_header("Training benchmark: elrun-train vs a Python PyTorch DDP twin", args, info,
                        f"{args.runs} runs per configuration, interleaved round-robin", "round",
                        load, elapsed)
    out += table(configs, s)
    out += [
        "",
        f"samples/s: median (min–max) over {args.runs} runs of the `samples_per_s` in each run's "
        "`--metrics-file` end record (rank 0), which both trainers compute alike: steps × batch × "
        "world size over the time from just before the first training step to the end of the last "
        "(data loading, process-group and DDP set-up, evaluation and launcher start-up excluded). "
        "Ratios and efficiencies are of medians.",
        f"[a] against the plain-BatchNorm elrun-train at 1 rank ({fmt(s['e1'])} samples/s). "
        f"[b] against the plain-BatchNorm Python twin at 2 ranks: not the same work (SyncBatchNorm "
        "all-reduces batch statistics in every forward and backward).",
        f"[c] The machine's ceiling: two independent 1-rank elrun-train jobs started at the same "
        "moment, the rate their two end records report, summed. They do not communicate, so "
        "their shortfall from 2 × rate(1 rank) is what two ranks lose on this machine to sharing "
        "its cores, caches and memory bandwidth alone. elrun-train's DDP at 2 ranks reached "
        f"{s['e_of_ceiling']:.3f} of this ceiling (scaling {s['e_scaling']:.3f} against a ceiling "
        f"of {s['ceiling']:.3f}).",
        "[e] The pair's two jobs also wrote every step's time (`--step-times-file`). Had they run in "
        "lock step, as the ranks of a data-parallel job do, each step would have taken as long as "
        "the slower job's: sum over k of max(a_k, b_k) against the mean of the two sums is the "
        f"lock-step factor (median {s['lockstep']:.3f}×), and the pair's rate over it the best a "
        "synchronous 2-rank job could have reached in that round (median over rounds). On a host "
        "whose CPUs slow down and recover independently, this is below the pair's ceiling [c] by "
        "what waiting for the slower CPU costs; no implementation of synchronous data parallelism "
        f"gets past it. elrun-train's DDP at 2 ranks reached {s['e_of_sync']:.3f} of it.",
        "[d] Ablations of elrun-train's two defaults that the twin does not share. --memory-format "
        "contiguous: the convolutions' weights and activations in NCHW, as the twin's (the default "
        "on CPU is channels-last, NHWC, where oneDNN's convolutions and ATen's pooling and batch "
        "norm are vectorised over channels: same parameters, same results up to float rounding). "
        "--allreduce gloo: DDP's buckets over "
        "Gloo's TCP loopback, as the twin's DDP (the default sums them in a shared-memory segment "
        "when all ranks are on one host). Scaling of the gloo row is against the default 1-rank "
        "rate [a], as one rank communicates nothing.",
        "",
        "Wall time of a run, launch to exit (includes launcher start-up, rendezvous, interpreter "
        "and library loading, dataset loading, training and the test-set evaluation):",
        "",
    ]
    out += wall_table(configs)
    out += [
        "",
        "wall − train is mostly start-up (torchrun and each Python worker import torch: seconds "
        "each), dataset loading and the test-set evaluation (10,000 images in chunks of 1,000 per "
        "rank, in both trainers). The Python twin keeps glibc's default malloc settings, under "
        "which the ~100 MB activations of a 1,000-image chunk are above the largest dynamic mmap "
        "threshold (32 MiB) and are mmap-ed and page-faulted afresh for every operator; "
        "elrun-train raises the threshold to 256 MiB at start (mallopt), so its evaluation reuses "
        "heap memory. The training steps (batch 64, ~6 MB activations) are under the threshold in "
        "both.",
        "",
        "Same computation: at 1 rank both trainers start from identical weights (same seed, same "
        "libtorch 1.13.1, modules built in the same order) and read the same batches, so with the "
        "same Linear kernel their test accuracies after the run should be equal: " + accuracy_check(configs) + ".",
    ]
    out += ["", "Every run:", ""]
    out += runs_table(configs)
    out += ["", "step ms: elrun-train's end record, percentiles over the run's steps of rank 0's "
            "training step (data to optimizer step, communication included; for the pair, the first "
            "job's). A data-parallel step ends when the slower rank's does, so its spread shows the "
            "ranks' step-to-step jitter. The twin does not report it. off CPU: the share of each "
            "rank's step time its training thread was not on a CPU (`--step-times-file`: wall minus "
            "thread CPU time); for DDP mostly waiting for the slower rank's gradients. run queue / "
            "blocked: rank 0's whole training loop, from the end record (`loop_runqueue_s`: runnable "
            "but waiting for a CPU; `loop_blocked_s`: sleeping). lock step: the pair's factor [e]."]
    out += commands_block(args, [(c.key, commands.get(c.key), c.kind == PAIR) for c in configs])
    return "\n".join(out)


def commands_block(args, runs):
    """The report's commands, one per (key, argv, is the pair) with an argv: repository paths
    relative, the per-run files named METRICS and METRICS.steps."""
    out = ["", "Commands (run from the repository root; METRICS is a fresh file per run):", "", "```"]
    for key, argv, pair in runs:
        if not argv:
            continue
        argv = shown(args, argv)
        for option, name in (("--metrics-file", "METRICS"), ("--step-times-file", "METRICS.steps")):
            if option in argv:
                argv[argv.index(option) + 1] = name
        out.append(shlex.join(argv).replace(REPO + "/", "") + f"  # {key}"
                   + (" (two at once, each with its own METRICS)" if pair else ""))
    return out + ["```", ""]


def plot(configs, s, path):
    plt = bench_common.pyplot()

    colors = {ELRUN: "#2a7ab0", PY: "#c0504d", SYNC: "#7fb3d5"}
    short = {ELRUN: "elrun-train", PY: "Python twin (torchrun)", SYNC: "elrun-train --sync-bn"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [3, 3]})
    width = 0.26
    top = 0
    for i, kind in enumerate([ELRUN, PY, SYNC]):
        for j, nproc in enumerate([1, 2]):
            c = get(configs, kind, nproc)
            if c is None or not c.runs:
                continue
            m, lo, hi = stats(c.rates())
            x = j + (i - 1) * width
            ax1.bar(x, m, width, color=colors[kind], yerr=[[m - lo], [hi - m]], capsize=4,
                    label=short[kind] if j == 1 or kind != SYNC else None)
            ax1.text(x, hi * 1.01, f"{m:.0f}", ha="center", va="bottom", fontsize=8)
            top = max(top, hi)
    handles, labels = ax1.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax1.legend(uniq.values(), uniq.keys(), fontsize=8, loc="upper left")
    # (The ceiling configuration is drawn only in the scaling panel.)
    ax1.set_xticks([0, 1])
    ax1.set_xticklabels(["1 rank", "2 ranks"])
    ax1.set_ylim(0, top * 1.25)
    ax1.set_ylabel("samples/s (median; whiskers min/max)")
    ax1.set_title(f"Throughput (elrun/Python at 2 ranks: {s['ratio']:.2f}×, "
                  f"target ≥ {TARGET_RATIO:g}×)", fontsize=10)

    bars = [("elrun-train", s["e_scaling"], colors[ELRUN]),
            ("Python twin", s["p_scaling"], colors[PY]),
            ("elrun-train\n--sync-bn [a]", s["s_scaling"], colors[SYNC]),
            ("ceiling: 2 × 1-rank\njobs at once [a]", s["ceiling"], "#999999"),
            ("synchronous\nceiling [a]", s["sync_ceiling"], "#bbbbbb"),
            ("--memory-format\ncontiguous", s["a_scaling"], "#a6cee3"),
            ("--allreduce\ngloo [a]", s["g_scaling"], "#b2df8a")]
    for i, (name, v, color) in enumerate(bars):
        ax2.bar(i, v, 0.6, color=color)
        ax2.text(i, v + 0.01, f"{v:.3f}", ha="center", va="bottom", fontsize=9)
    ax2.axhline(TARGET_SCALING, color="green", linestyle="--", linewidth=1,
                label=f"elrun target ≥ {TARGET_SCALING:g}")
    ax2.axhline(1.0, color="gray", linewidth=0.5)
    ax2.set_xticks(range(len(bars)))
    ax2.set_xticklabels([b[0] for b in bars], fontsize=8)
    ax2.set_ylim(0, max(1.1, max(b[1] for b in bars) * 1.15))
    ax2.set_title("Scaling efficiency rate(2) / (2 × rate(1))", fontsize=10)
    ax2.legend(fontsize=8, loc="lower right")
    fig.suptitle("elrun-train vs Python PyTorch DDP twin: FashionNet, batch 64/rank, 1 thread/rank "
                 "([a] vs plain-BN elrun-train at 1 rank)", fontsize=10)
    bench_common.save_figure(fig, path)


def add_job_options(ap, max_steps, unit):
    """The options of the runs' binaries, job and limits (also scaling_bench.py's)."""
    ap.add_argument("--elrun", default=DEFAULT_ELRUN, help="elrun binary (default: %(default)s)")
    ap.add_argument("--train", default=DEFAULT_TRAIN,
                    help="elrun-train binary (default: %(default)s)")
    ap.add_argument("--max-steps", type=int, default=max_steps,
                    help=f"steps per run (default {max_steps})")
    ap.add_argument("--batch-size", type=int, default=64, help="samples per rank per step (64)")
    ap.add_argument("--timeout", type=float, default=900,
                    help="seconds before one run is killed, which fails the benchmark (900)")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help=f"before each {unit}, wait up to SECONDS until other processes use < 10%% "
                         "of the CPUs (default 0: do not wait)")


def check_job_options(ap, args, name):
    """Rejects bad job options and missing binaries; tags this benchmark's processes by `name`."""
    if args.max_steps < 1 or args.batch_size < 1:
        ap.error("--max-steps and --batch-size must be >= 1")
    for binary, path in (("elrun", args.elrun), ("elrun-train", args.train)):
        if not os.access(path, os.X_OK):
            ap.error(f"{binary} binary {path} not found: bazel build //launcher:elrun "
                     f"//trainer/app:elrun-train")
    args.elrun, args.train = os.path.abspath(args.elrun), os.path.abspath(args.train)
    args.tag = f"{name}.{os.getpid()}.{time.time_ns()}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_job_options(ap, max_steps=300, unit="round")
    ap.add_argument("--runs", type=int, default=3, help="runs per configuration (default 3)")
    bench_common.add_output_options(ap, DEFAULT_PNG, png_help="bar chart to write",
                                    json_help="also write every run's record to this file")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    check_job_options(ap, args, "train_bench")
    try:
        with bench_common.private_copies(args, "train_bench", {"elrun": "elrun", "train": "elrun-train"}) as tmp:
            return run(args, tmp)
    except RunError as ex:
        log(f"train_bench: FAILED: {ex}")
        return 1


def publish(args, text, draw, record):
    """The report on stdout, the plot drawn to --png and the record written to --json."""
    print(text, flush=True)
    if args.png:
        draw(args.png)
        log(f"wrote {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        log(f"wrote {args.json}")


def run(args, tmp):
    load_start = loadavg()
    ids = (binary_id(args.elrun_copy), binary_id(args.train_copy))
    info = _machine_info([("elrun", args.elrun), ("elrun-train", args.train)])
    configs, commands, elapsed = bench(args, tmp)
    walls = sum(r["wall_s"] for c in configs for r in c.runs)
    shares = [(r["foreign"], r["wall_s"]) for c in configs for r in c.runs if r["foreign"] is not None]
    load = ("CPU use of other processes unknown" if not shares else
            f"other processes used {100 * sum(a * w for a, w in shares) / walls:.0f}% of the CPUs "
            f"during the runs (wall-weighted; per run {min(100 * a for a, _ in shares):.0f}–"
            f"{max(100 * a for a, _ in shares):.0f}%; machine CPU time minus this benchmark's and "
            f"its children's)")
    noisy = shares and sum(a * w for a, w in shares) / walls > 0.10
    load += f"; loadavg (1/5/15 min) {load_start} at start, {loadavg()} at end"
    if noisy:
        load += " — **the machine was busy; the rates are noisy**"
        log("warning: other processes used more than 10% of the CPUs; the rates are noisy")
    if (binary_id(args.elrun), binary_id(args.train)) != ids:
        load += (" — the elrun or elrun-train binary was rebuilt during the benchmark; the runs "
                 "used copies taken at its start (the builds described above)")
        log("warning: the elrun or elrun-train binary was rebuilt during the benchmark; the runs "
            "used copies taken at its start")
    s = summary(configs)
    publish(args, report(args, configs, commands, s, info, load, elapsed),
            lambda path: plot(configs, s, path),
            {"machine": dict(info), "summary": s,
             "configs": [{"kind": c.kind, "nproc": c.nproc, "runs": c.runs,
                          "command": commands.get(c.key)} for c in configs]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
