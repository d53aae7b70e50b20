"""Signals sent to elrun: forwarded to every worker's process group, elrun exits 128+signo, and a
worker that ignores SIGTERM is SIGKILLed after --shutdown-timeout."""
import os
import signal
import time

import harness
from harness import ElrunTestCase

# Starts a grandchild, reports "<local_rank> <pid> <grandchild pid>" on $READY and waits.
SLEEPER = r'''
sleep 300 </dev/null >/dev/null 2>&1 &
echo "$LOCAL_RANK $$ $!" > "$READY"
wait
'''

# SLEEPER that traps SIG (substituted below): records its name in got.<local_rank>, exits 0.
TRAPPING = "trap 'echo SIG > \"$OUT_DIR/got.$LOCAL_RANK\"; exit 0' SIG\n" + SLEEPER

# SLEEPER that ignores SIGTERM (and so does its grandchild).
IGNORING = "trap '' TERM\n" + SLEEPER


@harness.elrun_only("torchrun 1.13 answers signals with SIGTERM to workers and exit 1")
class SignalsTest(ElrunTestCase):

    def start_ready(self, args, nproc=2, preexec_fn=None):
        fifo = self.ready_fifo()
        proc = self.start(["--nproc-per-node", str(nproc)] + args, env=self.env(READY=fifo.path),
                          preexec_fn=preexec_fn)
        ready = fifo.read_lines(nproc, proc)
        pids = [int(p) for line in ready for p in line.split()[1:]]
        fds = harness.Pidfds(pids)
        self.addCleanup(fds.close)
        return proc, pids, fds

    def check_forwarded(self, signo, extra_args=(), preexec_fn=None):
        name = signal.Signals(signo).name[3:]  # "TERM"
        proc, pids, fds = self.start_ready(list(extra_args) +
                                           self.sh_file(TRAPPING.replace("SIG", name)),
                                           preexec_fn=preexec_fn)
        os.kill(proc.pid, signo)  # proc is our unreaped child: the pid is still elrun's.
        result = self.finish(proc, timeout=15)
        self.assertExit(result, 128 + signo)
        for rank in (0, 1):
            path = self.path("got.%d" % rank)
            self.assertTrue(os.path.exists(path), "expected worker %d to receive SIG%s\n%s"
                            % (rank, name, result))
            self.assertEqual(self.read_text(path).strip(), name)
        alive = fds.wait_all_dead(harness.DEATH_TIMEOUT_S)
        self.assertEqual(alive, [], "expected workers and grandchildren %s dead after SIG%s; "
                         "still running: %s" % (pids, name, harness.describe(alive)))

    def test_workers_start_with_empty_signal_mask(self):
        # elrun watches signals with signalfd, which needs them blocked; a worker must not
        # inherit that mask (it could then never be stopped by SIGTERM), nor ignore the signals
        # elrun forwards or handles. (Bazel leaves glibc's internal signals 32/33 ignored; those
        # can not be reset from Python and are not checked.)
        result = self.elrun(["--nproc-per-node", "1", "--no-python", "cat", "/proc/self/status"])
        self.assertExit(result, 0)
        fields = dict(line.split(":\t", 1) for line in result.out.splitlines() if ":\t" in line)
        self.assertEqual(int(fields.get("SigBlk", "-1"), 16), 0,
                         "expected the worker to start with no blocked signals, got SigBlk %s"
                         % fields.get("SigBlk"))
        ignored = int(fields.get("SigIgn", "-1"), 16)
        for signo in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                      signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE, signal.SIGCHLD):
            self.assertFalse(ignored & (1 << (signo - 1)),
                             "expected %s not to be ignored in the worker, got SigIgn %s"
                             % (signal.Signals(signo).name, fields.get("SigIgn")))

    def test_forwarded_even_when_elrun_inherited_it_ignored(self):
        # A background job of a script starts with SIGINT and SIGQUIT ignored; elrun still
        # handles and forwards them, and its workers do not inherit the ignore.
        def ignore_int_and_quit():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGQUIT, signal.SIG_IGN)
        self.check_forwarded(signal.SIGQUIT, preexec_fn=ignore_int_and_quit)

    def test_sigterm_forwarded_exit_143(self):
        self.check_forwarded(signal.SIGTERM)

    def test_sigint_forwarded_exit_130(self):
        # The grandchild of a non-interactive sh ignores SIGINT: elrun must SIGKILL what is left
        # of the worker's process group once the worker exits.
        self.check_forwarded(signal.SIGINT)

    def test_sighup_forwarded_exit_129(self):
        self.check_forwarded(signal.SIGHUP)

    def test_sigquit_forwarded_exit_131(self):
        self.check_forwarded(signal.SIGQUIT)

    def test_signals_to_handle_adds_sigusr1(self):
        self.check_forwarded(signal.SIGUSR1, ["--signals-to-handle", "SIGUSR1,SIGTERM"])

    def test_signal_ends_job_even_with_restarts_left(self):
        # Workers die of the forwarded SIGTERM (no trap): that is the job being stopped, not a
        # failure to restart from.
        script = 'echo "$TORCHELASTIC_RESTART_COUNT" >> "$OUT_DIR/starts.$LOCAL_RANK"\n' + SLEEPER
        proc, pids, fds = self.start_ready(["--max-restarts", "3"] + self.sh_file(script))
        os.kill(proc.pid, signal.SIGTERM)
        result = self.finish(proc, timeout=15)
        self.assertExit(result, 143)
        for rank in (0, 1):
            self.assertEqual(self.read_text(self.path("starts.%d" % rank)), "0\n",
                             "expected no restart after SIGTERM to elrun (--max-restarts 3)")
        alive = fds.wait_all_dead(harness.DEATH_TIMEOUT_S)
        self.assertEqual(alive, [], "still running: %s" % harness.describe(alive))

    def test_sigterm_ignoring_worker_killed_after_shutdown_timeout(self):
        proc, pids, fds = self.start_ready(["--shutdown-timeout", "1"] + self.sh_file(IGNORING))
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        result = self.finish(proc, timeout=15)
        took = time.monotonic() - sent
        self.assertExit(result, 143)
        self.assertGreaterEqual(took, 0.9, "expected elrun to give workers --shutdown-timeout 1 "
                                "s after SIGTERM before SIGKILL; it exited after %.2f s" % took)
        self.assertLess(took, 8.0, "expected SIGKILL about 1 s after SIGTERM "
                        "(--shutdown-timeout 1, not the 30 s default); took %.2f s" % took)
        alive = fds.wait_all_dead(harness.DEATH_TIMEOUT_S)
        self.assertEqual(alive, [], "expected the SIGTERM-ignoring workers and grandchildren "
                         "SIGKILLed; still running: %s" % harness.describe(alive))

    def test_failure_stops_sigterm_ignoring_survivor_after_shutdown_timeout(self):
        # Rank 0 ignores SIGTERM and reports ready; rank 1 then fails. elrun must SIGKILL rank 0
        # about --shutdown-timeout after its SIGTERM and exit 1.
        script = ('if [ "$LOCAL_RANK" = 1 ]; then read x < "$OUT_DIR/go"; exit 1; fi\n' +
                  IGNORING.replace('echo "$LOCAL_RANK $$ $!" > "$READY"',
                                   'echo "$LOCAL_RANK $$ $!" > "$READY"; echo go > "$OUT_DIR/go"'))
        self.mkfifo("go")
        fifo = self.ready_fifo()
        proc = self.start(["--nproc-per-node", "2", "--shutdown-timeout", "1"] +
                          self.sh_file(script), env=self.env(READY=fifo.path))
        (line,) = fifo.read_lines(1, proc)
        pids = [int(p) for p in line.split()[1:]]
        fds = harness.Pidfds(pids)
        self.addCleanup(fds.close)
        result = self.finish(proc, timeout=15)
        self.assertExit(result, 1)
        self.assertGreaterEqual(result.elapsed, 0.9, "expected elrun to wait --shutdown-timeout "
                                "1 s for the SIGTERM-ignoring survivor\n%s" % result)
        self.assertLess(result.elapsed, 8.0, "expected SIGKILL after about 1 s\n%s" % result)
        alive = fds.wait_all_dead(harness.DEATH_TIMEOUT_S)
        self.assertEqual(alive, [], "expected the survivor and its grandchild SIGKILLed; still "
                         "running: %s" % harness.describe(alive))


if __name__ == "__main__":
    harness.main()
