"""A worker's grandchildren do not outlive the worker: elrun SIGKILLs whatever is left in a
worker's process group when the worker exits, whether it failed, was stopped or succeeded."""
import os

import harness
from harness import ElrunTestCase


@harness.elrun_only("torchrun leaves grandchildren running (#110065)")
class GrandchildrenTest(ElrunTestCase):

    def test_grandchild_killed_after_another_worker_fails(self):
        # Rank 0 starts a grandchild, reports, lets rank 1 go and waits; rank 1 then fails.
        script = r'''
if [ "$LOCAL_RANK" = 1 ]; then read x < "$OUT_DIR/go"; exit 1; fi
sleep 300 </dev/null >/dev/null 2>&1 &
echo "$$ $!" > "$READY"
echo go > "$OUT_DIR/go"
wait
'''
        self.mkfifo("go")
        fifo = self.ready_fifo()
        proc = self.start(["--nproc-per-node", "2"] + self.sh_file(script),
                          env=self.env(READY=fifo.path))
        (line,) = fifo.read_lines(1, proc)
        fds = harness.Pidfds([int(p) for p in line.split()])
        self.addCleanup(fds.close)
        result = self.finish(proc)
        self.assertExit(result, 1)
        alive = fds.wait_all_dead(harness.DEATH_TIMEOUT_S)
        self.assertEqual(alive, [], "expected rank 0 and its grandchild (%s) dead after rank 1 "
                         "failed; still running: %s" % (line, harness.describe(alive)))

    def test_grandchild_killed_when_its_worker_exits_while_job_runs(self):
        # Rank 0 starts a grandchild and exits 0 at once. Rank 1 keeps the job running until the
        # test writes to the "finish" FIFO, so the grandchild must die while elrun still runs.
        script = r'''
if [ "$LOCAL_RANK" = 1 ]; then echo "rank1 $$" > "$READY"; read x < "$OUT_DIR/finish"; exit 0; fi
sleep 300 </dev/null >/dev/null 2>&1 &
echo "rank0 $!" > "$READY"
exit 0
'''
        finish = self.ready_fifo("finish")  # Held open read-write: writing never blocks.
        fifo = self.ready_fifo()
        proc = self.start(["--nproc-per-node", "2"] + self.sh_file(script),
                          env=self.env(READY=fifo.path))
        ready = dict(line.split() for line in fifo.read_lines(2, proc))
        grandchild = int(ready["rank0"])
        alive = harness.wait_dead([grandchild], harness.DEATH_TIMEOUT_S)
        still_running = proc.poll() is None
        os.write(finish.fd, b"done\n")
        result = self.finish(proc)
        self.assertTrue(still_running, "expected the job to be running while rank 1 waits\n%s"
                        % result)
        self.assertEqual(alive, [], "expected rank 0's grandchild SIGKILLed as soon as rank 0 "
                         "exited, while the job runs; still running: %s"
                         % harness.describe(alive))
        self.assertExit(result, 0)


if __name__ == "__main__":
    harness.main()
