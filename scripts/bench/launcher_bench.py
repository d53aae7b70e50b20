#!/usr/bin/python3
"""Launcher benchmark: elrun against Debian's torchrun (torch 1.13.1) on this machine.

Measures, for each launcher (see README.md next to this file):
  1. launch: wall time of `--standalone --nproc-per-node 2 --no-python /bin/true`, start to exit;
  2. restart: the wall time ADDED by one failure + restart: median wall of a run whose workers fail
     on attempt 0 and succeed on attempt 1 (`--max-restarts 1 ... sh -c 'test
     "$TORCHELASTIC_RESTART_COUNT" != 0'`), minus the median wall of the same command line whose
     workers succeed at once (`sh -c true`);
  3. peak RSS of the launcher: VmHWM of the launcher process itself, sampled from /proc/PID/status
     until it exits, and wait4's ru_maxrss (launcher plus its reaped descendants).

Prints a markdown report (machine, versions, table of medians with min/max, exact commands) on
stdout, progress on stderr, and writes a PNG bar chart. Python stdlib + matplotlib only.

  /usr/bin/python3 scripts/bench/launcher_bench.py [--runs 7] [--slow-runs 3] [--png PATH]
"""
import argparse
import ctypes
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import bench_common
from bench_common import (HERE, PYTHON, REPO, TORCHRUN_COMPAT, ForeignCpu, RunError, binary_id,
                          clean_env, fmt, kill_group as _kill_group, log, loadavg, stats,
                          tail as _tail, verdict, wait_idle, with_retries)
from bench_common import machine_info as _machine_info

DEFAULT_ELRUN = os.path.join(REPO, "bazel-bin", "launcher", "elrun")
DEFAULT_PNG = os.path.join(HERE, "launcher_bench.png")

# Worker script of the restart benchmark: fails on attempt 0, succeeds on attempt 1 and later.
FAIL_ONCE = 'test "$TORCHELASTIC_RESTART_COUNT" != 0'
SUCCEED = "true"
# Same, but it also appends its attempt number to $LAUNCHER_BENCH_LOG: used once, untimed, to check
# that the launcher really restarted the workers (and set TORCHELASTIC_RESTART_COUNT).
FAIL_ONCE_LOGGED = 'echo "${TORCHELASTIC_RESTART_COUNT-unset}" >>"$LAUNCHER_BENCH_LOG"; ' + FAIL_ONCE

TARGET_LAUNCH_MS = 50.0
TARGET_RESTART_MS = 20.0
TARGET_RSS_MIB = 15.0

PR_SET_CHILD_SUBREAPER = 36


def timed_run(argv, timeout, env):
    """Wall milliseconds of one run, perf_counter around Popen start .. wait(); rc must be 0.

    The wait is a blocking waitpid and a timer thread enforces the timeout: Popen.wait(timeout)
    would poll with exponential back-off (0.5, 1, 2, ... ms sleeps), which rounds a 20 ms run up
    to ~32 ms."""
    timed_out = threading.Event()
    started = []  # The Popen, once there is one.

    def on_timeout():
        timed_out.set()
        if started:
            _kill_group(started[0].pid)
            started[0].kill()  # In case the launcher left its process group.

    # The timer thread starts before t0: starting a thread costs ~1 ms here.
    watchdog = threading.Timer(timeout, on_timeout)
    watchdog.daemon = True
    watchdog.start()
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                             env=env, start_new_session=True)
        started.append(p)
        try:
            rc = p.wait()
        except BaseException:  # Ctrl-C: the launcher is in its own session, so stop it here.
            _kill_group(p.pid)
            p.wait()
            raise
        finally:
            watchdog.cancel()
        t1 = time.perf_counter()
        if timed_out.is_set():
            raise RunError(f"timed out after {timeout:g} s; stderr ends: {_tail(err)!r}")
        _kill_group(p.pid)  # Stragglers the launcher left behind, if any (there should be none).
        if rc != 0:
            raise RunError(f"exit status {rc}; stderr ends: {_tail(err)!r}")
    return (t1 - t0) * 1000.0


def check_restart(argv_logged, timeout, env, nproc):
    """Runs the fail-once command with attempt logging; raises unless it really restarted.

    Attempt 1 must have run every worker once. Attempt 0 must have run at least one worker (the
    one whose failure caused the restart): the launcher may stop the others before their shell
    gets as far as the echo."""
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "attempts")
        e = dict(env, LAUNCHER_BENCH_LOG=log)
        timed_run(argv_logged, timeout, e)
        try:
            with open(log) as f:
                seen = sorted(f.read().split())
        except FileNotFoundError:
            seen = []
    ok = (seen.count("1") == nproc and 1 <= seen.count("0") <= nproc
          and len(seen) == seen.count("0") + seen.count("1"))
    if not ok:
        raise RunError(f"restart check: workers reported attempts {seen}; expected 1 to {nproc} "
                       f"times '0' and {nproc} times '1'")
    return seen


# --- peak RSS ---------------------------------------------------------------------------------
#
# Run in a separate process (this script with --rss-probe), which makes itself a child subreaper
# and starts the launcher through /bin/sh as `"$@" &`: the launcher is forked from the small shell,
# not from Python, so the memory of the forking Python process (which Linux carries into
# ru_maxrss across exec) is not counted. The shell exits at once, the launcher is re-parented to
# the probe, and the probe samples /proc/PID/status (VmHWM) every ~0.5 ms until wait4 reaps it.

def _read_status(pid):
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("Name", "VmHWM", "VmRSS"):
                    out[key] = value.strip()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return out


def _sample_until_exit(pid, sh_pid, deadline, timeout, result):
    """Samples VmHWM of pid into result until wait4 reaps it; returns its wait status."""
    while True:
        st = _read_status(pid)
        if st and "VmHWM" in st:
            kib = int(st["VmHWM"].split()[0])
            result["vmhwm_kib"] = max(result["vmhwm_kib"] or 0, kib)
            result["samples"] += 1
            result["name"] = st.get("Name")
        wpid, status, ru = os.wait4(pid, os.WNOHANG)
        if wpid == pid:
            result["ru_maxrss_kib"] = ru.ru_maxrss
            return status
        if time.monotonic() > deadline:
            _kill_group(sh_pid)
            os.kill(pid, signal.SIGKILL)
            os.wait4(pid, 0)
            result["error"] = f"timed out after {timeout:g} s"
            return status
        time.sleep(0.0005)


def rss_probe(argv, timeout):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    result = {"vmhwm_kib": None, "ru_maxrss_kib": None, "samples": 0, "name": None, "error": None}
    with tempfile.NamedTemporaryFile() as err:
        sh = subprocess.Popen(
            ["/bin/sh", "-c", 'f=$1; shift; "$@" </dev/null >/dev/null 2>"$f" & echo $!', "sh",
             err.name] + argv,
            stdout=subprocess.PIPE, env=clean_env(), start_new_session=True)
        pid = int(sh.stdout.readline())
        sh.stdout.close()
        sh.wait()  # Once the shell is reaped, the launcher has been re-parented to us.
        deadline = time.monotonic() + timeout
        try:
            status = _sample_until_exit(pid, sh.pid, deadline, timeout, result)
        except BaseException:  # Ctrl-C: the launcher is in the shell's session; stop it here.
            _kill_group(sh.pid)
            raise
        _kill_group(sh.pid)
        # Reap whatever else was re-parented to us (nothing, if the launcher cleans up).
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if result["error"] is None and os.waitstatus_to_exitcode(status) != 0:
            with open(err.name, "rb") as f:
                result["error"] = (f"exit status {os.waitstatus_to_exitcode(status)}; stderr ends: "
                                   f"{_tail(f)!r}")
    json.dump(result, sys.stdout)


def rss_run(argv, timeout):
    p = subprocess.run([PYTHON, os.path.abspath(__file__), "--rss-probe", "--timeout", str(timeout),
                        "--"] + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       timeout=timeout + 30)
    if p.returncode != 0:
        raise RunError(f"rss probe failed: {p.stderr.decode(errors='replace')[-300:]!r}")
    r = json.loads(p.stdout)
    if r["error"]:
        raise RunError(r["error"])
    return r  # vmhwm_kib is None when the launcher exited before the first sample.


# --- the benchmark ---------------------------------------------------------------------------

class Case(bench_common.CaseState):
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


def one_round(cases, args, env, i):
    for c in cases:
        if c.error or i >= c.runs:
            continue
        try:
            if c.kind == "time":
                c.samples.append(with_retries(
                    c, args.retries, lambda: timed_run(c.argv, c.timeout, env)))
            else:
                r = with_retries(c, args.retries, lambda: rss_run(c.argv, c.timeout))
                c.samples.append((r["vmhwm_kib"], r["ru_maxrss_kib"]))
        except (RunError, subprocess.TimeoutExpired) as ex:
            c.error = str(ex)


def run_cases(cases, args):
    """Runs everything; returns the share of the CPUs other processes used while measuring."""
    env = clean_env()
    active = [c for c in cases if not c.missing]
    foreign = ForeignCpu()
    wait_idle(args.wait_idle)
    foreign.phase(lambda: warm_up(active, args, env))
    # Measured runs, round-robin over the cases so that slow drift affects all of them alike.
    rounds = max((c.runs for c in active), default=0)
    for i in range(rounds):
        wait_idle(args.wait_idle)
        log(f"round {i + 1}/{rounds}")
        foreign.phase(lambda: one_round(active, args, env, i))
    return foreign.share


# --- report ----------------------------------------------------------------------------------

def machine_info(args):
    return _machine_info([("elrun", args.elrun)])


def find(cases, key, launcher):
    return next((c for c in cases if c.key == key and c.launcher == launcher), None)


LAUNCHERS = ["elrun", "torchrun (--monitor_interval 5, default)", "torchrun --monitor_interval 0.1"]


def summarize(cases):
    """{(metric, launcher): (median, min, max, runs, failed_runs) or a status string}"""
    out = {}

    def entry(c, xs):
        return c.status or (*stats(xs), len(xs), len(c.failures))

    for launcher in LAUNCHERS:
        c = find(cases, "launch", launcher)
        if c:
            out[("launch", launcher)] = entry(c, c.samples)
        f, ok = find(cases, "restart_fail", launcher), find(cases, "restart_ok", launcher)
        if f and ok:
            out[("restart_fail", launcher)] = entry(f, f.samples)
            out[("restart_ok", launcher)] = entry(ok, ok.samples)
            if f.status or ok.status:
                out[("restart", launcher)] = f.status or ok.status
            else:
                out[("restart", launcher)] = (statistics.median(f.samples)
                                              - statistics.median(ok.samples), None, None,
                                              min(len(f.samples), len(ok.samples)),
                                              len(f.failures) + len(ok.failures))
        r = find(cases, "rss", launcher)
        if r:
            if r.status:
                out[("vmhwm", launcher)] = out[("maxrss", launcher)] = r.status
            else:
                hwm = [a / 1024 for a, _ in r.samples if a is not None]
                out[("vmhwm", launcher)] = (entry(r, hwm) if hwm else
                                            "no sample: exited before the first /proc read")
                out[("maxrss", launcher)] = entry(r, [b / 1024 for _, b in r.samples])
    fl = find(cases, "floor", "harness floor: /bin/true directly")
    if fl:
        out[("floor", fl.launcher)] = entry(fl, fl.samples)
    return out


ROWS = [
    # metric, label, unit, target, digits
    ("launch", "1. launch 2 × /bin/true, wall", "ms", TARGET_LAUNCH_MS, 1),
    ("restart", "2. one failure + restart, ADDED wall (median fail-once − median ok)", "ms",
     TARGET_RESTART_MS, 1),
    ("restart_fail", "2a. wall, workers fail on attempt 0, succeed on attempt 1", "ms", None, 1),
    ("restart_ok", "2b. wall, workers succeed at once (same flags, `sh -c true`)", "ms", None, 1),
    ("vmhwm", "3. peak RSS of the launcher process (VmHWM) [a]", "MiB", TARGET_RSS_MIB, 2),
    ("maxrss", "3b. peak RSS, launcher + reaped descendants (wait4 ru_maxrss) [b]", "MiB",
     TARGET_RSS_MIB, 2),
]


def table(summary):
    lines = ["| Benchmark | Launcher | Median | Min | Max | Runs | Target | Meets |",
             "|---|---|---:|---:|---:|---:|---:|:---:|"]
    for metric, label, unit, target, digits in ROWS:
        for launcher in LAUNCHERS:
            v = summary.get((metric, launcher))
            if v is None:
                continue
            tgt = f"≤ {target:g} {unit}" if target is not None else ""
            if isinstance(v, str):
                lines.append(f"| {label} | {launcher} | {v.replace('|', '/')} | | | | {tgt} | |")
                continue
            med, lo, hi, n, nfail = v
            meets = verdict(med, target) if target is not None else ""
            n = f"{n} (+{nfail} failed)" if nfail else n
            lo_s = fmt(lo, digits) if lo is not None else "—"
            hi_s = fmt(hi, digits) if hi is not None else "—"
            lines.append(f"| {label} | {launcher} | {fmt(med, digits)} {unit} | {lo_s} | {hi_s} "
                         f"| {n} | {tgt} | {meets} |")
    fl = summary.get(("floor", "harness floor: /bin/true directly"))
    if fl is not None:
        if isinstance(fl, str):
            lines.append(f"| 0. harness floor: spawn /bin/true directly, wall | — | {fl} | | | | | |")
        else:
            med, lo, hi, n, _ = fl
            lines.append(f"| 0. harness floor: spawn /bin/true directly, wall | — | {fmt(med, 2)} ms "
                         f"| {fmt(lo, 2)} | {fmt(hi, 2)} | {n} | | |")
    return lines


def report(cases, summary, args, info, load, elapsed):
    out = ["## Launcher benchmark: elrun vs torchrun", ""]
    out += [f"- **{k}**: {v}" for k, v in info]
    out += [f"- **runs**: {args.runs} per case ({args.slow_runs} for the torchrun default-interval "
            f"cases and the torchrun RSS case), {args.warmup} unmeasured warm-up run(s) per fast "
            f"case, a failed run is retried up to {args.retries} times"
            + (f", waited up to {args.wait_idle:g} s for an idle machine before each round"
               if args.wait_idle > 0 else "") + "; benchmark took "
            f"{elapsed:.0f} s",
            f"- **load**: {load}", ""]
    out += table(summary)
    out += [
        "",
        "Times are wall-clock, `time.perf_counter()` around `subprocess.Popen(...)` .. a blocking "
        "`wait()` "
        "(stdout to /dev/null, stderr to a temp file, runs interleaved round-robin, TMPDIR set to a "
        "private directory for the launchers' log directories); row 0 is the cost of that harness "
        "alone. Row 2 is the difference of the medians of 2a and 2b, so it has "
        "no min/max. The fail-once commands were checked once, untimed, to really restart: each "
        "worker appended its TORCHELASTIC_RESTART_COUNT to a file before `test`; attempt 1 had to "
        "run both workers and attempt 0 at least one (the launcher may stop the other before it "
        "gets that far). Done for elrun and tuned torchrun; the default-interval torchrun rows run "
        "the same code. Attempts seen: "
        + "; ".join(f"{c.launcher}: {' '.join(c.check_result)}" for c in cases
                    if c.check_result) + ".",
        "",
        "[a] VmHWM from /proc/PID/status of the launcher process alone (for torchrun: the Python "
        "interpreter running torchrun), sampled about every 0.5 ms from start until it exits; the "
        "largest sample is reported, so a peak in the last < 1 ms before exit could be missed. The "
        "launcher is started as `sh -c '\"$@\" &'` by a probe process that is a child subreaper, "
        "so it is forked from a small shell, not from Python. Runs that ended before the first sample "
        "are left out of the Runs count.",
        "[b] `os.wait4()` ru_maxrss (KiB) of the same runs: the maximum over the launcher and the "
        "descendants it reaped. Linux also counts, for each of these processes, the image it had "
        "before exec: for the launcher the small /bin/sh it was forked from, for each worker its "
        "pre-exec copy of the launcher (never above the launcher's own peak). The workers are "
        "/bin/true (about 1 MiB), so [b] is in effect the launcher's exact peak whenever that is "
        "above ~2 MiB, while [a] is a sampled lower bound. RSS is measured on the launch command "
        "of row 1 (torchrun with --monitor_interval 0.1).",
        "",
    ]
    failed = [c for c in cases if c.failures]
    if failed:
        out += ["Failed runs (retried, not counted in the statistics):", ""]
        for c in failed:
            out += [f"- {c.key} / {c.launcher}: {m}" for m in c.failures]
        out += [""]
    out += [
        "Commands (run from the repository root; `test` fails on attempt 0 and passes after):",
        "",
        "```",
    ]
    seen = set()
    for c in cases:
        cmd = shlex.join(c.argv)
        if cmd in seen:
            continue
        seen.add(cmd)
        note = f"  # {c.key}: {c.launcher}"
        if c.missing:
            note += " (missing)"
        out.append(cmd.replace(REPO + "/", "") + note)
    out += ["```", ""]
    return "\n".join(out)


def plot(summary, path):
    plt = bench_common.pyplot()

    short = {"elrun": "elrun", "torchrun (--monitor_interval 5, default)": "torchrun\n(interval 5)",
             "torchrun --monitor_interval 0.1": "torchrun\n(interval 0.1)"}
    colors = {"elrun": "#2a7ab0", "torchrun (--monitor_interval 5, default)": "#c0504d",
              "torchrun --monitor_interval 0.1": "#e8a33d"}
    panels = [("launch", "1. launch 2 workers: wall (ms)", TARGET_LAUNCH_MS, "ms"),
              ("restart", "2. one failure + restart: added wall (ms)", TARGET_RESTART_MS, "ms"),
              ("vmhwm", "3. launcher peak RSS, VmHWM (MiB)", TARGET_RSS_MIB, "MiB")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.8))
    for ax, (metric, title, target, unit) in zip(axes, panels):
        bars = []  # (name, color, value or None, lo, hi, note)
        for launcher in LAUNCHERS:
            v = summary.get((metric, launcher))
            if v is None:
                continue
            if isinstance(v, str):
                bars.append((short[launcher], colors[launcher], None, None, None,
                             "missing" if v.startswith("missing") else "failed"))
            else:
                bars.append((short[launcher], colors[launcher], *v[:3], None))
        # Log scale (torchrun is 10-1000x elrun); bars start at the bottom of the axis, and values
        # at or below it (e.g. an added wall <= 0) are labelled with their real value.
        positive = [b[2] for b in bars if b[2] is not None and b[2] > 0]
        bottom = min(positive + [target]) / 5
        top = max([b[4] if b[4] is not None else (b[2] or 0) for b in bars] + [target]) * 4
        for i, (name, color, val, lo, hi, note) in enumerate(bars):
            if val is None:
                ax.text(i, bottom * 1.5, note, ha="center", va="bottom", fontsize=9, color="gray")
                continue
            h = max(val, bottom * 1.01)
            err = None
            if lo is not None:
                err = [[max(h - max(lo, bottom), 0)], [max(hi - h, 0)]]
            ax.bar(i, h - bottom, bottom=bottom, color=color, yerr=err, capsize=4)
            label = f"{val:.0f}" if abs(val) >= 100 else f"{val:.1f}"
            ax.text(i, (hi if hi is not None else h) * 1.15, f"{label} {unit}", ha="center",
                    va="bottom", fontsize=9)
        ax.axhline(target, color="green", linestyle="--", linewidth=1,
                   label=f"elrun target ≤ {target:g} {unit}")
        ax.set_yscale("log")
        ax.set_ylim(bottom, top)
        ax.set_xlim(-0.6, len(bars) - 0.4)
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels([b[0] for b in bars], fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("elrun vs torchrun 1.13 (medians; whiskers min/max)", fontsize=11)
    bench_common.save_figure(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elrun", default=DEFAULT_ELRUN, help="elrun binary (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=7, help="measured runs per fast case (default 7)")
    ap.add_argument("--slow-runs", type=int, default=3,
                    help="measured runs for the torchrun default-interval cases (each ~7-12 s) and "
                         "the torchrun RSS case (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured runs per fast case (default 1)")
    ap.add_argument("--no-slow", action="store_true",
                    help="skip the torchrun default-interval (--monitor_interval 5) cases")
    bench_common.add_output_options(ap, DEFAULT_PNG, png_help="bar chart to write")
    bench_common.add_run_options(ap, timeout=30, torchrun_timeout=60, retries=2)
    ap.add_argument("--rss-probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("probe_argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.rss_probe:
        argv = args.probe_argv[1:] if args.probe_argv[:1] == ["--"] else args.probe_argv
        rss_probe(argv, args.timeout)
        return 0
    if args.probe_argv:
        ap.error(f"unexpected arguments: {args.probe_argv}")
    if args.runs < 1 or args.slow_runs < 1 or args.warmup < 0 or args.retries < 0:
        ap.error("--runs and --slow-runs must be >= 1, --warmup and --retries >= 0")

    # Launchers make a log directory per run under $TMPDIR (torchrun: torchelastic_*): give them a
    # private one and remove it at the end.
    tmp = tempfile.mkdtemp(prefix="launcher_bench.")
    os.environ["TMPDIR"] = tmp
    tempfile.tempdir = tmp
    try:
        return bench(args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench(args):
    t0 = time.monotonic()
    load_start = loadavg()
    elrun_before = binary_id(args.elrun)
    cases = build_cases(args)
    for c in cases:
        if c.missing:
            log(f"{c.key} / {c.launcher}: {c.missing}")
    info = machine_info(args)
    share = run_cases(cases, args)
    summary = summarize(cases)
    load = (f"other processes used {100 * share:.0f}% of the CPUs while the runs were measured "
            f"(machine CPU time minus this benchmark's and its children's)" if share is not None else
            "CPU use of other processes unknown")
    load += f"; loadavg (1/5/15 min) {load_start} at start, {loadavg()} at end"
    if share is not None and share > 0.10:
        load += " — **the machine was busy; timings are noisy**"
        log(f"warning: other processes used {100 * share:.0f}% of the CPUs; timings are noisy")
    if binary_id(args.elrun) != elrun_before:
        load += " — **the elrun binary changed during the run (rebuilt?); the elrun rows mix builds**"
        log("warning: the elrun binary changed during the run; the elrun rows mix builds")
    print(report(cases, summary, args, info, load, time.monotonic() - t0), flush=True)
    if args.png:
        plot(summary, args.png)
        log(f"wrote {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": dict(info),
                       "cases": [{"key": c.key, "launcher": c.launcher, "argv": c.argv,
                                  "samples": c.samples, "failures": c.failures,
                                  "status": c.status} for c in cases]},
                      f, indent=1)
        log(f"wrote {args.json}")
    return 1 if any(c.error for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
