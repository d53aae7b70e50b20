"""A memory cgroup (v1 or v2) of the benchmark's own, with a hard limit and no swap, for the
out-of-memory demonstration (fsdp_oom.py).
"""
import os
import signal
import time

from tests.support.procs import log

CGROUP_PREFIX = "elrun-fsdp-bench"
CGROUP_V1 = "/sys/fs/cgroup/memory"


def read_text(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def keyed_value(text, key):
    """N of a `key N` line (memory.oom_control, memory.events), or None."""
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            try:
                return int(parts[1])
            except ValueError:
                return None
    return None


def int_file(path):
    text = read_text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def cgroup2_mounts():
    """Mount points of cgroup2 file systems, /sys/fs/cgroup first."""
    found = []
    for line in (read_text("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if right.split()[:1] == ["cgroup2"] and len(fields) > 4:
            found.append(fields[4].replace("\\040", " "))
    return sorted(set(found), key=lambda m: (m != "/sys/fs/cgroup", m))


class MemoryCgroup:
    """A memory cgroup of this benchmark's own (v1 or v2) with a hard limit and no swap; every
    process started with its preexec_fn, and their children, run in it."""

    def __init__(self, version, path):
        self.version, self.path = version, path

    def file(self, name):
        return os.path.join(self.path, name)

    @classmethod
    def create(cls, name, limit_bytes):
        """(MemoryCgroup, None), or (None, why no memory cgroup can be made here)."""
        reasons = []
        if os.path.isfile(os.path.join(CGROUP_V1, "memory.limit_in_bytes")):
            if os.access(CGROUP_V1, os.W_OK):
                cg = cls("v1", os.path.join(CGROUP_V1, name))
                try:
                    os.mkdir(cg.path)
                    write_text(cg.file("memory.limit_in_bytes"), str(limit_bytes))
                    # Also memory + swap, so that swap cannot hide the limit.
                    if os.path.exists(cg.file("memory.memsw.limit_in_bytes")):
                        write_text(cg.file("memory.memsw.limit_in_bytes"), str(limit_bytes))
                    return cg, None
                except OSError as ex:
                    cg.remove()
                    reasons.append(f"cgroup v1 at {CGROUP_V1}: {ex.strerror or ex}")
            else:
                reasons.append(f"cgroup v1 at {CGROUP_V1} is not writable")
        else:
            reasons.append(f"no cgroup v1 memory hierarchy at {CGROUP_V1}")
        mounts = cgroup2_mounts()
        if not mounts:
            reasons.append("no cgroup2 mount")
        for mount in mounts:
            controllers = (read_text(os.path.join(mount, "cgroup.controllers")) or "").split()
            if "memory" not in controllers:
                reasons.append(f"cgroup v2 at {mount} lacks the memory controller")
                continue
            cg = cls("v2", os.path.join(mount, name))
            try:
                subtree = os.path.join(mount, "cgroup.subtree_control")
                if "memory" not in (read_text(subtree) or "").split():
                    write_text(subtree, "+memory")
                os.mkdir(cg.path)
                write_text(cg.file("memory.max"), str(limit_bytes))
                if os.path.exists(cg.file("memory.swap.max")):
                    write_text(cg.file("memory.swap.max"), "0")
                return cg, None
            except OSError as ex:
                cg.remove()
                reasons.append(f"cgroup v2 at {mount}: {ex.strerror or ex}")
        return None, "; ".join(reasons)

    def join(self):
        """preexec_fn: moves the starting process (before it runs anything) into the cgroup."""
        fd = os.open(self.file("cgroup.procs"), os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def pids(self):
        text = read_text(self.file("cgroup.procs")) or ""
        return [int(p) for p in text.split() if p.isdigit()]

    def stats(self):
        """OOM kills (None when the kernel does not count them), limit hits, max usage bytes."""
        if self.version == "v1":
            return {"oom_kills": keyed_value(read_text(self.file("memory.oom_control")),
                                             "oom_kill"),
                    "failcnt": int_file(self.file("memory.failcnt")),
                    "max_usage": int_file(self.file("memory.max_usage_in_bytes"))}
        events = read_text(self.file("memory.events"))
        return {"oom_kills": keyed_value(events, "oom_kill"),
                "failcnt": keyed_value(events, "max"),
                "max_usage": int_file(self.file("memory.peak"))}

    def remove(self):
        """Kills what is left in it (only this run's processes can be) and removes it; bounded."""
        for _ in range(50):
            if not os.path.isdir(self.path):
                return True
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                os.rmdir(self.path)
                return True
            except FileNotFoundError:
                return True
            except OSError:
                time.sleep(0.1)  # Bounded retry: killed processes take a moment to leave it.
        log(f"  warning: could not remove the cgroup {self.path}")
        return False
