#!/usr/bin/python3
"""Launcher benchmark: elrun against torchrun (torch 2.11, the .venv's) on this machine."""
import os
import subprocess
import sys
import time

from bench import launcher_report, results, runner
from bench.launcher_runs import check_restart, rss_run, timed_run
from bench.machine import (
    ForeignCpu,
    binary_id,
    load_text,
    loadavg,
    machine_info,
    wait_idle,
)
from bench.runner import RunError, with_retries
from tests.support import paths
from tests.support.paths import PYTHON, TORCHRUN_COMPAT
from tests.support.procs import clean_env, log

BENCH = "launcher_bench"
SMOKE = ["--runs", "1", "--slow-runs", "1", "--no-slow", "--warmup", "0"]

# Worker script of the restart benchmark: fails on attempt 0, succeeds on attempt 1 and later.
FAIL_ONCE = 'test "$TORCHELASTIC_RESTART_COUNT" != 0'
SUCCEED = "true"
# Same, but it also appends its attempt number to $LAUNCHER_BENCH_LOG: used once, untimed, to check
# that the launcher really restarted the workers (and set TORCHELASTIC_RESTART_COUNT).
FAIL_ONCE_LOGGED = 'echo "${TORCHELASTIC_RESTART_COUNT-unset}" >>"$LAUNCHER_BENCH_LOG"; ' + FAIL_ONCE


# --- the benchmark ---------------------------------------------------------------------------

class Case(runner.CaseState):
    """samples: ms for "time"; (vmhwm_kib, ru_maxrss_kib) for "rss"."""

    def __init__(self, key, launcher, argv, runs, timeout, kind="time", check=None, slow=False,
                 missing=None):
        super().__init__(missing)
        self.key, self.launcher, self.argv, self.runs, self.timeout = key, launcher, argv, runs, timeout
        self.kind, self.check, self.slow = kind, check, slow
        self.check_result = None


def build_cases(args):
    nproc = "2"
    elrun_missing = None if os.access(args.elrun, os.X_OK) else f"missing ({args.elrun} not found)"
    e = [args.elrun, "--standalone", "--nproc-per-node", nproc]
    t = [PYTHON, TORCHRUN_COMPAT, "--standalone", "--nproc_per_node", nproc]
    tt = t + ["--monitor_interval", "0.1"]
    n, s, to_e, to_t = args.runs, args.slow_runs, args.timeout, args.torchrun_timeout

    def e_restart(script):
        return e + ["--max-restarts", "1", "--no-python", "sh", "-c", script]

    def t_restart(base, script):
        return base + ["--max_restarts", "1", "--no_python", "sh", "-c", script]

    cases = [
        Case("floor", "harness floor: /bin/true directly", ["/bin/true"], n, to_e),
        Case("launch", "elrun", e + ["--no-python", "/bin/true"], n, to_e, missing=elrun_missing),
        Case("launch", "torchrun (--monitor_interval 5, default)", t + ["--no_python", "/bin/true"],
             s, to_t, slow=True),
        Case("launch", "torchrun --monitor_interval 0.1", tt + ["--no_python", "/bin/true"], n, to_t),
        Case("restart_fail", "elrun", e_restart(FAIL_ONCE), n, to_e, missing=elrun_missing,
             check=e_restart(FAIL_ONCE_LOGGED)),
        Case("restart_ok", "elrun", e_restart(SUCCEED), n, to_e, missing=elrun_missing),
        Case("restart_fail", "torchrun (--monitor_interval 5, default)", t_restart(t, FAIL_ONCE), s,
             to_t, slow=True),
        Case("restart_ok", "torchrun (--monitor_interval 5, default)", t_restart(t, SUCCEED), s,
             to_t, slow=True),
        Case("restart_fail", "torchrun --monitor_interval 0.1", t_restart(tt, FAIL_ONCE), n, to_t,
             check=t_restart(tt, FAIL_ONCE_LOGGED)),
        Case("restart_ok", "torchrun --monitor_interval 0.1", t_restart(tt, SUCCEED), n, to_t),
        Case("rss", "elrun", e + ["--no-python", "/bin/true"], n, to_e, kind="rss",
             missing=elrun_missing),
        Case("rss", "torchrun --monitor_interval 0.1", tt + ["--no_python", "/bin/true"], s, to_t,
             kind="rss"),
    ]
    if args.no_slow:
        cases = [c for c in cases if not c.slow]
    return cases


def warm_up(cases, args, env):
    # Warm-up (page cache, and a check of each command) for the fast cases. The slow torchrun cases
    # run the same Python imports as the tuned ones, so their caches are warm already.
    for c in cases:
        if c.slow or c.kind != "time":
            continue
        try:
            for _ in range(args.warmup):
                with_retries(c, args.retries, lambda: timed_run(c.argv, c.timeout, env))
            if c.check:
                seen = with_retries(c, args.retries,
                                    lambda: check_restart(c.check, c.timeout, env, nproc=2))
                c.check_result = seen
                log(f"  restart check passed: {c.launcher}: attempts {seen}")
        except (RunError, subprocess.TimeoutExpired) as ex:
            c.error = str(ex)


def one_run(c, env):
    """One measured run of c: ms for "time", (vmhwm_kib, ru_maxrss_kib) for "rss"."""
    if c.kind == "time":
        return timed_run(c.argv, c.timeout, env)
    r = rss_run(c.argv, c.timeout)
    return r["vmhwm_kib"], r["ru_maxrss_kib"]


def run_cases(cases, args):
    """Runs everything; returns the share of the CPUs other processes used while measuring."""
    env = clean_env()
    active = [c for c in cases if not c.missing]
    foreign = ForeignCpu()
    wait_idle(args.wait_idle)
    foreign.phase(lambda: warm_up(active, args, env))
    # Measured runs, round-robin over the cases so that slow drift affects all of them alike.
    runner.case_rounds(active, args.retries, lambda c: one_run(c, env), args.wait_idle, foreign)
    return foreign.share


def main():
    ap = runner.parser(BENCH, __doc__)
    ap.add_argument("--elrun", default=paths.binary("elrun"), help="elrun binary (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=7, help="measured runs per fast case (default 7)")
    ap.add_argument("--slow-runs", type=int, default=3,
                    help="measured runs for the torchrun default-interval cases (each ~7-12 s) and "
                         "the torchrun RSS case (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured runs per fast case (default 1)")
    ap.add_argument("--no-slow", action="store_true",
                    help="skip the torchrun default-interval (--monitor_interval 5) cases")
    runner.add_run_options(ap, timeout=30, torchrun_timeout=60, retries=2)
    args = runner.parse(ap, SMOKE)
    runner.require_in_smoke(ap, args, args.elrun)
    if args.runs < 1 or args.slow_runs < 1 or args.warmup < 0 or args.retries < 0:
        ap.error("--runs and --slow-runs must be >= 1, --warmup and --retries >= 0")

    # Launchers make a log directory per run under $TMPDIR (torchrun: torchelastic_*): give them a
    # private one and remove it at the end.
    with runner.private_copies(args, BENCH, {}):
        return bench(args)


def bench(args):
    t0 = time.monotonic()
    load_start = loadavg()
    elrun_before = binary_id(args.elrun)
    cases = build_cases(args)
    for c in cases:
        if c.missing:
            log(f"{c.key} / {c.launcher}: {c.missing}")
    info = machine_info([("elrun", args.elrun)])
    share = run_cases(cases, args)
    load = load_text(share, load_start)
    if binary_id(args.elrun) != elrun_before:
        load += " — **the elrun binary changed during the run (rebuilt?); the elrun rows mix builds**"
        log("warning: the elrun binary changed during the run; the elrun rows mix builds")
    record = dict(results.stamp(BENCH), machine=dict(info), options=runner.options_record(args),
                  load=load, elapsed_s=time.monotonic() - t0,
                  cases=[{"key": c.key, "launcher": c.launcher, "argv": c.argv, "samples": c.samples,
                          "failures": c.failures, "status": c.status, "missing": c.missing,
                          "slow": c.slow, "check_result": c.check_result} for c in cases])
    results.publish(args, record, launcher_report)
    return 1 if any(c.error for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
