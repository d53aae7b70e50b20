"""kill -9 of elrun itself: no worker and no grandchild may survive it (guardian + PDEATHSIG)."""
import signal

import harness
from harness import ElrunTestCase

# Starts a grandchild, reports "<local_rank> <pid> <grandchild pid>" on $READY, then waits.
WORKER = r'''
TRAP
sleep 300 </dev/null >/dev/null 2>&1 &
echo "$LOCAL_RANK $$ $!" > "$READY"
wait
'''


@harness.elrun_only("torchrun leaves its workers running when it is SIGKILLed (#76287)")
class Kill9Test(ElrunTestCase):

    def kill_launcher_and_check(self, args, script, nproc=2):
        fifo = self.ready_fifo()
        proc = self.start(["--nproc-per-node", str(nproc)] + args + self.sh_file(script),
                          env=self.env(READY=fifo.path))
        ready = fifo.read_lines(nproc, proc)
        pids = [int(p) for line in ready for p in line.split()[1:]]
        self.assertEqual(len(pids), 2 * nproc, "expected a worker and a grandchild per rank")
        fds = harness.Pidfds(pids)
        self.addCleanup(fds.close)
        proc.kill()  # SIGKILL; proc is our unreaped child.
        proc.wait(timeout=harness.DEATH_TIMEOUT_S)
        self.assertEqual(proc.returncode, -signal.SIGKILL)
        alive = fds.wait_all_dead(harness.DEATH_TIMEOUT_S)
        self.assertEqual(alive, [], "expected every worker and grandchild %s dead within %.0f s "
                         "of kill -9 of elrun; still running: %s"
                         % (pids, harness.DEATH_TIMEOUT_S, harness.describe(alive)))

    def test_kill9_leaves_no_worker_or_grandchild(self):
        self.kill_launcher_and_check([], WORKER.replace("TRAP", ""))

    def test_kill9_with_sigterm_ignoring_workers(self):
        self.kill_launcher_and_check(["--shutdown-timeout", "1"],
                                     WORKER.replace("TRAP", "trap '' TERM"))

    def test_kill9_with_tee_pipes(self):
        self.kill_launcher_and_check(["--tee", "3", "--log-dir", self.path("logs")],
                                     WORKER.replace("TRAP", "echo started"))


if __name__ == "__main__":
    harness.main()
