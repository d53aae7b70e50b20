#!/usr/bin/python3
"""The GPT workload: elrun-train --model gpt (ddp, fsdp) against PyTorch's own DDP and FSDP2."""
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from bench import gpt_report, results, runner
from bench.machine import ForeignCpu, loadavg, machine_info, wait_idle
from bench.runner import CaseState, RunError
from tests.support import paths
from tests.support.paths import PYTHON, REPO, TORCHRUN_COMPAT
from tests.support.procs import clean_env, log, stop_launcher

BENCH = "gpt_bench"
TAG_VAR = "GPT_BENCH_TAG"
TWIN = os.path.join(paths.BENCH, "gpt_twin.py")
SMOKE = ["--runs", "1", "--max-steps", "5", "--skip", "2", "--layers", "2", "--width", "64", "--heads", "4",
         "--context", "64"]
WORLD = 2
CASES = ["elrun-ddp", "torch-ddp", "elrun-fsdp", "torch-fsdp2"]
COMPILE_CASES = ["torch-ddp-compile", "torch-fsdp2-compile"]


def model_args(args):
    if args.workload == "mlp":
        return ["--model", "mlp", "--mlp-hidden", ",".join(map(str, args.mlp_hidden)), "--batch-size",
                str(args.batch_size), "--max-steps", str(args.max_steps), "--lr", "0.001", "--weight-decay", "0.1",
                "--seed", "0", "--threads", "1"]
    return ["--model", "gpt", "--gpt-layers", str(args.layers), "--gpt-width", str(args.width),
            "--gpt-heads", str(args.heads), "--gpt-context", str(args.context), "--batch-size", str(args.batch_size),
            "--max-steps", str(args.max_steps), "--lr", "0.001", "--weight-decay", "0.1", "--seed", "0",
            "--threads", "1"]


def command(args, case, steps_file):
    if case.startswith("elrun-"):
        return ([args.elrun_copy, "--standalone", "--nproc-per-node", str(WORLD), "--no-python", args.train_copy,
                 "--strategy", case.split("-")[1], "--optimizer", "adamw", "--lr-schedule", "constant",
                 "--log-every", "0", "--report-memory", "--step-times-file", steps_file]
                + (["--dataset", "synthetic"] if args.workload == "mlp"
                   else ["--eval-samples", "16", "--sample-bytes", "0"])
                + model_args(args))
    strategy = "fsdp2" if "fsdp2" in case else "ddp"
    return ([PYTHON, TORCHRUN_COMPAT, "--standalone", "--nproc_per_node", str(WORLD), TWIN, "--strategy", strategy,
             "--step-times-file", steps_file] + (["--compile"] if case.endswith("-compile") else [])
            + model_args(args))


def read_steps(path, steps):
    try:
        with open(path) as f:
            rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
        times = [float(r[1]) for r in rows[1:]]
    except (OSError, ValueError, IndexError) as ex:
        raise RunError(f"no readable step-times file {path}: {ex}")
    if len(times) != steps:
        raise RunError(f"{path}: {len(times)} steps, expected {steps}")
    return times


def memory_lines(stdout):
    """{rank: record} of the `memory-json {...}` records both trainers print (the ranks share the
    launcher's stdout, so two records may share a line)."""
    found = {}
    for text in re.findall(r"memory-json (\{[^{}]*\})", stdout):
        try:
            record = json.loads(text)
            found[record["rank"]] = record
        except (ValueError, KeyError) as ex:
            raise RunError(f"unreadable memory-json record {text!r}: {ex}")
    return found


def run_once(args, case, workdir, rnd, env):
    """One run of `case`: its per-run figures. Raises RunError."""
    steps_file = os.path.join(workdir, f"{case}_{rnd}.steps")
    argv = command(args, case, steps_file)
    tag = f"{args.tag}:{case}:{rnd}"
    foreign = ForeignCpu()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        def go():
            t0 = time.perf_counter()
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    env=dict(env, **{TAG_VAR: tag}), cwd=REPO, start_new_session=True)
            try:
                rc = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                stop_launcher(proc, TAG_VAR, tag)
                raise RunError(f"timed out after {args.timeout:g} s")
            except BaseException:
                stop_launcher(proc, TAG_VAR, tag)
                raise
            stop_launcher(proc, TAG_VAR, tag)
            return rc, time.perf_counter() - t0

        rc, wall = foreign.phase(go)
        out.seek(0)
        stdout = out.read().decode(errors="replace")
        err.seek(0)
        stderr_tail = "\n".join(err.read().decode(errors="replace").splitlines()[-8:])
    if rc != 0:
        raise RunError(f"exit status {rc}; stderr ends:\n{stderr_tail}")
    ranks = [read_steps(f"{steps_file}.{r}", args.max_steps) for r in range(WORLD)]
    slower = [max(step) for step in zip(*ranks)][args.skip:]
    step_ms = statistics.median(slower)
    memory = memory_lines(stdout)
    if sorted(memory) != list(range(WORLD)):
        raise RunError(f"memory-json lines of ranks {sorted(memory)}, expected 0..{WORLD - 1}")
    tokens_per_s = WORLD * args.batch_size * args.context / (step_ms / 1000) if args.workload == "gpt" else None
    return {"round": rnd, "wall_s": wall, "step_ms": step_ms,
            "first_steps_ms": [max(s) for s in zip(*ranks)][:args.skip],
            "samples_per_s": WORLD * args.batch_size / (step_ms / 1000),
            "tokens_per_s": tokens_per_s,
            "peak_rss": [memory[r]["peak_rss_bytes"] for r in range(WORLD)],
            "baseline_rss": [memory[r]["baseline_rss_bytes"] for r in range(WORLD)],
            "foreign_cpu": foreign.share, "argv": argv}


def bench(args, workdir):
    cases = {c: CaseState() for c in args.cases}
    env = clean_env((TAG_VAR,))
    commands = {}
    t0 = time.monotonic()
    for rnd in range(args.runs):
        wait_idle(args.wait_idle)
        log(f"round {rnd + 1}/{args.runs}")
        for case, state in cases.items():
            if state.error:
                continue
            try:
                run = run_once(args, case, workdir, rnd, env)
            except RunError as ex:
                state.error = str(ex).splitlines()[0]
                state.failures.append(str(ex))
                log(f"  {case}: FAILED: {ex}")
                continue
            originals = {args.elrun_copy: args.elrun, args.train_copy: args.train}
            commands[case] = [originals.get(a, a).replace(workdir, "$TMPDIR") for a in run.pop("argv")]
            state.samples.append(run)
            log(f"  {case}: {run['step_ms']:.1f} ms/step, {run['samples_per_s']:.1f} samples/s, peak RSS "
                f"{max(run['peak_rss']) / 2**20:.0f} MiB (baseline {max(run['baseline_rss']) / 2**20:.0f})")
    return cases, commands, time.monotonic() - t0


def main():
    ap = runner.parser(BENCH, __doc__)
    ap.add_argument("--elrun", default=paths.binary("elrun"))
    ap.add_argument("--train", default=paths.binary("elrun-train"))
    ap.add_argument("--workload", choices=["gpt", "mlp"], default="gpt",
                    help="the GPT, or fsdp_bench's MLP (default %(default)s)")
    ap.add_argument("--mlp-hidden", type=lambda text: [int(w) for w in text.split(",")], default=[2048] * 32,
                    help="--workload mlp: comma-separated hidden widths (default 32 layers of 2048)")
    ap.add_argument("--layers", type=int, default=6, help="GPT blocks (default %(default)s)")
    ap.add_argument("--width", type=int, default=256, help="residual width (default %(default)s)")
    ap.add_argument("--heads", type=int, default=8, help="attention heads (default %(default)s)")
    ap.add_argument("--context", type=int, default=128, help="tokens per sequence (default %(default)s)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default %(default)s)")
    ap.add_argument("--max-steps", type=int, default=15, help="steps per run (default %(default)s)")
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the median (default %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="runs per case, interleaved (default %(default)s)")
    ap.add_argument("--compile", action="store_true", help="also the twin under torch.compile")
    runner.add_run_options(ap, timeout=900)
    args = runner.parse(ap, SMOKE)
    if args.workload == "mlp" and args.json == results.default_path(BENCH):  # Its own result and plot.
        args.json = results.default_path(BENCH + "_mlp")
        args.png = os.path.join(paths.BENCH, BENCH + "_mlp.png")
    if args.max_steps <= args.skip or args.runs < 1 or args.width % args.heads:
        ap.error("need --max-steps > --skip, --runs >= 1 and --heads dividing --width")
    for name, path in (("elrun", args.elrun), ("elrun-train", args.train)):
        if not os.access(path, os.X_OK):
            ap.error(f"{name} binary {path} not found: bazel build {paths.label(name)}")
    args.cases = CASES + (COMPILE_CASES if args.compile else [])
    args.elrun, args.train = os.path.abspath(args.elrun), os.path.abspath(args.train)
    args.tag = f"{BENCH}.{os.getpid()}.{time.time_ns()}"
    with runner.private_copies(args, BENCH, {"elrun": "elrun", "train": "elrun-train"}) as tmp:
        info = machine_info([("elrun", args.elrun), ("elrun-train", args.train)])
        load_start = loadavg()
        cases, commands, elapsed = bench(args, tmp)
    record = dict(results.stamp(BENCH), machine=dict(info), options=runner.options_record(args),
                  load=f"loadavg (1/5/15 min) {load_start} at start, {loadavg()} at end", elapsed_s=elapsed,
                  cases={c: {"runs": s.samples, "error": s.error, "failures": s.failures} for c, s in cases.items()},
                  commands=commands)
    results.publish(args, record, gpt_report)
    return 1 if any(s.error for s in cases.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
