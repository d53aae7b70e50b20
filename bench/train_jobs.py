"""The training benchmarks' jobs (train_bench.py, scaling_bench.py): the configurations compared,
their commands, one timed run of a configuration (run_once) and the options of the jobs.

Every process a run starts carries TRAIN_BENCH_TAG=<benchmark tag>:<run> in its environment, and
so do the workers: after each run (and on timeout or Ctrl-C) whatever still carries it is killed.
"""
import contextlib
import json
import os
import subprocess
import tempfile
import time

from bench.machine import ForeignCpu
from bench.runner import RunError
from tests.support import paths
from tests.support.paths import PYTHON, REPO, TORCHRUN_COMPAT
from tests.support.procs import log, stop_launcher

DEFAULT_ELRUN = paths.binary("elrun")
DEFAULT_TRAIN = paths.binary("elrun-train")
TWIN = os.path.join(paths.BENCH, "fashion_twin.py")
TAG_VAR = "TRAIN_BENCH_TAG"

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
            return sum(stop_launcher(p, TAG_VAR, t) for p, t in zip(procs, tags))

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


def add_job_options(ap, max_steps):
    """The options of the runs' binaries, job and limits (also scaling_bench.py's)."""
    ap.add_argument("--elrun", default=DEFAULT_ELRUN, help="elrun binary (default: %(default)s)")
    ap.add_argument("--train", default=DEFAULT_TRAIN,
                    help="elrun-train binary (default: %(default)s)")
    ap.add_argument("--max-steps", type=int, default=max_steps,
                    help=f"steps per run (default {max_steps})")
    ap.add_argument("--batch-size", type=int, default=64, help="samples per rank per step (64)")
    ap.add_argument("--timeout", type=float, default=900,
                    help="seconds before one run is killed, which fails the benchmark (900)")


def check_job_options(ap, args, name):
    """Rejects bad job options and missing binaries; tags this benchmark's processes by `name`."""
    if args.max_steps < 1 or args.batch_size < 1:
        ap.error("--max-steps and --batch-size must be >= 1")
    for binary, path in (("elrun", args.elrun), ("elrun-train", args.train)):
        if not os.access(path, os.X_OK):
            ap.error(f"{binary} binary {path} not found: bazel build {paths.label('elrun')} "
                     f"{paths.label('elrun-train')}")
    args.elrun, args.train = os.path.abspath(args.elrun), os.path.abspath(args.train)
    args.tag = f"{name}.{os.getpid()}.{time.time_ns()}"
