"""torchrun's FileTimer watchdog (TORCHELASTIC_ENABLE_FILE_TIMER=1) with torch's own
FileTimerClient. A worker whose timer expires is reaped. Its end counts as a failure whose
cause names the timer, and the group restarts within --max-restarts. elrun itself lives on,
where torchrun's agent sends itself the same SIGKILL. A request naming a process outside the
job's workers is not obeyed. The FIFO is gone after the job."""
import os
import re
import subprocess

import harness
from harness import ElrunTestCase, worker

TIMER_WORKER = worker("file_timer_worker.py")


@harness.elrun_only("torchrun's agent SIGKILLs itself after reaping a worker with an expired timer")
class WatchdogTest(ElrunTestCase):

    def run_timer_job(self, args, max_restarts):
        fifo = self.path("watchdog.fifo")
        env = self.env(TORCHELASTIC_ENABLE_FILE_TIMER="1", TORCHELASTIC_TIMER_FILE=fifo)
        result = self.elrun(["--nproc-per-node", "1", "--max-restarts", str(max_restarts),
                             TIMER_WORKER] + args, env=env)
        self.assertFalse(os.path.exists(fifo), "expected the FIFO removed after the job\n%s" % result)
        return result

    def test_an_expired_timer_reaps_the_worker_and_the_group_restarts(self):
        result = self.run_timer_job(["hang-first"], max_restarts=1)
        self.assertExit(result, 0)
        (pid,) = re.findall(r"hanging in train_step pid (\d+)", result.out)
        self.assertIn("attempt 1 done", result.out)
        why = "FileTimer watchdog: timer train_step of pid %s expired; sent SIGKILL" % pid
        self.assertIn("[elrun] error: " + why + "\n", result.err, result)
        self.assertIn("attempt 0 failed: local_rank 0 (rank 0, pid %s) ended with signal SIGKILL (9) (%s); "
                      "restarting" % (pid, why), result.err, result)
        self.assertLess(result.elapsed, 60, "expected the hung step ended about 1 s after it began")

    def test_with_no_restarts_left_the_report_names_the_timer(self):
        result = self.run_timer_job(["hang-first"], max_restarts=0)
        self.assertExit(result, 1)
        self.assertIn("exitcode  : -9 (SIGKILL), by elrun's FileTimer watchdog: timer train_step of "
                      "pid ", result.err, result)

    def test_a_request_for_a_process_outside_the_job_is_not_obeyed(self):
        victim = subprocess.Popen(["sleep", "300"])
        self.addCleanup(victim.wait)
        self.addCleanup(victim.kill)
        result = self.run_timer_job(["name-pid", str(victim.pid)], max_restarts=0)
        self.assertExit(result, 0)
        self.assertIn("named pid %d" % victim.pid, result.out)
        self.assertIn("FileTimer watchdog: timer not_mine of pid %d expired, but pid %d is not in a "
                      "worker's process group of this job: not signalled" % (victim.pid, victim.pid),
                      result.err, result)
        self.assertIsNone(victim.poll(), "expected the process the request named to live on")

    def test_a_timer_file_without_the_switch_is_passed_on_and_nothing_serves_it(self):
        # As in torchrun: TORCHELASTIC_TIMER_FILE alone reaches the workers; no FIFO is made.
        fifo = self.path("unserved.fifo")
        result = self.elrun(["--nproc-per-node", "1"] + harness.sh('echo "timer=$TORCHELASTIC_TIMER_FILE"'),
                            env=self.env(TORCHELASTIC_TIMER_FILE=fifo))
        self.assertExit(result, 0)
        self.assertEqual(result.out, "timer=%s\n" % fifo)
        self.assertFalse(os.path.exists(fifo))

if __name__ == "__main__":
    harness.main()
