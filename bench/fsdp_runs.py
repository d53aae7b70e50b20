"""The sharding benchmark's runs: one elrun + elrun-train job per strategy and round (run_once),
the rounds (bench), and the wait for a quiet machine. Part of fsdp_bench.py.

Every process a run starts carries FSDP_BENCH_TAG=<benchmark tag>:<run> in its environment, and
so do the workers: after each run (and on timeout or Ctrl-C) whatever still carries it is killed.
"""
import json
import os
import re
import select
import shlex
import statistics
import subprocess
import tempfile
import time

from bench.fsdp_model import MIB
from bench.machine import ForeignCpu, cpu_snapshot, foreign_cpu_share
from bench.runner import RunError
from tests.support.paths import REPO
from tests.support.procs import clean_env, log, stop_launcher

TAG_VAR = "FSDP_BENCH_TAG"
MEMORY_JSON = re.compile(r"memory-json (\{.*\})")
STEP_LINE = re.compile(r"^epoch (\d+)\s+step (\d+)\s")


def other_benchmarks():
    """Python processes (not this one) running a script from a bench directory: another
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
                and any((a.endswith(".py") and "bench/" in a) or a.startswith("bench.") for a in argv[1:3])):
            found.append(f"{name} {' '.join(argv)[:120]}")
    return found


def wait_quiet(limit_s, quiet_s):
    """Waits (at most limit_s) until, for quiet_s seconds in a row, other processes used under
    10% of the CPUs in every second and no other benchmark script ran. bench.machine.wait_idle's
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
                stop_launcher(p, TAG_VAR, tag)
                raise RunError(f"timed out after {args.timeout:g} s")
            except BaseException:  # Ctrl-C: the launcher is in its own session; stop it here.
                stop_launcher(p, TAG_VAR, tag)
                raise
            finally:
                p.stdout.close()
            wall = time.monotonic() - t0
            left = stop_launcher(p, TAG_VAR, tag)  # Stragglers (there should be none).
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
