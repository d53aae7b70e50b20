"""Helpers shared by every benchmark in this directory.

Python stdlib (matplotlib only where a plot is written). Paths, the clean environment for
launchers, process-group kills, retries, machine load accounting (CPU used by other processes),
machine description, the options every benchmark has, private copies of the binaries, the plot
epilogue and small formatting helpers.
"""
import contextlib
import hashlib
import os
import platform
import signal
import statistics
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TORCHRUN_COMPAT = os.path.join(HERE, "torchrun_compat.py")
# The torch 2.11 environment (scripts/setup.sh links it as .venv) runs torchrun, the Python twin
# and every worker; the benchmark scripts themselves run on Debian's python3 (matplotlib).
PYTHON = os.path.join(REPO, ".venv", "bin", "python3")


class RunError(Exception):
    pass


def clean_env(extra_drop=("LAUNCHER_BENCH_LOG",)):
    """The caller's environment without anything that would steer a launcher or its workers."""
    drop_prefixes = ("PET_", "TORCHELASTIC_")
    drop = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", *extra_drop}
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(drop_prefixes)}


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def tail(f, n=200):
    """The last non-empty line of a captured stderr (a binary file object), at most n characters."""
    f.seek(0)
    lines = [l.strip() for l in f.read().decode(errors="replace").splitlines() if l.strip()]
    text = lines[-1] if lines else ""
    return ("..." + text[-n:]) if len(text) > n else text


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def with_retries(c, retries, fn, errors=(RunError, subprocess.TimeoutExpired)):
    """fn() with up to `retries` more tries; failed tries are recorded in c.failures.

    c needs .key, .launcher and a list .failures."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except errors as ex:
            c.failures.append(str(ex))
            log(f"  {c.key} / {c.launcher}: run failed ({ex})"
                + ("; retrying" if attempt < retries else "; giving up on this case"))
            if attempt == retries:
                raise


# --- machine load ----------------------------------------------------------------------------

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


# --- machine description ---------------------------------------------------------------------

def sh_out(argv):
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


def machine_info(binaries):
    """[(key, text)] describing the machine, the versions, and each (key, path) of binaries."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    torch_meta = sh_out([PYTHON, "-c", "import torch; print(torch.__version__)"])
    return [
        ("machine", f"{cpu or platform.machine()}, nproc {len(os.sched_getaffinity(0))} "
                    f"(os.cpu_count {os.cpu_count()})"),
        ("kernel", f"{platform.system()} {platform.release()}"),
        ("os", sh_out(["sh", "-c", ". /etc/os-release && echo \"$PRETTY_NAME\""]) or "?"),
        ("python", f"{PYTHON} {platform.python_version()}"),
        ("torch", f"torch {torch_meta or '?'} ({PYTHON}); torchrun through scripts/bench/torchrun_compat.py"),
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


# --- formatting ------------------------------------------------------------------------------

def fmt(x, digits=1):
    return f"{x:.{digits}f}"


def stats(xs):
    return statistics.median(xs), min(xs), max(xs)


def verdict(value, target):
    return "yes" if value <= target else "NO"


def tagged_pids(tag_var, prefix):
    """Live (not zombie) processes whose environment has tag_var=<prefix>..."""
    needle = f"\0{tag_var}={prefix}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = b"\0" + f.read()
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if needle in env and state != "Z":
            out.append(int(name))
    return out


def kill_tagged(tag_var, prefix):
    """SIGKILLs every live process carrying the tag (only the calling benchmark's); returns how
    many there were."""
    seen = set()
    for _ in range(50):
        pids = tagged_pids(tag_var, prefix)
        if not pids:
            return len(seen)
        seen.update(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)  # Bounded: SIGKILLed processes take a moment to become zombies.
    log(f"  warning: processes tagged {prefix} survive SIGKILL: {tagged_pids(tag_var, prefix)}")
    return len(seen)


def stop_launcher(proc, tag_var, tag):
    """Kills a launcher started with start_new_session=True (its whole session), reaps it, then
    SIGKILLs whatever still carries the tag; returns how many tagged processes were left."""
    kill_group(proc.pid)
    proc.wait()
    return kill_tagged(tag_var, tag)


# --- options, binaries and plots shared by the benchmarks ------------------------------------

def add_output_options(ap, png_default, png_help="plot to write", json_help="also write the raw samples to this file"):
    """--png and --json."""
    ap.add_argument("--png", default=png_default, help=png_help + " (default: %(default)s)")
    ap.add_argument("--json", help=json_help)


def add_run_options(ap, timeout, torchrun_timeout=None, retries=None, wait_idle_help=None):
    """--timeout, and, when given defaults, --torchrun-timeout and --retries; --wait-idle."""
    ap.add_argument("--timeout", type=float, default=timeout,
                    help="seconds before one elrun run is killed (default %(default)s)")
    if torchrun_timeout is not None:
        ap.add_argument("--torchrun-timeout", type=float, default=torchrun_timeout,
                        help="seconds before one torchrun run is killed (default %(default)s)")
    if retries is not None:
        ap.add_argument("--retries", type=int, default=retries,
                        help="times a failed run is retried before its case is marked failed "
                             "(default %(default)s)")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help=wait_idle_help or "before the warm-ups and before each round, wait up to "
                    "SECONDS until other processes use < 10%% of the CPUs (default 0: do not wait)")


@contextlib.contextmanager
def private_copies(args, name, binaries):
    """A private TMPDIR, removed at the end (launchers make a log directory per run under it),
    holding copies of the binaries taken now, so that a rebuild during the benchmark cannot mix
    builds. `binaries`: {attribute: file name}; each copy's path goes to args.<attribute>_copy."""
    tmp = tempfile.mkdtemp(prefix=name + ".")
    os.environ["TMPDIR"] = tmp
    tempfile.tempdir = tmp
    try:
        os.makedirs(os.path.join(tmp, "bin"))
        for attribute, file_name in binaries.items():
            setattr(args, attribute + "_copy",
                    shutil.copy2(getattr(args, attribute), os.path.join(tmp, "bin", file_name)))
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path, dpi=110):
    """The plot epilogue: lay out, write `path`, free the figure."""
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


class CaseState:
    """What one benchmark case collects: its samples, the messages of failed runs that were
    retried, the error that failed it, or why it was not run (`missing`)."""

    def __init__(self, missing=None):
        self.missing = missing
        self.samples = []
        self.failures = []
        self.error = None

    @property
    def status(self):
        """None when the case ran; else the text its table row shows instead of figures."""
        if self.missing:
            return self.missing
        if self.error:
            return "FAILED: " + self.error
        return None
