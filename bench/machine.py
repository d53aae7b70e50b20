"""The machine a benchmark runs on: its description, binary ids, memory, and the CPU other
processes take while it measures.

Standard library only; Linux (/proc). machine_info() runs the torch environment's Python once to
read torch's version.
"""
import hashlib
import os
import platform
import subprocess
import time

from tests.support.paths import PYTHON
from tests.support.procs import log


def sh_out(argv):
    """stdout and stderr of argv, stripped; "" when it cannot run or takes over 10 s."""
    try:
        return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=10,
                              text=True).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def binary_id(path):
    """sha256 of a file, or "" when it cannot be read."""
    try:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    except OSError:
        return ""


def describe_binary(path):
    if os.access(path, os.X_OK):
        st = os.stat(path)
        return (f"{path} ({st.st_size} bytes, sha256 {binary_id(path)[:12]}, built "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st.st_mtime))})")
    return f"{path}: MISSING"


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        return ""


def machine_line():
    """One line naming the CPU and how many of its cores this process may use."""
    return (f"{cpu_model() or platform.machine()}, nproc {len(os.sched_getaffinity(0))} "
            f"(os.cpu_count {os.cpu_count()})")


def machine_info(binaries):
    """[(key, text)] describing the machine, the versions, and each (key, path) of binaries."""
    torch_meta = sh_out([PYTHON, "-c", "import torch; print(torch.__version__)"])
    return [
        ("machine", machine_line()),
        ("kernel", f"{platform.system()} {platform.release()}"),
        ("os", sh_out(["sh", "-c", ". /etc/os-release && echo \"$PRETTY_NAME\""]) or "?"),
        ("python", f"{PYTHON} {platform.python_version()}"),
        ("torch", f"torch {torch_meta or '?'} ({PYTHON}); torchrun through "
                  f"tests/support/torchrun_compat.py"),
        *[(key, describe_binary(path)) for key, path in binaries],
        ("date", time.strftime("%Y-%m-%d %H:%M:%S %Z")),
    ]


def mem_available_mib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


def peak_rss_mib(pid):
    """VmHWM of a live process in MiB, or NaN when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return float("nan")


# --- CPU load ---------------------------------------------------------------------------------

def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def pid_cpu_seconds(pid):
    """utime + stime of a live process (not its children), or 0.0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def cpu_snapshot(own_pids=()):
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its reaped children
    plus those of the live processes own_pids, monotonic time), to tell afterwards how much CPU
    other processes took during the benchmark."""
    busy = None
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal: all but idle and iowait.
        busy = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    own += sum(pid_cpu_seconds(p) for p in own_pids)
    return busy, own, time.monotonic()


def foreign_cpu_share(before, after):
    """Share of all CPUs used by processes other than this benchmark between two snapshots."""
    if before[0] is None or after[0] is None:
        return None
    foreign = (after[0] - before[0]) - (after[1] - before[1])
    capacity = (after[2] - before[2]) * len(os.sched_getaffinity(0))
    return max(foreign, 0.0) / max(capacity, 1e-9)


def wait_idle(limit_s):
    """Waits (at most limit_s) until other processes use under 10% of the CPUs over 1 s."""
    if limit_s <= 0:
        return
    t0 = time.monotonic()
    share = None
    while time.monotonic() - t0 < limit_s:
        before = cpu_snapshot()
        time.sleep(1.0)
        share = foreign_cpu_share(before, cpu_snapshot())
        if share is None or share < 0.10:
            break
    waited = time.monotonic() - t0
    if share is not None and share >= 0.10:
        log(f"  machine still busy after {waited:.0f} s ({100 * share:.0f}% CPU used by others); "
            f"going on")
    elif waited > 1.5:
        log(f"  waited {waited:.0f} s for the machine to become idle")


class ForeignCpu:
    """Adds up the CPU other processes use during the measured phases (not the idle waits).

    own_pids: a callable returning the pids of long-lived helpers this benchmark started and has
    not reaped yet (e.g. a daemon), whose CPU counts as the benchmark's own."""

    def __init__(self, own_pids=None):
        self.foreign = self.capacity = 0.0
        self.known = True
        self.own_pids = own_pids or (lambda: ())

    def phase(self, fn):
        pids = tuple(self.own_pids())
        before = cpu_snapshot(pids)
        try:
            return fn()
        finally:
            after = cpu_snapshot(pids)
            if before[0] is None or after[0] is None:
                self.known = False
            else:
                self.foreign += max((after[0] - before[0]) - (after[1] - before[1]), 0.0)
                self.capacity += (after[2] - before[2]) * len(os.sched_getaffinity(0))

    @property
    def share(self):
        return self.foreign / self.capacity if self.known and self.capacity > 0 else None


def runs_share(shares, walls):
    """The wall-weighted share of the CPUs other processes used over the runs ((share, wall s)
    pairs, `walls` their total wall time), or None, and its text for a result's "load"."""
    share = sum(a * w for a, w in shares) / walls if shares else None
    return share, ("CPU use of other processes unknown" if share is None else
                   f"other processes used {100 * share:.0f}% of the CPUs during the runs (wall-weighted; "
                   f"per run {min(100 * a for a, _ in shares):.0f}–{max(100 * a for a, _ in shares):.0f}%; "
                   f"machine CPU time minus this benchmark's and its children's)")


def load_text(share, load_start, own="this benchmark's and its children's", noisy="timings"):
    """A result's "load": the share of the CPUs other processes used while measuring (machine CPU
    time minus `own`), the loadavg at `load_start` and now, and a warning, logged too, above 10%."""
    load = (f"other processes used {100 * share:.0f}% of the CPUs while the runs were measured "
            f"(machine CPU time minus {own})" if share is not None else "CPU use of other processes unknown")
    load += f"; loadavg (1/5/15 min) {load_start} at start, {loadavg()} at end"
    if share is not None and share > 0.10:
        load += f" — **the machine was busy; {noisy} are noisy**"
        log(f"warning: other processes used {100 * share:.0f}% of the CPUs; {noisy} are noisy")
    return load
