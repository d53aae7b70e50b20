"""One launcher run, measured: its wall time (timed_run), the check that a fail-once command really
restarted (check_restart), and its peak RSS (rss_probe, run in a separate process by rss_run).
Part of launcher_bench.py.
"""
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bench.runner import RunError
from tests.support.paths import PYTHON, REPO
from tests.support.procs import clean_env
from tests.support.procs import kill_group as _kill_group
from tests.support.procs import tail as _tail

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
# Run in a separate process (launcher_bench.py with --rss-probe), which makes itself a child subreaper
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
    # The probe in a fresh interpreter (this module's __main__), run from the repository root.
    p = subprocess.run([PYTHON, "-m", "bench.launcher_runs", str(timeout)] + argv, cwd=REPO,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout + 30)
    if p.returncode != 0:
        raise RunError(f"rss probe failed: {p.stderr.decode(errors='replace')[-300:]!r}")
    r = json.loads(p.stdout)
    if r["error"]:
        raise RunError(r["error"])
    return r  # vmhwm_kib is None when the launcher exited before the first sample.


if __name__ == "__main__":  # The RSS probe that rss_run starts: launcher_runs TIMEOUT ARGV...
    rss_probe(sys.argv[2:], float(sys.argv[1]))
