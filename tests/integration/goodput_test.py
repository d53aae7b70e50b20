"""Goodput measured by elrun (--report-file, the end-of-job line) and the fault injector
(--inject-faults, --inject-seed). A worker killed at a step costs the time from the kill to the
first beat past the step it reached (the highest any worker beat: data-parallel workers move in
lockstep), and the steps between the checkpoint and that step are counted as redone; a stopped
worker is found by --worker-timeout and its fault includes the hang; a plan and a seed always
draw the same schedule; kill-agent takes elrun's workers with it; a bad plan or an unwritable
report path is a usage error before any worker starts."""
import os
import re
import signal

import harness
from harness import ElrunTestCase, worker

RESUME_WORKER = worker("resume_worker.py")


@harness.elrun_only("torchrun has no goodput report or fault injector")
class GoodputTest(ElrunTestCase):

    def run_resume(self, extra, steps=40, every=10, pause=0.05, nproc=2):
        os.makedirs(self.path("job"), exist_ok=True)
        return self.elrun(["--nproc-per-node", str(nproc), "--report-file", self.path("report.json")] + extra +
                          [RESUME_WORKER, self.path("job"), str(steps), str(every), str(pause)])

    def test_a_killed_worker_costs_the_time_to_pass_its_step_and_the_steps_redone(self):
        result = self.run_resume(["--max-restarts", "2", "--inject-faults", "kill-worker:1@step15"])
        self.assertExit(result, 0)
        report = self.read_json("report.json")
        self.assertEqual(report["step"], 39, result)
        self.assertEqual(len(report["faults"]), 1, report)
        fault = report["faults"][0]
        self.assertEqual(fault["kind"], "kill-worker (injected)")
        self.assertRegex(fault["detail"], r"^kill -9 of local rank 1 \(pid \d+\) at \d+\.\d s "
                         r"\(--inject-faults kill-worker:1@step15\); then worker failed: local_rank 1 .*SIGKILL")
        self.assertTrue(fault["recovered"])
        self.assertGreaterEqual(fault["step_before"], 15)
        # The restarted group starts from the last checkpoint: everything after it is redone.
        resumed = [int(s) for s in re.findall(r"rank 0 starts at step (\d+)", result.out)]
        self.assertEqual(len(resumed), 2, result)
        self.assertEqual(fault["steps_redone"], fault["step_before"] - resumed[1] + 1, report)
        self.assertGreater(fault["recovery_s"], 0)
        self.assertLess(fault["recovery_s"], 10)
        self.assertAlmostEqual(report["lost_s"], fault["recovery_s"], places=6)
        self.assertAlmostEqual(report["goodput"],
                               (report["wall_s"] - report["first_step_s"] - report["lost_s"]) / report["wall_s"],
                               places=6)
        self.assertIn("[elrun] warning: FAULT INJECTION IS ON", result.err)
        self.assertRegex(result.err, r"\[elrun\] warning: goodput \d+\.\d%% of \d+\.\d s \(first step after "
                         r"\d\.\d\d s; 1 fault cost \d+\.\d\d s: kill-worker \(injected\) at \d+\.\d s: "
                         r"\d+\.\d\d s, %d steps redone\)" % fault["steps_redone"])

    def test_a_stopped_worker_is_a_hang_found_by_the_worker_timeout(self):
        result = self.run_resume(["--max-restarts", "1", "--worker-timeout", "1",
                                  "--inject-faults", "stop-worker:0@step8"], steps=20, nproc=1)
        self.assertExit(result, 0)
        (fault,) = self.read_json("report.json")["faults"]
        self.assertEqual(fault["kind"], "stop-worker (injected)")
        self.assertIn("SIGSTOP of local rank 0", fault["detail"])
        self.assertIn("; then hang: rank 0 (local_rank 0", fault["detail"])
        self.assertTrue(fault["recovered"])
        # No stack grace for a stopped worker: it cannot print them. The timeout, then the restart.
        self.assertRegex(result.err, r"\[elrun\] error: rank 0 \(local_rank 0, [^)]*\): no progress for 1\.\d s "
                         r"\(--worker-timeout 1\): .*; it is stopped \(SIGSTOP or a tracer\), so no stacks; "
                         r"killing it")
        self.assertNotIn("asking for its stacks", result.err)
        self.assertGreater(fault["recovery_s"], 1.0)
        self.assertLess(fault["recovery_s"], 6.0)

    def test_a_plan_and_a_seed_draw_the_same_schedule(self):
        def schedule(seed):
            result = self.elrun(["--inject-faults", "kill-worker@100-900s,kill-worker@every10-90s",
                                 "--inject-seed", str(seed), "--no-python", "true"])
            self.assertExit(result, 0)
            (line,) = re.findall(r"FAULT INJECTION IS ON: .*", result.err)
            return line
        first = schedule(11)
        self.assertRegex(first, r"kill-worker@100-900s: at \d+\.\d s; kill-worker@every10-90s: at \d+\.\d s and "
                         r"again after each")
        self.assertEqual(schedule(11), first)
        self.assertNotEqual(schedule(12), first)

    def test_kill_agent_takes_the_workers_with_elrun(self):
        result = self.run_resume(["--inject-faults", "kill-agent@step5"], steps=400)
        self.assertEqual(result.rc, -signal.SIGKILL, result)
        self.assertIn("fault injection (kill-agent@step5): kill -9 of this elrun", result.err)
        pids = [int(p) for p in re.findall(r"pid (\d+)", result.out)]
        self.assertEqual(len(pids), 2, result)
        self.assertAllDead(pids, what="workers of the killed elrun")

    def test_a_job_without_faults_or_beats(self):
        result = self.run_resume([], steps=10, every=5, nproc=1)
        self.assertExit(result, 0)
        self.assertNotIn("goodput", result.err)  # A clean job says it at INFO only.
        report = self.read_json("report.json")
        self.assertEqual(report["faults"], [])
        self.assertEqual(report["step"], 9)
        self.assertEqual(report["lost_s"], 0)
        self.assertGreater(report["goodput"], 0)
        result = self.elrun(["--report-file", self.path("silent.json"), "--no-python", "true"],
                            env=self.env(LOGLEVEL="INFO"))
        self.assertExit(result, 0)
        self.assertIn("goodput: unknown, no worker heartbeat", result.err)
        self.assertIsNone(self.read_json("silent.json")["goodput"])

    def test_bad_plans_and_report_paths_stop_before_any_worker(self):
        marker = self.path("ran")
        for args, message in (
                (["--inject-faults", "kill-worker@soon"], "--inject-faults=kill-worker@soon: 'kill-worker@soon': "
                                                          "a time needs its unit, s"),
                (["--inject-faults", "nuke@1s"], "'nuke@1s': unknown kind"),
                (["--inject-seed", "-1"], "--inject-seed=-1: expected an integer"),
                (["--report-file", self.path("missing", "r.json")], "--report-file: cannot write")):
            result = self.elrun(args + ["--no-python", "touch", marker])
            self.assertNotEqual(result.rc, 0, result)
            self.assertIn(message, result.err)
            self.assertEqual(len(result.err.strip().splitlines()), 1, result)
            self.assertFalse(os.path.exists(marker), result)


if __name__ == "__main__":
    harness.main()
