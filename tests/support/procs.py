"""Processes: /proc reads, pidfd waits, process-group and tagged kills, a launcher-clean environment.

Standard library only; Linux (/proc, pidfd_open). Shared by the integration tests (harness.py,
etcd_cluster.py) and the benchmarks. Nothing here signals a bare pid learned earlier without a
check: tagged kills match the caller's own tag in the process's environment, and pidfds pin the
process they were opened for.
"""
import os
import select
import signal
import subprocess
import sys
import time

DEATH_TIMEOUT_S = 10.0  # Processes to die after a kill.


def log(msg):
    """One progress line on stderr, flushed."""
    print(msg, file=sys.stderr, flush=True)


# --- /proc ------------------------------------------------------------------------------------

def proc_stat(pid):
    """(state, ppid, pgid, starttime) of a live or zombie process, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = data[data.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return "<gone>"


def is_running(pid):
    """True when pid exists and is not a zombie."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def descendants(root):
    """{pid: starttime} of every process below root (any depth), found by scanning /proc."""
    children = {}
    starts = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = proc_stat(int(name))
        if stat is None:
            continue
        children.setdefault(stat[1], []).append(int(name))
        starts[int(name)] = stat[3]
    found = {}
    frontier = [root]
    for _ in range(100000):  # Bounded walk; the tree is finite and acyclic.
        if not frontier:
            break
        pid = frontier.pop()
        for child in children.get(pid, []):
            if child not in found:
                found[child] = starts[child]
                frontier.append(child)
    return found


def describe(pids):
    return ", ".join("%d (%s)" % (p, cmdline(p)) for p in sorted(pids)) or "none"


# --- pidfds -----------------------------------------------------------------------------------

class Pidfds:
    """pidfds opened at once for pids just learned from a worker, so later waits and kills refer to
    exactly those processes. A pid that is already gone counts as dead."""

    def __init__(self, pids):
        self.fds = {}
        for pid in pids:
            try:
                self.fds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                pass

    def wait_all_dead(self, timeout):
        """Waits until every process has exited (zombies count as exited). Returns the pids still
        running after timeout seconds."""
        pending = dict(self.fds)
        deadline = time.monotonic() + timeout
        for _ in range(len(pending) + 1):  # Each round retires at least one fd, or times out.
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0:
                break
            ready, _, _ = select.select(list(pending.values()), [], [], remaining)
            for pid in [p for p, fd in pending.items() if fd in ready]:
                del pending[pid]
        return sorted(pending)

    def kill_all(self):
        for fd in self.fds.values():
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self):
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def wait_dead(pids, timeout=DEATH_TIMEOUT_S):
    """Returns the pids among `pids` still running after timeout seconds."""
    fds = Pidfds(pids)
    try:
        return fds.wait_all_dead(timeout)
    finally:
        fds.close()


def kill_and_reap(proc, timeout=DEATH_TIMEOUT_S):
    """SIGKILLs a subprocess.Popen that is still running and reaps it, waiting timeout seconds at
    most (a process stuck in the kernel is left to the caller's leak checks)."""
    if proc.poll() is not None:
        return
    proc.kill()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


# --- launchers: environment, process groups, tags ---------------------------------------------

def clean_env(extra_drop=("LAUNCHER_BENCH_LOG",)):
    """The caller's environment without anything that would steer a launcher or its workers."""
    drop_prefixes = ("PET_", "TORCHELASTIC_")
    drop = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", *extra_drop}
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(drop_prefixes)}


def kill_group(pgid):
    """SIGKILLs a process group this caller created (a session started with
    start_new_session=True whose leader it has not reaped); a gone group is not an error."""
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
