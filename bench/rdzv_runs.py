"""The rendezvous benchmark's runs: N agents started and waited for (formation_run), and 4 agents
of which one is killed while the survivors' new round is timed (recovery_run); the elrun-rdzv
daemon they share (Daemon). Part of rdzv_bench.py.

Every process a run starts carries RDZV_BENCH_TAG=<benchmark tag>:<run tag> in its environment,
and so do the workers and anything they leave behind (a torchrun worker whose agent was killed is
re-parented to init): cleanup kills whatever carries the tag.
"""
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

from bench.runner import RunError
from tests.support.procs import is_running, kill_group, kill_tagged, log, tail

TAG_VAR = "RDZV_BENCH_TAG"
FIFO_VAR = "RDZV_BENCH_FIFO"
# Recovery worker: one line on the FIFO (one write, under PIPE_BUF: atomic), then sleep in the same
# process, so that the pid on the line is the worker's. The shell's pid is written ${$}, not $$:
# torchrun passes the worker's arguments through string.Template, which turns $$ into $.
WORKER = ('echo "running ${GROUP_WORLD_SIZE-?} ${GROUP_RANK-?} ${TORCHELASTIC_RESTART_COUNT-?} '
          '${$} $PPID" >>"$' + FIFO_VAR + '"; exec sleep 1000')


class Procs:
    """The agents of one run, each in its own session, and everything carrying the run's tag."""

    def __init__(self, tag):
        self.tag = tag
        self.popens = []
        self.errs = []
        self.killed = False
        self.lock = threading.Lock()

    def start(self, argv, env):
        err = tempfile.TemporaryFile()
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                             env=env, start_new_session=True)
        with self.lock:
            self.popens.append(p)
            self.errs.append(err)
            if self.killed:  # The watchdog fired while we were starting it.
                kill_group(p.pid)
        return p

    def kill_all(self):
        with self.lock:
            self.killed = True
            popens = list(self.popens)
        for p in popens:
            kill_group(p.pid)
        kill_tagged(TAG_VAR, self.tag)

    def close(self):
        """Kills and reaps everything; closes the captured stderr files."""
        self.kill_all()
        for p in self.popens:
            p.wait()
        for e in self.errs:
            e.close()

    def tail_of(self, i):
        return tail(self.errs[i])


def watchdog(timeout, procs):
    timed_out = threading.Event()

    def fire():
        timed_out.set()
        procs.kill_all()

    t = threading.Timer(timeout, fire)
    t.daemon = True
    t.start()
    return t, timed_out


def free_port():
    """A port that was free on 127.0.0.1 a moment ago (bound to port 0, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listener_pid(port, pids):
    """The pid among pids that holds the listening TCP socket of port, or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[1].rsplit(":", 1)[1] == f"{port:04X}" and fields[3] == "0A":
                        inodes.add(f"socket:[{fields[9]}]")
        except (OSError, StopIteration, IndexError):
            pass
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        return pid
                except OSError:
                    pass
        except OSError:
            pass
    return None


class Daemon:
    """elrun-rdzv, started once before any timing and stopped at the end."""

    def __init__(self, binary, env, tag, tmp):
        self.binary, self.env, self.tag, self.tmp = binary, env, tag, tmp
        self.p = None
        self.port = None
        self.err = None
        self.starts = 0

    def ensure(self):
        if self.p is not None and self.p.poll() is None:
            return self.port
        if self.p is not None:
            log(f"  elrun-rdzv exited with status {self.p.returncode} "
                f"({tail(self.err)!r}); starting it again")
            self.stop()
        port_file = os.path.join(self.tmp, f"rdzv_port.{self.starts}")
        self.starts += 1
        self.err = tempfile.TemporaryFile()
        self.argv = [self.binary, "--listen", "127.0.0.1:0", "--port-file", port_file]
        self.p = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=self.err, env=dict(self.env, **{TAG_VAR: self.tag}),
                                  start_new_session=True)
        deadline = time.monotonic() + 15
        while not os.path.exists(port_file):  # Untimed setup: a short poll is fine here.
            if self.p.poll() is not None or time.monotonic() > deadline:
                msg = f"elrun-rdzv did not start: {tail(self.err)!r}"
                self.stop()
                raise RunError(msg)
            time.sleep(0.01)
        with open(port_file) as f:
            self.port = int(f.read().strip())
        return self.port

    def pids(self):
        return [self.p.pid] if self.p is not None and self.p.poll() is None else []

    def stop(self):
        if self.p is None:
            return
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                kill_group(self.p.pid)
                self.p.kill()
                self.p.wait()
        kill_group(self.p.pid)
        self.err.close()
        self.p = None


# --- the two measurements --------------------------------------------------------------------

def formation_run(argvs, timeout, env, tag):
    """Seconds from starting every argv at once to all of them exited; each must exit 0."""
    procs = Procs(tag)
    env = dict(env, **{TAG_VAR: tag})
    timer, timed_out = watchdog(timeout, procs)
    try:
        t0 = time.perf_counter()
        for argv in argvs:
            procs.start(argv, env)
        # Blocking waits, in order: the last one returns when the last agent has exited.
        rcs = [p.wait() for p in procs.popens]
        t1 = time.perf_counter()
        timer.cancel()
        if timed_out.is_set():
            raise RunError(f"timed out after {timeout:g} s ({sum(rc != 0 for rc in rcs)} of "
                           f"{len(rcs)} agents killed); agent 0's stderr ends: "
                           f"{procs.tail_of(0)!r}")
        bad = [i for i, rc in enumerate(rcs) if rc != 0]
        if bad:
            codes = sorted({rcs[i] for i in bad})
            raise RunError(f"{len(bad)} of {len(rcs)} agents failed (exit status {codes}); agent "
                           f"{bad[0]}'s stderr ends: {procs.tail_of(bad[0])!r}")
        return t1 - t0
    finally:
        timer.cancel()
        procs.close()


class FifoReader:
    """Reads worker lines from a FIFO in a thread, stamping each with perf_counter on arrival."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_RDWR)  # Also a writer: never sees EOF between workers.
        self.stop_r, self.stop_w = os.pipe()
        self.lines = []  # (perf_counter, [fields])
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        buf = b""
        while True:
            ready, _, _ = select.select([self.fd, self.stop_r], [], [])
            t = time.perf_counter()
            if self.stop_r in ready:
                return
            buf += os.read(self.fd, 65536)
            *complete, buf = buf.split(b"\n")
            with self.cond:
                self.lines += [(t, l.decode(errors="replace").split()) for l in complete if l]
                self.cond.notify_all()

    def wait_for(self, pred, deadline):
        """pred(lines) until it returns something other than None, or None at the deadline."""
        with self.cond:
            while True:
                r = pred(self.lines)
                if r is not None:
                    return r
                left = deadline - time.perf_counter()
                if left <= 0:
                    return None
                self.cond.wait(left)

    def close(self):
        os.write(self.stop_w, b"x")
        self.thread.join()
        for fd in (self.fd, self.stop_r, self.stop_w):
            os.close(fd)


def parse_worker(fields):
    """{'ws', 'rank', 'rc', 'pid', 'ppid'} of a FIFO line, or None."""
    if len(fields) != 6 or fields[0] != "running":
        return None
    try:
        return {"ws": fields[1], "rank": fields[2], "rc": fields[3], "pid": int(fields[4]),
                "ppid": int(fields[5])}
    except ValueError:
        return None


def recovery_run(argv_for, endpoint_port, start_timeout, cap, settle, env, tag, tmp, nodes=4):
    """Starts `nodes` agents, kills one that does not host the coordinator once all workers run,
    and measures until the survivors' new workers run. Returns a dict (times in seconds)."""
    fifo_dir = tempfile.mkdtemp(prefix="fifo.", dir=tmp)
    fifo = os.path.join(fifo_dir, "workers")
    os.mkfifo(fifo)
    reader = FifoReader(fifo)
    procs = Procs(tag)
    env = dict(env, **{TAG_VAR: tag, FIFO_VAR: fifo})
    timer, timed_out = watchdog(start_timeout + settle + cap + 30, procs)
    try:
        agents = [procs.start(argv_for(i), env) for i in range(nodes)]
        agent_pids = {p.pid: i for i, p in enumerate(agents)}
        t_start = time.perf_counter()

        def first_round(lines):
            by_agent = {}
            for _, f in lines:
                w = parse_worker(f)
                if w is None:
                    return f  # Not a worker line: fail at once.
                if w["ppid"] in agent_pids:
                    by_agent.setdefault(w["ppid"], w)
            return by_agent if len(by_agent) == nodes else None

        round1 = reader.wait_for(first_round, t_start + start_timeout)
        if isinstance(round1, list):
            raise RunError(f"a worker wrote {' '.join(round1)!r}, expected 'running WORLD_SIZE "
                           f"RANK RESTART_COUNT PID PPID'")
        if round1 is None or timed_out.is_set():
            dead = [i for i, p in enumerate(agents) if p.poll() is not None]
            raise RunError(
                f"the {nodes} workers of the first round did not all start within "
                f"{start_timeout:g} s (worker lines seen: {[' '.join(f) for _, f in reader.lines]}"
                f"; agents exited: "
                + (", ".join(f"{i} (status {agents[i].returncode}, stderr ends "
                             f"{procs.tail_of(i)!r})" for i in dead) or "none") + ")")
        t_formed = time.perf_counter() - t_start
        if any(w["ws"] != str(nodes) for w in round1.values()):
            raise RunError(f"first round world sizes {[w['ws'] for w in round1.values()]}, expected "
                           f"{nodes}")
        time.sleep(settle)
        host = listener_pid(endpoint_port, agent_pids) if endpoint_port else None
        candidates = [pid for pid in agent_pids if pid != host]
        victim = max(candidates, key=lambda pid: int(round1[pid]["rank"])
                     if round1[pid]["rank"].isdigit() else -1)
        survivors = set(agent_pids) - {victim}
        old_pids = {w["pid"] for w in round1.values()}

        def new_round(lines):
            new = {}
            for t, f in lines:
                w = parse_worker(f)
                if w and w["ppid"] in survivors and w["pid"] not in old_pids:
                    new.setdefault(w["ppid"], (t, w))
            return new if len(new) == len(survivors) else None

        t_kill = time.perf_counter()
        os.kill(victim, signal.SIGKILL)
        found = reader.wait_for(new_round, t_kill + cap)
        t_end = time.perf_counter()
        partial = {}
        for t, f in reader.lines:
            w = parse_worker(f)
            if w and w["ppid"] in survivors and w["pid"] not in old_pids:
                partial.setdefault(w["ppid"], (t, w))
        result = {
            "formed_s": t_formed,
            "host_agent": agent_pids.get(host),
            "victim_agent": agent_pids[victim],
            "victim_rank": round1[victim]["rank"],
            "recovered_s": (max(t for t, _ in found.values()) - t_kill) if found else None,
            "first_new_s": (min(t for t, _ in partial.values()) - t_kill) if partial else None,
            "new_workers": len(partial),
            "new_world_sizes": sorted(w["ws"] for _, w in partial.values()),
            "new_restart_counts": sorted(w["rc"] for _, w in partial.values()),
            "old_survivor_workers_alive": sum(is_running(round1[p]["pid"]) for p in survivors),
            "victim_worker_alive": is_running(round1[victim]["pid"]),
            "survivor_agents_alive": sum(agents[agent_pids[p]].poll() is None for p in survivors),
            "waited_s": t_end - t_kill,
        }
        if timed_out.is_set():
            raise RunError("the run's watchdog fired")
        return result
    finally:
        timer.cancel()
        procs.close()
        reader.close()
        shutil.rmtree(fifo_dir, ignore_errors=True)
