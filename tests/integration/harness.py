"""Shared helpers for elrun's multi-process integration tests.

Runs the real elrun binary (ELRUN_BIN, else Bazel runfiles, else the repo's bazel-bin), gives each
test a fresh temporary directory, and waits for processes with pidfds and FIFOs, never with sleeps.
The test process makes itself a child subreaper, so every orphan that elrun leaves behind is
re-parented to it: tearDown SIGKILLs and reaps whatever is left, and an unreaped orphan keeps its
pid, so a recorded pid can not be reused while a test still looks at it.
Single-threaded by design: unittest runs one test at a time in this process.
"""
import ctypes
import json
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

# The helpers shared with the benchmarks (//tests/support), importable with the repository root on
# PYTHONPATH, as run_py_test.sh puts it.
from tests.support.procs import (DEATH_TIMEOUT_S, Pidfds, cmdline, describe, descendants,  # noqa: F401
                                 is_running, kill_and_reap, proc_stat, wait_dead)

# The project's torch 2.11 environment (scripts/setup.sh links it as .venv): Bazel passes it as
# PYTHON_EXEC (.bazelrc); by hand it is found from this file's place in the checkout.
PYTHON = os.environ.get("PYTHON_EXEC") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".venv", "bin", "python3")
HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")

# Bounds for every wait in the suite; none of them is a synchronisation sleep.
RUN_TIMEOUT_S = 30.0  # One elrun invocation from start to exit.
READY_TIMEOUT_S = 20.0  # Workers to report that they are running.
LEAK_GRACE_S = 3.0  # After elrun exits, for what it killed to finish dying.

_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _reset_signal_dispositions():
    # Bazel's test-setup.sh starts the test as a background job of a non-interactive shell, which
    # leaves SIGINT and SIGQUIT ignored; ignored signals survive exec into elrun and its workers.
    # Start elrun the way an interactive shell would: every signal at its default.
    for signo in (signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        if signal.getsignal(signo) == signal.SIG_IGN:
            signal.signal(signo, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


_become_subreaper()
_reset_signal_dispositions()


def bazel_binary(package, name, override_env):
    """The command that starts the Bazel-built binary //package:name, as a list: $override_env
    (which may hold a command with arguments), else Bazel runfiles, else the repo's bazel-bin."""
    override = os.environ.get(override_env)
    if override:
        return shlex.split(override)
    candidates = []
    for root in (os.environ.get("TEST_SRCDIR"), os.environ.get("RUNFILES_DIR")):
        if root:
            candidates.append(os.path.join(root, "elrun", package, name))
    repo = os.path.dirname(os.path.dirname(HERE))
    candidates.append(os.path.join(repo, "bazel-bin", package, name))
    candidates.append(os.path.join("/work/main/bazel-bin", package, name))
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return [path]
    raise RuntimeError("%s binary not found; looked at %s (set %s)"
                       % (name, candidates, override_env))


def elrun_command():
    """The command that starts elrun, as a list (ELRUN_BIN may hold a command with arguments)."""
    return bazel_binary("launcher", "elrun", "ELRUN_BIN")


# True when ELRUN_BIN points at the reference torchrun (tests/support/torchrun_compat.py), only
# used to debug the worker scripts: tests then skip what torchrun did differently when the skips
# were written (torch 1.13; the reasons below are not yet rechecked against torch 2.11).
TORCHRUN_REFERENCE = "torchrun" in os.environ.get("ELRUN_BIN", "")
# What torch_allreduce.py must not check against torchrun 1.13 (ELRUN_TEST_RELAX).
TORCHRUN_RELAX = ["TORCHELASTIC_ERROR_FILE", "MASTER_ADDR", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                  "TORCHELASTIC_USE_AGENT_STORE"] if TORCHRUN_REFERENCE else []


def free_port():
    """A port that was free a moment ago (bind 0, close); only for options that need a number
    that nothing will listen on. For a port a child will listen on, reserve_port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ReservedPort:
    """A TCP port held for a child process to listen on, as elrun holds MASTER_PORT (see
    launcher/os/port_reservation.h): bound with SO_REUSEADDR on every address and never listened
    on, so that no other socket on the host - another test's port-0 bind, a connection's
    ephemeral port - is given it, while the child's listener, which sets SO_REUSEADDR too
    (TCPStore, elrun's coordinator, slurmctld and slurmd), binds it. close() gives it back."""

    def __init__(self):
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("0.0.0.0", 0))
        self.port = self._socket.getsockname()[1]

    def close(self):
        self._socket.close()


# ---------------------------------------------------------------------------------------------
# /proc and pidfd helpers (proc_stat, cmdline, is_running, descendants, describe, Pidfds,
# wait_dead) come from tests/support/procs.py, imported above.


def kill_descendants_of_self(timeout=DEATH_TIMEOUT_S):
    """SIGKILLs every descendant of this process and reaps the ones re-parented to it."""
    me = os.getpid()
    for _ in range(20):  # New orphans may appear while killing; a few rounds settle it.
        found = descendants(me)
        if not found:
            break
        fds = {}
        for pid, start in found.items():
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            stat = proc_stat(pid)
            if stat is None or stat[3] != start:  # Reused since the scan: not ours.
                os.close(fd)
                continue
            fds[pid] = fd
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        pending = dict(fds)
        for _ in range(len(pending) + 1):
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0:
                break
            ready, _, _ = select.select(list(pending.values()), [], [], remaining)
            for pid in [p for p, fd in pending.items() if fd in ready]:
                del pending[pid]
        for fd in fds.values():
            os.close(fd)
        for pid in fds:
            stat = proc_stat(pid)
            if stat is not None and stat[1] == me:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass


# ---------------------------------------------------------------------------------------------
# Readiness channel.

class ReadyFifo:
    """A named pipe that workers write one line to (`echo ... > "$READY"`) when they are running.
    The test holds it open read-write, so writers never block and readers never see EOF."""

    def __init__(self, path):
        self.path = path
        os.mkfifo(path)
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self.buf = b""
        self.lines = []

    def read_lines(self, count, proc=None, timeout=READY_TIMEOUT_S):
        """Returns the first `count` lines (stripped) once they have arrived. Raises AssertionError
        after timeout, or as soon as `proc` (elrun) exits before they all arrived."""
        deadline = time.monotonic() + timeout
        proc_fd = os.pidfd_open(proc.pid) if proc is not None else None
        try:
            for _ in range(100000):  # Bounded: each round reads data, sees an exit, or times out.
                if len(self.lines) >= count:
                    return self.lines[:count]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                watch = [self.fd] + ([proc_fd] if proc_fd is not None else [])
                ready, _, _ = select.select(watch, [], [], remaining)
                if self.fd in ready:
                    self.drain()
                    continue
                if proc_fd is not None and proc_fd in ready:
                    self.drain()
                    if len(self.lines) >= count:
                        return self.lines[:count]
                    raise AssertionError(
                        "expected %d ready lines from workers, got %r before elrun exited"
                        % (count, self.lines))
            raise AssertionError("expected %d ready lines from workers within %.0f s, got %r"
                                 % (count, timeout, self.lines))
        finally:
            if proc_fd is not None:
                os.close(proc_fd)

    def drain(self):
        """Reads what has arrived (never blocks) and appends its complete lines to self.lines."""
        for _ in range(10000):
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            self.buf += chunk
        *complete, self.buf = self.buf.split(b"\n")
        self.lines.extend(line.decode().strip() for line in complete)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# ---------------------------------------------------------------------------------------------
# Running elrun.

class WatchedProcess:
    """A started process: its stdout and stderr so far, read from non-blocking pipes, and its
    exit, seen on a pidfd opened while it was still our unreaped child. Callers select() on
    list(streams) + [pidfd] and call read(fd) / reap()."""

    def __init__(self, proc):
        self.proc = proc
        self.pidfd = os.pidfd_open(proc.pid)
        self.out, self.err = b"", b""
        self.rc, self.exited_at = None, None
        self.streams = {}
        for stream, attr in ((proc.stdout, "out"), (proc.stderr, "err")):
            os.set_blocking(stream.fileno(), False)
            self.streams[stream.fileno()] = attr

    @property
    def pid(self):
        return self.proc.pid

    @property
    def stdout(self):
        return self.out.decode("utf-8", "replace")

    @property
    def stderr(self):
        return self.err.decode("utf-8", "replace")

    def read(self, fd):
        """Appends what fd has now; forgets fd at EOF (a leaked worker may keep it open)."""
        for _ in range(1000):
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                del self.streams[fd]
                return
            setattr(self, self.streams[fd], getattr(self, self.streams[fd]) + chunk)

    def reap(self):
        """Called when the pidfd is readable: records the exit and what was left in the pipes."""
        self.rc = self.proc.wait(timeout=DEATH_TIMEOUT_S)
        self.exited_at = time.monotonic()
        for fd in list(self.streams):
            self.read(fd)


class Result:
    def __init__(self, args, rc, out, err, elapsed):
        self.args, self.rc, self.out, self.err, self.elapsed = args, rc, out, err, elapsed

    def __str__(self):
        return ("elrun %s\n  exit: %s after %.2f s\n  --- stdout ---\n%s\n  --- stderr ---\n%s"
                % (" ".join(shlex.quote(a) for a in self.args), self.rc, self.elapsed,
                   self.out[-6000:], self.err[-6000:]))


# Variables that would change what elrun does or what workers see; scrubbed from the inherited
# environment so each test states what it depends on.
_SCRUBBED_PREFIXES = ("PET_", "TORCHELASTIC_")
_SCRUBBED = ("OMP_NUM_THREADS", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
             "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
             "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE",
             "ELRUN_RDZV_TOKEN")


class ElrunTestCase(unittest.TestCase):
    """Base class: a temp dir per test, elrun runners, and cleanup of every process started."""

    def setUp(self):
        base = os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()
        self.tmp = tempfile.mkdtemp(prefix=self.id().rsplit(".", 1)[-1][:40] + ".", dir=base)
        self.procs = []
        self.fifos = []
        self.addCleanup(self._cleanup)

    def _cleanup(self):
        for proc in self.procs:
            kill_and_reap(proc)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        for fifo in self.fifos:
            fifo.close()
        # Processes elrun SIGKILLed just before it exited may still be on their way out.
        running = [p for p in descendants(os.getpid()) if is_running(p)]
        leaked = {p: cmdline(p) for p in wait_dead(running, LEAK_GRACE_S)}
        kill_descendants_of_self()
        if os.environ.get("ELRUN_KEEP_TMP") is None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        # After elrun has exited, nothing it started may still run (workers, grandchildren,
        # a guardian). Tests that kill elrun on purpose check the same thing explicitly.
        if leaked:
            self.fail("processes left running after the test (expected none): %s"
                      % "; ".join("%d %s" % kv for kv in sorted(leaked.items())))

    # -- environment ----------------------------------------------------------------------------

    def env(self, **overrides):
        """The environment for elrun: ours minus launcher/worker variables, plus PYTHON_EXEC,
        OUT_DIR=TMPDIR=self.tmp; an override of None removes the variable."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(_SCRUBBED_PREFIXES) and k not in _SCRUBBED}
        env["PYTHON_EXEC"] = PYTHON
        env["OUT_DIR"] = self.tmp
        env["TMPDIR"] = self.tmp  # elrun's default log dirs land here and are removed with it.
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["ELRUN_TEST_RELAX"] = json.dumps(TORCHRUN_RELAX)
        for key, value in overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = str(value)
        return env

    def reserve_port(self):
        """A port held for a child to listen on until the test ends (ReservedPort)."""
        reserved = ReservedPort()
        self.addCleanup(reserved.close)
        return reserved.port

    def path(self, *parts):
        return os.path.join(self.tmp, *parts)

    def sh_file(self, script, name="worker.sh"):
        """elrun arguments that run `script`, saved as a file, with sh in every worker."""
        path = self.path(name)
        with open(path, "w") as f:
            f.write(script + "\n")
        flag = "--no_python" if TORCHRUN_REFERENCE else "--no-python"
        return [flag, "sh", path]

    def mkfifo(self, name):
        """A plain named pipe in the temp dir, for workers to rendezvous with each other."""
        os.mkfifo(self.path(name))
        return self.path(name)

    def ready_fifo(self, name="ready"):
        fifo = ReadyFifo(self.path(name))
        self.fifos.append(fifo)
        return fifo

    # -- running --------------------------------------------------------------------------------

    def start(self, args, env=None, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
              preexec_fn=None, command=None):
        """Starts elrun (or `command`, a list, e.g. the rendezvous daemon) with args; the caller
        waits for it (self.finish). Cleanup SIGKILLs it if it still runs."""
        proc = subprocess.Popen((command or elrun_command()) + list(args), env=env or self.env(),
                                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                cwd=self.tmp, preexec_fn=preexec_fn)
        proc.args_for_report = list(args)
        proc.started_at = time.monotonic()
        self.procs.append(proc)
        return proc

    def finish(self, proc, timeout=RUN_TIMEOUT_S):
        """Waits for a started elrun and returns its Result; fails the test after timeout."""
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            leftovers = describe(descendants(proc.pid))
            proc.kill()
            # Workers may hold elrun's stdout/stderr pipes open: kill them too before reading
            # what is left, and never wait unboundedly for EOF.
            kill_descendants_of_self()
            try:
                out, err = proc.communicate(timeout=DEATH_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                out, err = b"", b""
            self.fail("expected elrun to exit within %.0f s; it did not (its processes: %s)\n%s"
                      % (timeout, leftovers,
                         Result(proc.args_for_report, None, _text(out), _text(err),
                                time.monotonic() - proc.started_at)))
        return Result(proc.args_for_report, proc.returncode, _text(out), _text(err),
                      time.monotonic() - proc.started_at)

    def elrun(self, args, env=None, timeout=RUN_TIMEOUT_S):
        """Runs elrun to completion and returns its Result."""
        return self.finish(self.start(args, env=env), timeout=timeout)

    # -- assertions -----------------------------------------------------------------------------

    def assertExit(self, result, code):
        self.assertEqual(result.rc, code, "expected exit code %s\n%s" % (code, result))

    def assertAllDead(self, pids, timeout=DEATH_TIMEOUT_S, what="processes"):
        alive = wait_dead(pids, timeout)
        self.assertEqual(alive, [], "expected every one of %s %s to be dead within %.0f s; still "
                         "running: %s" % (what, sorted(pids), timeout, describe(alive)))

    def read_json(self, *parts):
        with open(self.path(*parts)) as f:  # An absolute part wins over self.tmp.
            return json.load(f)

    def read_text(self, path):
        with open(path) as f:
            return f.read()


def _text(data):
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")


def sh(script):
    """elrun arguments that run `script` with sh in every worker (--no-python sh -c SCRIPT).
    torchrun substitutes arguments like string.Template ("$$" becomes "$"), so scripts that need
    the shell's pid ($$) go through ElrunTestCase.sh_file instead."""
    assert "$$" not in script, "use sh_file for scripts that use $$"
    flag = "--no_python" if TORCHRUN_REFERENCE else "--no-python"  # torchrun 1.13: no dashes.
    return [flag, "sh", "-c", script]


def worker(name):
    return os.path.join(WORKERS, name)


def lines(text):
    return [line for line in text.splitlines()]


def main():
    """unittest.main, or under Bazel's test sharding (shard_count) this shard's share: every
    TEST_TOTAL_SHARDS-th test case in id order, from TEST_SHARD_INDEX."""
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
    if total <= 1:
        unittest.main(verbosity=2)
        return
    if os.environ.get("TEST_SHARD_STATUS_FILE"):  # Tells Bazel this test honours sharding.
        open(os.environ["TEST_SHARD_STATUS_FILE"], "w").close()
    index = int(os.environ["TEST_SHARD_INDEX"])
    cases = sorted(_cases(unittest.defaultTestLoader.loadTestsFromModule(sys.modules["__main__"])),
                   key=lambda case: case.id())
    mine = unittest.TestSuite(case for i, case in enumerate(cases) if i % total == index)
    result = unittest.TextTestRunner(verbosity=2).run(mine)
    sys.exit(0 if result.wasSuccessful() else 1)


def _cases(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _cases(item)
        else:
            yield item



def elrun_only(reason="uses elrun behaviour that torchrun 1.13 does not share"):
    """Skips a test when debugging worker scripts against torchrun (ELRUN_BIN=...torchrun...)."""
    return unittest.skipIf(TORCHRUN_REFERENCE, reason)
