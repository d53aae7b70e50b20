"""Helpers for the multi-node (gRPC rendezvous) integration tests: the elrun-rdzv daemon, elrun
agents of one or more jobs (one agent per simulated node, node N on --local-addr 127.0.0.N), and
one event pump that waits on the workers' ready FIFO, every process's output pipes and every
process's exit (pidfds) at once, never with sleeps. Built on harness.ElrunTestCase, whose cleanup
SIGKILLs the daemon and every agent, then fails the test if anything they started still runs.
Single-threaded, like harness: unittest runs one test at a time in this process.
"""
import os
import re
import select
import signal
import time

import harness
from harness import ElrunTestCase

# Bounds for the waits of this suite; none of them is a synchronisation sleep.
DAEMON_TIMEOUT_S = 10.0  # elrun-rdzv to print its port, or to exit after SIGTERM.
ROUND_TIMEOUT_S = 40.0  # The workers of a round to report (PyTorch starts on 2 busy cores).
EXIT_TIMEOUT_S = 30.0  # Agents to exit once their job is decided.

# The daemon's first stdout line, and elrun's per-round line on stderr with LOGLEVEL=info.
LISTENING = re.compile(r"^elrun-rdzv listening on 127\.0\.0\.1:(\d+)", re.M)
ROUND_LINE = re.compile(r"\[elrun\] info: round (\d+): group rank (\d+) of (\d+), world size "
                        r"(\d+), restart count (\d+), master (\S+):(\d+)")

# The sh worker of these tests: runs $SETUP (e.g. a trap, which must be in place before the
# worker says it is ready), starts a grandchild, reports itself on $READY as one line of
# key=value pairs (parse_record), then runs $RULE, one of the rules below.
WORKER = r'''
eval "$SETUP"
sleep 300 </dev/null >/dev/null 2>&1 &
echo "node=$NODE run=$TORCHELASTIC_RUN_ID group=$GROUP_RANK groups=$GROUP_WORLD_SIZE" \
     "rank=$RANK local=$LOCAL_RANK nproc=$LOCAL_WORLD_SIZE world=$WORLD_SIZE" \
     "restarts=$TORCHELASTIC_RESTART_COUNT master_addr=$MASTER_ADDR master_port=$MASTER_PORT" \
     "pid=$$ child=$!" > "$READY"
eval "$RULE"
'''

EXIT_0 = "exit 0"
# Waits for one release (RdzvTestCase.release), then exits 0.
GATED = 'read go < "$GO"; exit 0'


def hold_while_world(world):
    """A rule: hold (until elrun stops the worker) while WORLD_SIZE is `world`, else exit 0."""
    return 'if [ "$WORLD_SIZE" = %d ]; then wait; fi; exit 0' % world


def parse_record(line):
    """A worker's ready line as a dict; all-digit values become ints."""
    record = {}
    for field in line.split():
        key, _, value = field.partition("=")
        record[key] = int(value) if value.isdigit() else value
    return record


def rdzv_command():
    """The command that starts elrun-rdzv (ELRUN_RDZV_BIN overrides)."""
    return harness.bazel_binary("agent/daemon", "elrun-rdzv", "ELRUN_RDZV_BIN")


class Watched(harness.WatchedProcess):
    """A started process (the daemon or an agent), with its name, and for an agent its node
    number (start_agent), for the daemon its port (start_daemon)."""

    def __init__(self, name, proc):
        super().__init__(proc)
        self.name = name
        self.node = None
        self.port, self.port_file = None, None

    def rounds(self):
        """elrun's round lines so far: [{round, group, groups, world, restarts, master}]."""
        return [{"round": int(m[0]), "group": int(m[1]), "groups": int(m[2]), "world": int(m[3]),
                 "restarts": int(m[4]), "master": "%s:%s" % (m[5], m[6])}
                for m in ROUND_LINE.findall(self.stderr)]

    def result(self):
        end = self.exited_at if self.exited_at is not None else time.monotonic()
        return harness.Result([self.name] + self.proc.args_for_report, self.rc, self.stdout,
                              self.stderr, end - self.proc.started_at)

    def close(self):
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class RdzvTestCase(ElrunTestCase):
    """A temp dir with the workers' ready FIFO ($READY) and release FIFO ($GO), and helpers to
    start the daemon and agents and to wait for what they do."""

    def setUp(self):
        super().setUp()
        self.watched = []
        self.addCleanup(self._close_watched)
        self.ready = self.ready_fifo()
        self.seen = 0  # Ready lines already returned by wait_workers.
        self.go_path = self.mkfifo("go")
        # Held open read-write: workers' opens never block, and released bytes wait for them.
        self.go_fd = os.open(self.go_path, os.O_RDWR | os.O_NONBLOCK)
        self.addCleanup(os.close, self.go_fd)
        self.worker_args = self.sh_file(WORKER, "rdzv_worker.sh")

    def _close_watched(self):
        for watched in self.watched:
            watched.close()

    # -- starting -------------------------------------------------------------------------------

    def start_daemon(self, token=None, preexec_fn=None, args=(), port=0):
        """Starts elrun-rdzv on 127.0.0.1 port `port` (0: a free one; ELRUN_RDZV_TOKEN=token when
        given; preexec_fn runs in the child before exec; args: more options) and waits for the
        port it prints."""
        port_file = self.path("rdzv.port")
        proc = self.start(["--listen", "127.0.0.1:%d" % port, "--port-file", port_file] + list(args),
                          env=self.env(ELRUN_RDZV_TOKEN=token), command=rdzv_command(),
                          preexec_fn=preexec_fn)
        daemon = self._watch("elrun-rdzv", proc)
        self.pump(lambda: LISTENING.search(daemon.stdout), "elrun-rdzv to print its port",
                  DAEMON_TIMEOUT_S, alive=[daemon])
        daemon.port = int(LISTENING.search(daemon.stdout).group(1))
        daemon.port_file = port_file
        return daemon

    def stop_daemon(self, daemon):
        """SIGTERMs the daemon; expects exit 0 and the port it printed in its --port-file."""
        daemon.proc.send_signal(signal.SIGTERM)  # Our unreaped child: the pid is still its.
        self.wait_exit([daemon], DAEMON_TIMEOUT_S)
        self.assertExit(daemon.result(), 0)
        self.assertEqual(self.read_text(daemon.port_file).strip(), str(daemon.port),
                         "expected --port-file to hold the port elrun-rdzv printed")

    def start_agent(self, node, port, run_id="job", nnodes=4, nproc=2, rule=EXIT_0, conf=None,
                    args=(), worker=None, env=None, backend="c10d", endpoint=None):
        """Starts the elrun agent of node `node` (an int; --local-addr 127.0.0.<node>) for
        run_id against the coordinator at 127.0.0.1:port, with LOGLEVEL=info. Workers run
        WORKER with $RULE=rule unless `worker` gives other arguments. conf: --rdzv-conf keys
        over the default join_timeout=30. env: extra variables (None removes one). backend and
        endpoint (over 127.0.0.1:port): e.g. etcd-v3 and an etcd cluster's members."""
        settings = {"join_timeout": "30"}
        settings.update(conf or {})
        argv = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", backend,
                "--rdzv-endpoint", endpoint or "127.0.0.1:%d" % port, "--rdzv-id", run_id,
                "--local-addr", "127.0.0.%d" % node,
                "--rdzv-conf", ",".join("%s=%s" % kv for kv in settings.items())]
        argv += list(args) + list(worker or self.worker_args)
        overrides = {"NODE": node, "READY": self.ready.path, "GO": self.go_path, "RULE": rule,
                     "SETUP": "", "LOGLEVEL": "info"}
        overrides.update(env or {})
        agent = self._watch("node %d" % node, self.start(argv, env=self.env(**overrides)))
        agent.node = node
        return agent

    def _watch(self, name, proc):
        watched = Watched(name, proc)
        self.watched.append(watched)
        return watched

    def release(self, count):
        """Lets `count` GATED workers exit 0 (one byte each: sh's read takes a byte at a time)."""
        os.write(self.go_fd, b"\n" * count)

    # -- waiting --------------------------------------------------------------------------------

    def pump(self, until, what, timeout, alive=()):
        """Reads ready lines, output and exits as they come until until() is true. Fails after
        timeout seconds, or as soon as a process in `alive` exits first."""
        deadline = time.monotonic() + timeout
        for _ in range(100000):  # Bounded: each round reads something, sees an exit, or times out.
            self.ready.drain()
            if until():
                return
            gone = [w for w in alive if w.rc is not None]
            if gone:
                self.fail("expected %s to keep running until %s; %s exited first\n%s"
                          % (", ".join(w.name for w in alive), what,
                             ", ".join(w.name for w in gone), self.summary()))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            owners = {self.ready.fd: None}
            for w in self.watched:
                for fd in w.streams:
                    owners[fd] = (w, fd)
                if w.rc is None:
                    owners[w.pidfd] = (w, None)
            poller = select.poll()  # Not select(): descriptors may be >= 1024 (rdzv_flood_test).
            for fd in owners:
                poller.register(fd, select.POLLIN)
            ready = [fd for fd, _ in poller.poll(remaining * 1000)]
            for fd in ready:
                if owners[fd] is None:
                    continue  # The ready FIFO, drained at the top.
                w, stream = owners[fd]
                if stream is None:
                    w.reap()
                elif stream in w.streams:
                    w.read(stream)
        self.fail("expected %s within %.0f s; it did not happen\n%s" % (what, timeout,
                                                                       self.summary()))

    def wait_workers(self, count, alive=(), what=None, timeout=ROUND_TIMEOUT_S):
        """The next `count` ready lines from workers (parsed), failing as pump does."""
        want = self.seen + count
        self.pump(lambda: len(self.ready.lines) >= want,
                  what or "%d more ready lines from workers" % count, timeout, alive)
        records = [parse_record(line) for line in self.ready.lines[self.seen:want]]
        self.seen = want
        return records

    def wait_exit(self, watched, timeout=EXIT_TIMEOUT_S):
        """Waits until every process in `watched` has exited."""
        self.pump(lambda: all(w.rc is not None for w in watched),
                  "%s to exit" % ", ".join(w.name for w in watched), timeout)

    def summary(self):
        parts = ["ready lines so far: %r" % self.ready.lines]
        for w in self.watched:
            parts.append("--- %s (pid %d): %s\n%s" % (
                w.name, w.pid, "running" if w.rc is None else "exit %s" % w.rc,
                str(w.result())))
        return "\n".join(parts)

    # -- assertions -----------------------------------------------------------------------------

    def assertAllExit(self, agents, code):
        """Waits for every agent and expects each to exit with `code`."""
        self.wait_exit(agents)
        for agent in agents:
            self.assertExit(agent.result(), code)

    def assertNoMoreWorkers(self):
        """Expects no ready line beyond those wait_workers returned (no extra round)."""
        self.ready.drain()
        self.assertEqual(self.ready.lines[self.seen:], [],
                         "expected no more worker starts than the test waited for\n%s"
                         % self.summary())

    def pidfds(self, records):
        """Pidfds of the workers and grandchildren in ready records, opened now."""
        fds = harness.Pidfds([r[key] for r in records for key in ("pid", "child") if key in r])
        self.addCleanup(fds.close)
        return fds

    def assertDead(self, fds, what):
        alive = fds.wait_all_dead(harness.DEATH_TIMEOUT_S)
        self.assertEqual(alive, [], "expected %s %s dead within %.0f s; still running: %s"
                         % (what, sorted(fds.fds), harness.DEATH_TIMEOUT_S,
                            harness.describe(alive)))
