#!/usr/bin/python3
"""Rendezvous benchmark: elrun's gRPC rendezvous against torchrun's c10d rendezvous (torch 1.13.1).

Measures on this machine, all agents on 127.0.0.1 (see README.md next to this file):
  1. formation: wall time from starting N agents (each with one `--no-python /bin/true` worker)
     to all of them exited 0, for N in --sizes. elrun against a running `elrun-rdzv` daemon, and
     elrun with the coordinator embedded in the agent that binds the endpoint first; torchrun
     `--rdzv_backend c10d`, the first agent to bind hosting the TCPStore. Row 0 is the harness
     alone (N x /bin/true started and waited for the same way).
  2. recovery: 4 agents (`--nnodes 3:4`), one worker each that reports itself on a FIFO and
     sleeps; once all 4 run, `kill -9` one agent that does not host the coordinator, and time until
     the 3 survivors' NEW workers are running (capped at --recovery-cap seconds).

Prints a markdown report (machine, versions, table of medians with min/max, exact commands) on
stdout, progress on stderr, and writes a PNG plot. Python stdlib + matplotlib only.

  /usr/bin/python3 scripts/bench/rdzv_bench.py [--sizes 4,8,32,128] [--runs 5] [--png PATH]
"""
import argparse
import json
import os
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import bench_common
from bench_common import (HERE, PYTHON, REPO, TORCHRUN_COMPAT, ForeignCpu, RunError, binary_id,
                          clean_env, fmt, kill_group, log, loadavg, machine_info,
                          mem_available_mib, stats, tail, verdict, wait_idle, with_retries)

DEFAULT_ELRUN = os.path.join(REPO, "bazel-bin", "launcher", "elrun")
DEFAULT_RDZV = os.path.join(REPO, "bazel-bin", "agent", "daemon", "elrun-rdzv")
DEFAULT_PNG = os.path.join(HERE, "rdzv_bench.png")

# Every process this benchmark starts carries RDZV_BENCH_TAG=<benchmark tag>:<run tag> in its
# environment, and so do the workers and anything they leave behind (a torchrun worker whose agent
# was killed is re-parented to init): cleanup kills whatever carries the tag.
TAG_VAR = "RDZV_BENCH_TAG"
FIFO_VAR = "RDZV_BENCH_FIFO"
# Recovery worker: one line on the FIFO (one write, under PIPE_BUF: atomic), then sleep in the same
# process, so that the pid on the line is the worker's. The shell's pid is written ${$}, not $$:
# torchrun passes the worker's arguments through string.Template, which turns $$ into $.
WORKER = ('echo "running ${GROUP_WORLD_SIZE-?} ${GROUP_RANK-?} ${TORCHELASTIC_RESTART_COUNT-?} '
          '${$} $PPID" >>"$' + FIFO_VAR + '"; exec sleep 1000')

TORCHRUN_AGENT_MIB = 235  # RSS of one idle torchrun agent (python3 + torch) on this machine.
TORCHRUN_BUDGET_MIB = 250  # What the memory check reserves per torchrun agent.
TARGETS_S = {8: 0.3, 128: 3.0}  # formation, elrun
TARGET_RECOVERY_S = 1.0

ELRUN_DAEMON = "elrun (elrun-rdzv daemon)"
ELRUN_EMBEDDED = "elrun (coordinator embedded in an agent)"
TORCHRUN = "torchrun c10d (--monitor_interval 0.1)"
FLOOR = "harness floor: N x /bin/true"
LAUNCHERS = [ELRUN_DAEMON, ELRUN_EMBEDDED, TORCHRUN]


# --- processes -------------------------------------------------------------------------------

def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid):
    """True while pid exists and is not a zombie."""
    s = _state(pid)
    return s is not None and s != "Z"


def tagged_pids(prefix):
    """Live processes whose environment has TAG_VAR=<prefix>..."""
    needle = f"\0{TAG_VAR}={prefix}".encode()
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:
            continue
        if needle in env and alive(int(name)):
            out.append(int(name))
    return out


def kill_tagged(prefix):
    """SIGKILLs every live process carrying the tag, until none is left (they may be forking)."""
    for _ in range(50):
        pids = tagged_pids(prefix)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)
    log(f"  warning: processes tagged {prefix} survive SIGKILL: {tagged_pids(prefix)}")


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
        kill_tagged(self.tag)

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
            "old_survivor_workers_alive": sum(alive(round1[p]["pid"]) for p in survivors),
            "victim_worker_alive": alive(round1[victim]["pid"]),
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


# --- the benchmark ---------------------------------------------------------------------------

class Case(bench_common.CaseState):
    """samples: formation: seconds; recovery: result dicts."""

    def __init__(self, key, launcher, n, runs, timeout, run, cmd, missing=None, warm=False):
        super().__init__(missing)
        self.key, self.launcher, self.n, self.runs, self.timeout = key, launcher, n, runs, timeout
        self.run, self.cmd, self.warm = run, cmd, warm


class Bench:
    def __init__(self, args, tmp):
        self.args, self.tmp = args, tmp
        self.tag = uuid.uuid4().hex[:12]
        self.count = 0
        self.env = clean_env(("LAUNCHER_BENCH_LOG", "ELRUN_RDZV_TOKEN", TAG_VAR, FIFO_VAR,
                              "LOGLEVEL"))
        self.daemon = Daemon(args.rdzv, self.env, f"{self.tag}:daemon", tmp)

    def run_tag(self):
        self.count += 1
        return f"{self.tag}:{self.count}"

    def run_id(self, slug):
        return f"rdzvbench-{self.tag}-{slug}-{self.count}"

    # argv builders; port and run id are per run.
    def elrun_argv(self, nnodes, port, run_id, worker):
        return [self.args.elrun, "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--rdzv-id", run_id, "--no-python", *worker]

    def torchrun_argv(self, nnodes, port, run_id, worker):
        return [PYTHON, TORCHRUN_COMPAT, "--nnodes", nnodes, "--nproc_per_node", "1",
                "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id",
                run_id, "--monitor_interval", "0.1", "--no_python", *worker]

    def formation(self, launcher, n, timeout):
        tag = self.run_tag()
        if launcher == FLOOR:
            return formation_run([["/bin/true"]] * n, timeout, self.env, tag)
        if launcher == ELRUN_DAEMON:
            port, build, slug = self.daemon.ensure(), self.elrun_argv, "daemon"
        elif launcher == ELRUN_EMBEDDED:
            port, build, slug = free_port(), self.elrun_argv, "embedded"
        else:
            port, build, slug = free_port(), self.torchrun_argv, "torchrun"
        argv = build(str(n), port, self.run_id(f"{slug}{n}"), ["/bin/true"])
        return formation_run([argv] * n, timeout, self.env, tag)

    def recovery(self, launcher, timeout):
        tag = self.run_tag()
        worker = ["sh", "-c", WORKER]
        if launcher == ELRUN_DAEMON:
            port, build, slug, host_port = self.daemon.ensure(), self.elrun_argv, "rdaemon", None
        elif launcher == ELRUN_EMBEDDED:
            port, build, slug = free_port(), self.elrun_argv, "rembedded"
            host_port = port
        else:
            port, build, slug = free_port(), self.torchrun_argv, "rtorchrun"
            host_port = port
        argv = build("3:4", port, self.run_id(slug), worker)
        return recovery_run(lambda i: argv, host_port, timeout, self.args.recovery_cap,
                            self.args.settle, self.env, tag, self.tmp)

    def build_cases(self):
        a = self.args
        missing_e = None if os.access(a.elrun, os.X_OK) else f"missing ({a.elrun} not found)"
        missing_d = missing_e or (None if os.access(a.rdzv, os.X_OK)
                                  else f"missing ({a.rdzv} not found)")
        avail = mem_available_mib()
        rel = lambda p: p.replace(REPO + "/", "")  # noqa: E731
        e_cmd = lambda nn, ep, w: shlex.join(  # noqa: E731
            [rel(a.elrun), "--nnodes", nn, "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", ep,
             "--rdzv-id", "JOB_i", "--no-python", *w])
        t_cmd = lambda nn, w: shlex.join(  # noqa: E731
            [PYTHON, rel(TORCHRUN_COMPAT), "--nnodes", nn, "--nproc_per_node", "1",
             "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:PORT", "--rdzv_id", "JOB_i",
             "--monitor_interval", "0.1", "--no_python", *w])
        cases = []
        for n in a.sizes:
            cases.append(Case("formation", FLOOR, n, a.runs, a.timeout,
                              lambda c: self.formation(FLOOR, c.n, c.timeout),
                              f"/bin/true  # x {n}", warm=True))
            cases.append(Case("formation", ELRUN_DAEMON, n, a.runs, a.timeout,
                              lambda c: self.formation(ELRUN_DAEMON, c.n, c.timeout),
                              e_cmd(str(n), "127.0.0.1:DAEMON_PORT", ["/bin/true"]) + f"  # x {n}",
                              missing=missing_d, warm=True))
            if not a.no_embedded:
                cases.append(Case("formation", ELRUN_EMBEDDED, n, a.runs, a.timeout,
                                  lambda c: self.formation(ELRUN_EMBEDDED, c.n, c.timeout),
                                  e_cmd(str(n), "127.0.0.1:PORT", ["/bin/true"]) + f"  # x {n}",
                                  missing=missing_e, warm=True))
            need = n * TORCHRUN_BUDGET_MIB
            skip = None
            if n > a.torchrun_max_n or avail is None or need > avail / 2:
                why = [f"N > --torchrun-max-n {a.torchrun_max_n}"] if n > a.torchrun_max_n else []
                if avail is None:
                    why.append("MemAvailable unknown")
                elif need > avail / 2:
                    why.append(f"more than half of the {avail / 1024:.1f} GiB available")
                skip = (f"not run (memory: {n} x {TORCHRUN_AGENT_MIB} MiB = "
                        f"{n * TORCHRUN_AGENT_MIB / 1024:.1f} GiB; {', '.join(why)})")
            cases.append(Case("formation", TORCHRUN, n, a.torchrun_runs, a.torchrun_timeout,
                              lambda c: self.formation(TORCHRUN, c.n, c.timeout),
                              t_cmd(str(n), ["/bin/true"]) + f"  # x {n}", missing=skip,
                              warm=(n == min(a.sizes))))
        if not a.no_recovery:
            worker = ["sh", "-c", WORKER]
            cases.append(Case("recovery", ELRUN_DAEMON, 4, a.runs, a.timeout,
                              lambda c: self.recovery(ELRUN_DAEMON, c.timeout),
                              e_cmd("3:4", "127.0.0.1:DAEMON_PORT", worker) + "  # x 4",
                              missing=missing_d))
            if not a.no_embedded:
                cases.append(Case("recovery", ELRUN_EMBEDDED, 4, a.runs, a.timeout,
                                  lambda c: self.recovery(ELRUN_EMBEDDED, c.timeout),
                                  e_cmd("3:4", "127.0.0.1:PORT", worker) + "  # x 4",
                                  missing=missing_e))
            cases.append(Case("recovery", TORCHRUN, 4, a.torchrun_recovery_runs,
                              a.torchrun_timeout, lambda c: self.recovery(TORCHRUN, c.timeout),
                              t_cmd("3:4", worker) + "  # x 4"))
        return cases

    def attempt(self, c):
        return with_retries(c, self.args.retries, lambda: c.run(c))

    def run_cases(self, cases):
        active = [c for c in cases if not c.missing]
        foreign = ForeignCpu(own_pids=self.daemon.pids)
        wait_idle(self.args.wait_idle)
        if any(c.launcher == ELRUN_DAEMON for c in active):
            try:
                self.daemon.ensure()
            except RunError as ex:
                for c in active:
                    if c.launcher == ELRUN_DAEMON:
                        c.error = str(ex)

        def warm():
            for c in active:
                if c.warm and not c.error:
                    log(f"warm-up: {c.key} / {c.launcher} / N={c.n}")
                    for _ in range(self.args.warmup):
                        try:
                            self.attempt(c)
                        except (RunError, subprocess.TimeoutExpired) as ex:
                            c.error = str(ex)
                            break

        foreign.phase(warm)
        rounds = max((c.runs for c in active), default=0)
        for i in range(rounds):
            wait_idle(self.args.wait_idle)
            log(f"round {i + 1}/{rounds}")

            def one_round():
                for c in active:
                    if c.error or i >= c.runs:
                        continue
                    try:
                        r = self.attempt(c)
                    except (RunError, subprocess.TimeoutExpired) as ex:
                        c.error = str(ex)
                        continue
                    c.samples.append(r)
                    if c.key == "formation":
                        log(f"  {c.key} / {c.launcher} / N={c.n}: {r:.3f} s")
                    else:
                        log(f"  {c.key} / {c.launcher}: " + (
                            f"new round in {r['recovered_s']:.3f} s" if r["recovered_s"] is not None
                            else f"no new round within {self.args.recovery_cap:g} s"))

            foreign.phase(one_round)
        return foreign.share


# --- report ----------------------------------------------------------------------------------

def summarize(cases, cap):
    """{(key, launcher, n): (median, min, max, runs, failed) or a string, plus 'note' entries}"""
    out = {}
    for c in cases:
        k = (c.key, c.launcher, c.n)
        if c.status and not c.samples:
            out[k] = c.status
            continue
        if c.key == "formation":
            out[k] = (*stats(c.samples), len(c.samples), len(c.failures))
        else:
            ok = [r["recovered_s"] for r in c.samples if r["recovered_s"] is not None]
            n = len(c.samples)
            if ok:
                out[k] = (*stats(ok), len(ok), len(c.failures))
                if len(ok) < n:
                    out[("note",) + k] = (f"no new round within {cap:g} s in {n - len(ok)} of {n} "
                                          f"runs (left out of the statistics)")
            else:
                out[k] = f"no new round within {cap:g} s ({n} of {n} runs)"
        if c.status:  # Failed after some samples.
            out[("note",) + k] = c.status
        elif c.failures:
            out[("note",) + k] = (f"{len(c.failures)} failed run(s), retried and left out of the "
                                  f"statistics (see below); the first: {c.failures[0]}")
    return out


def recovery_details(c, cap):
    rs = c.samples
    if not rs:
        return None
    n = len(rs)

    def count(pred):
        return sum(1 for r in rs if pred(r))

    parts = [f"first round formed {statistics.median([r['formed_s'] for r in rs]):.2f} s after "
             f"the agents started (median)"]
    host = sorted({r["host_agent"] for r in rs}, key=str)
    parts.append("coordinator hosted by agent " + "/".join(
        "none (daemon)" if h is None else str(h) for h in host))
    parts.append("killed: the agent of group rank " + "/".join(sorted({r["victim_rank"] for r in rs})))
    got = [r for r in rs if r["recovered_s"] is not None]
    if got:
        parts.append("new round: world sizes " + "/".join(sorted({",".join(r["new_world_sizes"])
                                                                  for r in got}))
                     + ", TORCHELASTIC_RESTART_COUNT " + "/".join(
                         sorted({",".join(r["new_restart_counts"]) for r in got})))
        parts.append(f"first new worker {statistics.median([r['first_new_s'] for r in got]):.3f} s "
                     f"after the kill (median)")
    none = [r for r in rs if r["recovered_s"] is None]
    if none:
        parts.append(f"after {cap:g} s without a new round: survivors' new workers "
                     f"{'/'.join(sorted({str(r['new_workers']) for r in none}))} of 3, their old "
                     f"workers still running {'/'.join(sorted({str(r['old_survivor_workers_alive']) for r in none}))} "
                     f"of 3, survivor agents alive "
                     f"{'/'.join(sorted({str(r['survivor_agents_alive']) for r in none}))} of 3")
    parts.append(f"the killed agent's worker was still running afterwards in "
                 f"{count(lambda r: r['victim_worker_alive'])} of {n} runs")
    return "; ".join(parts)


def table(summary, cases, sizes):
    lines = ["| Benchmark | Launcher | Median | Min | Max | Runs | Target | Meets |",
             "|---|---|---:|---:|---:|---:|---:|:---:|"]

    def row(label, launcher, v, target, digits=3):
        tgt = f"≤ {target:g} s" if target is not None else ""
        if isinstance(v, str):
            lines.append(f"| {label} | {launcher} | {v.replace('|', '/')} | | | | {tgt} | |")
            return
        med, lo, hi, n, nfail = v
        n = f"{n} (+{nfail} failed)" if nfail else n
        meets = verdict(med, target) if target is not None else ""
        lines.append(f"| {label} | {launcher} | {fmt(med, digits)} s | {fmt(lo, digits)} | "
                     f"{fmt(hi, digits)} | {n} | {tgt} | {meets} |")

    for n in sizes:
        for launcher in LAUNCHERS:
            v = summary.get(("formation", launcher, n))
            if v is None:
                continue
            target = TARGETS_S.get(n) if launcher != TORCHRUN else None
            row(f"1. formation, {n} agents, start → all exited 0", launcher, v, target)
    for launcher in LAUNCHERS:
        v = summary.get(("recovery", launcher, 4))
        if v is not None:
            row("2. recovery: kill -9 of 1 of 4 agents → 3 new workers running", launcher, v,
                TARGET_RECOVERY_S if launcher != TORCHRUN else None)
    for n in sizes:
        v = summary.get(("formation", FLOOR, n))
        if v is not None:
            row(f"0. harness floor: start {n} × /bin/true, wait for all", "—", v, None, 4)
    return lines


def report(bench, cases, summary, info, load, elapsed):
    a = bench.args
    out = ["## Rendezvous benchmark: elrun gRPC vs torchrun c10d", ""]
    out += [f"- **{k}**: {v}" for k, v in info]
    out += [f"- **runs**: {a.runs} per elrun case, {a.torchrun_runs} per torchrun formation case, "
            f"{a.torchrun_recovery_runs} for torchrun recovery; {a.warmup} unmeasured warm-up "
            f"run(s) per elrun and floor case and for the smallest torchrun case; a failed run is "
            f"retried up to {a.retries} times"
            + (f"; waited up to {a.wait_idle:g} s for an idle machine before each round"
               if a.wait_idle > 0 else "") + f"; benchmark took {elapsed:.0f} s",
            f"- **load**: {load}", ""]
    out += table(summary, cases, a.sizes)
    out += [""]
    notes = [(k, v) for k, v in summary.items() if k[0] == "note"]
    for k, v in notes:
        out.append(f"- note, {k[1]} / {k[2]} / N={k[3]}: {v}")
    for c in cases:
        if c.key == "recovery":
            d = recovery_details(c, a.recovery_cap)
            if d:
                out.append(f"- recovery, {c.launcher}: {d}.")
    out += [
        "",
        "Formation: `time.perf_counter()` from before the first of the N `subprocess.Popen` calls "
        "(each agent in its own session, stdout to /dev/null, stderr to a temp file) to the return "
        "of blocking `wait()`s on all N, in start order; every agent must exit 0. Each run has a "
        "fresh `--rdzv-id`. elrun (daemon): one `elrun-rdzv --listen 127.0.0.1:0 --port-file F`, "
        "started before any timing and shared by all runs. elrun (embedded): the endpoint is a "
        "port that was free a moment before; every agent tries to bind it, the first one that "
        "does hosts the coordinator and the others connect to it. torchrun: the same with the "
        "c10d TCPStore (torchrun's own is_host guess). Row 0 starts and waits for N × /bin/true "
        "the same way: the harness's own cost.",
        "",
        f"Recovery: 4 agents with `--nnodes 3:4`; each worker writes one line (`running "
        f"GROUP_WORLD_SIZE GROUP_RANK TORCHELASTIC_RESTART_COUNT ${{$}} $PPID`) to a FIFO that a "
        f"thread of the benchmark reads with a blocking select, stamping each line on arrival, "
        f"and then execs `sleep 1000`. Once the 4 workers of the first round have reported (with "
        f"world size 4) and {a.settle:g} s more have passed, the agent with the highest group "
        f"rank among those that do not hold the rendezvous port's listening socket gets SIGKILL. "
        f"Measured: from just before the kill to the arrival of the line of the last of the 3 "
        f"surviving agents' NEW workers (new pid, parent a survivor), capped at "
        f"{a.recovery_cap:g} s. elrun runs with the default --rdzv-conf (heartbeat 1 s / 5 s).",
        "",
        "Every run has a timeout; afterwards every process that carries the run's tag in its "
        f"environment ({TAG_VAR}) is killed, including workers orphaned by a killed agent. "
        "Agents run with a private TMPDIR, removed at the end.",
        "",
    ]
    failed = [c for c in cases if c.failures]
    if failed:
        out += ["Failed runs (retried, not counted in the statistics):", ""]
        for c in failed:
            out += [f"- {c.key} / {c.launcher} / N={c.n}: {m}" for m in c.failures]
        out += [""]
    out += ["Commands (run from the repository root; PORT: a port that was free a moment before, "
            "JOB_i: a fresh run id per run; `# x N`: started N times at once):", "", "```"]
    out.append(f"{bench.args.rdzv.replace(REPO + '/', '')} --listen 127.0.0.1:0 --port-file F"
               f"  # the daemon, once; DAEMON_PORT is read from F")
    seen = set()
    for c in cases:
        if c.cmd in seen:
            continue
        seen.add(c.cmd)
        out.append(c.cmd + f"  [{c.key}: {c.launcher}" + (", not run]" if c.missing else "]"))
    out += ["```", ""]
    return "\n".join(out)


def plot(summary, sizes, cap, path):
    plt = bench_common.pyplot()

    colors = {ELRUN_DAEMON: "#2a7ab0", ELRUN_EMBEDDED: "#6cb4e0", TORCHRUN: "#c0504d",
              FLOOR: "#999999"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6), gridspec_kw={"width_ratios": [3, 2]})
    for launcher in LAUNCHERS + [FLOOR]:
        xs, ys, lo, hi = [], [], [], []
        for n in sizes:
            v = summary.get(("formation", launcher, n))
            if isinstance(v, tuple):
                xs.append(n)
                ys.append(v[0])
                lo.append(v[0] - v[1])
                hi.append(v[2] - v[0])
        if xs:
            ax1.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=4, color=colors[launcher],
                         label=launcher, linestyle="--" if launcher == FLOOR else "-")
            above = launcher in (ELRUN_DAEMON, TORCHRUN)
            for x, y in zip(xs, ys):
                ax1.annotate(f"{y:.2f} s" if y >= 0.1 else f"{y * 1000:.0f} ms", (x, y),
                             textcoords="offset points", xytext=(-34, 7) if above else (7, -11),
                             fontsize=8, color=colors[launcher])
    for n, t in TARGETS_S.items():
        if n in sizes:
            ax1.plot([n], [t], marker="_", markersize=22, color="green", mew=2)
            ax1.annotate(f"elrun target ≤ {t:g} s", (n, t), textcoords="offset points",
                         xytext=(12, -3), fontsize=8, color="green")
    notes = []
    for launcher in LAUNCHERS:
        failed = [n for n in sizes if str(summary.get(("formation", launcher, n), "")).startswith(
            "FAILED")]
        if failed:
            notes.append((f"{launcher}: FAILED for N = {', '.join(map(str, failed))}",
                          colors[launcher]))
    skipped = [n for n in sizes if str(summary.get(("formation", TORCHRUN, n), "")).startswith(
        "not run")]
    if skipped:
        notes.append((f"torchrun not run for N = {', '.join(map(str, skipped))} (memory: N × "
                      f"{TORCHRUN_AGENT_MIB} MiB)", colors[TORCHRUN]))
    for i, (text, color) in enumerate(notes):
        ax1.text(0.98, 0.03 + 0.05 * i, text, transform=ax1.transAxes, ha="right", va="bottom",
                 fontsize=8, color=color)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xticks(sizes)
    ax1.set_xticklabels([str(n) for n in sizes])
    ax1.set_xlabel("agents N (1 worker each, /bin/true)")
    ax1.set_ylabel("seconds, start → all agents exited 0")
    ax1.set_title("1. rendezvous formation", fontsize=10)
    ax1.set_xlim(min(sizes) / 1.4, max(sizes) * 2.2)
    ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    ax1.grid(True, which="both", alpha=0.3)

    names = {ELRUN_DAEMON: "elrun\n(daemon)", ELRUN_EMBEDDED: "elrun\n(embedded)",
             TORCHRUN: "torchrun c10d"}
    bars = [(l, summary.get(("recovery", l, 4))) for l in LAUNCHERS
            if summary.get(("recovery", l, 4)) is not None]
    for i, (launcher, v) in enumerate(bars):
        if isinstance(v, tuple):
            ax2.bar(i, v[0], color=colors[launcher], yerr=[[v[0] - v[1]], [v[2] - v[0]]], capsize=4)
            ax2.text(i, v[2] * 1.15, f"{v[0]:.3f} s", ha="center", va="bottom", fontsize=9)
        elif v.startswith("no new round"):
            ax2.bar(i, cap, color="white", edgecolor=colors[launcher], hatch="//")
            ax2.text(i, cap * 1.1, f"no new round\nwithin {cap:g} s", ha="center", va="bottom",
                     fontsize=9)
        else:
            ax2.text(i, 0.1, "failed" if v.startswith("FAILED") else "missing", ha="center",
                     fontsize=9, color="gray")
    ax2.axhline(TARGET_RECOVERY_S, color="green", linestyle="--", linewidth=1,
                label=f"elrun target ≤ {TARGET_RECOVERY_S:g} s")
    ax2.set_yscale("log")
    ax2.set_ylim(0.005, cap * 4)
    ax2.set_xticks(range(len(bars)))
    ax2.set_xticklabels([names[l] for l, _ in bars], fontsize=9)
    ax2.set_ylabel("seconds, kill -9 → 3 survivors' new workers running")
    ax2.set_title("2. recovery after kill -9 of 1 of 4 agents", fontsize=10)
    ax2.legend(fontsize=8, loc="upper left")
    fig.suptitle("elrun gRPC rendezvous vs torchrun 1.13 c10d, 127.0.0.1 (medians; whiskers "
                 "min/max)", fontsize=11)
    bench_common.save_figure(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elrun", default=DEFAULT_ELRUN, help="elrun binary (default: %(default)s)")
    ap.add_argument("--rdzv", default=DEFAULT_RDZV,
                    help="elrun-rdzv binary (default: %(default)s)")
    ap.add_argument("--sizes", default="4,8,32,128",
                    help="agent counts N for formation, comma-separated (default %(default)s)")
    ap.add_argument("--runs", type=int, default=5, help="measured runs per elrun case (default 5)")
    ap.add_argument("--torchrun-runs", type=int, default=3,
                    help="measured runs per torchrun formation case (~5-10 s each; default 3)")
    ap.add_argument("--torchrun-recovery-runs", type=int, default=2,
                    help="measured runs of torchrun recovery (up to ~5 s + --recovery-cap each; "
                         "default 2)")
    ap.add_argument("--torchrun-max-n", type=int, default=16,
                    help="largest N to run torchrun for (each agent ~235 MiB; default 16); N is "
                         "also skipped when N x 250 MiB exceeds half of MemAvailable")
    ap.add_argument("--warmup", type=int, default=1,
                    help="unmeasured runs per elrun/floor case and for the smallest torchrun "
                         "case (default 1)")
    ap.add_argument("--recovery-cap", type=float, default=30,
                    help="seconds to wait for the survivors' new round after the kill (default 30)")
    ap.add_argument("--settle", type=float, default=0.5,
                    help="seconds between all workers running and the kill (default 0.5)")
    ap.add_argument("--no-embedded", action="store_true",
                    help="skip the elrun cases with the coordinator embedded in an agent")
    ap.add_argument("--no-recovery", action="store_true", help="skip the recovery cases")
    bench_common.add_output_options(ap, DEFAULT_PNG)
    bench_common.add_run_options(ap, timeout=30, torchrun_timeout=120, retries=2)
    args = ap.parse_args()
    try:
        args.sizes = sorted({int(x) for x in args.sizes.split(",") if x.strip()})
    except ValueError:
        ap.error("--sizes takes comma-separated integers")
    if not args.sizes or min(args.sizes) < 1:
        ap.error("--sizes must be >= 1")
    if min(args.runs, args.torchrun_runs, args.torchrun_recovery_runs) < 1 or args.warmup < 0 \
            or args.retries < 0 or args.recovery_cap <= 0:
        ap.error("run counts must be >= 1, --warmup and --retries >= 0, --recovery-cap > 0")

    # SIGTERM unwinds like Ctrl-C, so that the finally clauses kill what was started.
    signal.signal(signal.SIGTERM, lambda signo, frame: sys.exit(128 + signo))
    tmp = tempfile.mkdtemp(prefix="rdzv_bench.")
    os.environ["TMPDIR"] = tmp
    tempfile.tempdir = tmp
    bench = Bench(args, tmp)
    try:
        return run(bench)
    finally:
        bench.daemon.stop()
        kill_tagged(bench.tag + ":")
        shutil.rmtree(tmp, ignore_errors=True)


def run(bench):
    args = bench.args
    t0 = time.monotonic()
    load_start = loadavg()
    ids_before = (binary_id(args.elrun), binary_id(args.rdzv))
    cases = bench.build_cases()
    for c in cases:
        if c.missing:
            log(f"{c.key} / {c.launcher} / N={c.n}: {c.missing}")
    info = machine_info([("elrun", args.elrun), ("elrun-rdzv", args.rdzv)])
    mem = mem_available_mib()
    info.insert(1, ("memory", f"{mem / 1024:.1f} GiB available at start" if mem else "?"))
    share = bench.run_cases(cases)
    summary = summarize(cases, args.recovery_cap)
    load = (f"other processes used {100 * share:.0f}% of the CPUs while the runs were measured "
            f"(machine CPU time minus this benchmark's, its children's and the daemon's)"
            if share is not None else "CPU use of other processes unknown")
    load += f"; loadavg (1/5/15 min) {load_start} at start, {loadavg()} at end"
    if share is not None and share > 0.10:
        load += " — **the machine was busy; timings are noisy**"
        log(f"warning: other processes used {100 * share:.0f}% of the CPUs; timings are noisy")
    if (binary_id(args.elrun), binary_id(args.rdzv)) != ids_before:
        load += " — **an elrun binary changed during the run (rebuilt?); the elrun rows mix builds**"
        log("warning: an elrun binary changed during the run; the elrun rows mix builds")
    print(report(bench, cases, summary, info, load, time.monotonic() - t0), flush=True)
    if args.png:
        plot(summary, args.sizes, args.recovery_cap, args.png)
        log(f"wrote {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": dict(info),
                       "cases": [{"key": c.key, "launcher": c.launcher, "n": c.n, "cmd": c.cmd,
                                  "samples": c.samples, "failures": c.failures,
                                  "status": c.status} for c in cases]}, f, indent=1)
        log(f"wrote {args.json}")
    return 1 if any(c.error for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
