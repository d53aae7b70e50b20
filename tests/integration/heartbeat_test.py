"""Progress heartbeats (--worker-timeout, --worker-start-timeout, ELRUN_HEARTBEAT_FILE). A
worker that beats and then stops making progress is asked for its stacks (SIGUSR1, printed by
faulthandler through launcher/python/elrun_heartbeat.py), killed, and the group restarts within
--max-restarts; the failure's cause says "no progress for N s". One that never beats is judged
only by --worker-start-timeout. Steady beats are never judged. Junk on the FIFO and beats naming
other processes are dropped with a warning. elrun-train beats every step. The FIFO is gone
after the job."""
import glob
import os
import re
import subprocess

import harness
from harness import ElrunTestCase, worker

HEARTBEAT_WORKER = worker("heartbeat_worker.py")


@harness.elrun_only("torchrun has no progress heartbeats")
class HeartbeatTest(ElrunTestCase):

    def run_job(self, limits, args, max_restarts=0):
        before = set(glob.glob(os.path.join(self.tmp, "elrun_heartbeat_*")))
        result = self.elrun(limits + ["--nproc-per-node", "1", "--max-restarts", str(max_restarts),
                                      HEARTBEAT_WORKER] + args, env=self.env(TMPDIR=self.tmp))
        self.assertEqual(set(glob.glob(os.path.join(self.tmp, "elrun_heartbeat_*"))), before,
                         "expected the heartbeat FIFO removed after the job\n%s" % result)
        return result

    def test_a_worker_that_stops_beating_is_dumped_killed_and_restarted(self):
        result = self.run_job(["--worker-timeout", "1"], ["hang-first"], max_restarts=1)
        self.assertExit(result, 0)
        (pid,) = re.findall(r"hanging after step 2 pid (\d+)", result.out)
        self.assertIn("attempt 1 done", result.out)
        self.assertRegex(result.err, r"\[elrun\] error: rank 0 \(local_rank 0, host [^,]+, pid %s\): no progress for "
                         r"1\.\d s \(--worker-timeout 1\): "
                         r"its last heartbeat, step 2 \(\d+\.\d ms\), came \d+\.\d s after it started; asking for "
                         r"its stacks \(signal 10\), then killing it" % pid)
        # faulthandler's dump, in the worker's own stderr.
        self.assertIn("most recent call first", result.err, result)
        self.assertIn('heartbeat_worker.py", line', result.err, result)
        self.assertRegex(result.err, r"attempt 0 failed: local_rank 0 \(rank 0, pid %s\) ended with signal SIGKILL "
                         r"\(9\) \(heartbeat watchdog: no progress for 1\.\d s" % pid)
        self.assertLess(result.elapsed, 60)

    def test_with_no_restarts_left_the_report_says_no_progress(self):
        result = self.run_job(["--worker-timeout", "1"], ["hang-first"])
        self.assertExit(result, 1)
        self.assertIn("exitcode  : -9 (SIGKILL), by elrun's heartbeat watchdog: no progress for", result.err, result)

    def test_a_worker_that_never_beats_is_judged_only_by_the_start_timeout(self):
        result = self.run_job(["--worker-start-timeout", "1"], ["silent", "30"])
        self.assertExit(result, 1)
        self.assertRegex(result.err, r"no progress for 1\.\d s \(--worker-start-timeout 1\): no heartbeat since it "
                         r"started; killing it")
        self.assertLess(result.elapsed, 20)
        # Without a start timeout a worker that never beats is never judged.
        result = self.run_job(["--worker-timeout", "1"], ["silent", "3"])
        self.assertExit(result, 0)
        self.assertIn("silent done", result.out)
        self.assertNotIn("no progress", result.err)

    def test_steady_beats_are_never_judged(self):
        result = self.run_job(["--worker-timeout", "1", "--worker-start-timeout", "20"], ["steady"])
        self.assertExit(result, 0)
        self.assertNotIn("no progress", result.err)

    def test_junk_and_beats_for_other_processes_are_dropped(self):
        victim = subprocess.Popen(["sleep", "300"])
        self.addCleanup(victim.wait)
        self.addCleanup(victim.kill)
        result = self.run_job(["--worker-timeout", "5"], ["junk", str(victim.pid)])
        self.assertExit(result, 0)
        self.assertIn("heartbeat: dropped 'not a beat': bad pid",
                      result.err, result)
        self.assertIn("dropped a line over 256 bytes", result.err, result)
        self.assertIn("heartbeat: dropped '%d 1 2.0': pid %d is not a worker of this job" % (victim.pid, victim.pid),
                      result.err, result)
        self.assertIsNone(victim.poll())

    def test_a_straggler_is_named_with_its_pace_and_in_the_end_summary(self):
        before = set(glob.glob(os.path.join(self.tmp, "elrun_heartbeat_*")))
        # The default --straggler-factor (1.5): a script that beats is judged without any flag.
        result = self.elrun(["--nproc-per-node", "3", HEARTBEAT_WORKER, "pace"],
                            env=self.env(TMPDIR=self.tmp))
        self.assertExit(result, 0)
        self.assertEqual(set(glob.glob(os.path.join(self.tmp, "elrun_heartbeat_*"))), before)
        self.assertRegex(result.err, r"\[elrun\] warning: rank 2 \(local_rank 2, host [^,]+, pid \d+\) is a straggler: "
                         r"median step 1[23]\d\.\d ms over its last \d+ beats, [3-4]\.\d\dx the job's median of "
                         r"3\d\.\d ms \(--straggler-factor 1\.5\)")
        self.assertNotRegex(result.err, r"rank [01] \(local_rank [01].*straggler")
        self.assertRegex(result.err, r"\[elrun\] warning: slowest ranks by median step time: rank 2 \(local_rank 2, "
                         r"host [^,]+, pid \d+\) 1[23]\d\.\d ms, ")

    def test_straggler_factor_0_opens_no_heartbeat_channel(self):
        result = self.elrun(["--straggler-factor", "0", "--no-python", "sh", "-c",
                             'echo "hb=${ELRUN_HEARTBEAT_FILE-unset}"'])
        self.assertExit(result, 0)
        self.assertIn("hb=unset", result.out, result)

    def test_kill9_of_elrun_leaves_no_heartbeat_fifo(self):
        # The guardian, which outlives elrun, removes the FIFO elrun made.
        proc = self.start(["--log-dir", self.path("logs"), HEARTBEAT_WORKER, "silent", "60"],
                          env=self.env(TMPDIR=self.tmp))
        self.assertIn("silent pid", proc.stdout.readline().decode())  # Workers start after the FIFO.
        fifos = lambda: glob.glob(os.path.join(self.tmp, "elrun_heartbeat_*"))  # noqa: E731
        self.assertEqual(len(fifos()), 1, "expected elrun to make its heartbeat FIFO")
        guardians = [pid for pid in harness.descendants(proc.pid)
                     if open("/proc/%d/comm" % pid).read().strip() == "elrun-guardian"]
        self.assertEqual(len(guardians), 1)
        proc.kill()
        proc.wait()
        self.assertEqual(harness.wait_dead(guardians), [], "expected the guardian to exit after elrun's death")
        self.assertEqual(fifos(), [], "expected the guardian to remove the FIFO after elrun's kill -9")

    def test_bad_limits_are_one_line_and_exit_2(self):
        for option, value in (("--worker-timeout", "-1"), ("--worker-timeout", "0"), ("--worker-timeout", "soon"),
                              ("--straggler-factor", "1"), ("--straggler-factor", "fast")):
            result = self.elrun([option, value, "--nproc-per-node", "1"] + harness.sh("true"))
            self.assertExit(result, 2)
            self.assertEqual(len(result.err.strip().splitlines()), 1, result)
            self.assertIn(option, result.err)


if __name__ == "__main__":
    harness.main()
