"""elrun --keep-survivors with elrun-train: a SIGKILLed worker is restarted alone, the survivor
keeps its process and regroups in place, and the replacement takes the survivor's live state
instead of a checkpoint. Rank 1 killed mid-epoch, then rank 0 (the store host and checkpoint
writer) killed in the regrouped job; the job ends with the same steps, parameters, BatchNorm
running statistics and momentum buffers (within 1e-6) as an uninterrupted run, with no step redone
and none skipped. The sharded strategies (fsdp, zero1) rebuild a killed rank's shards from its
neighbour's in-memory copy: every rank goes back to the copies' step and the job ends where the
uninterrupted run does; without copies (--shard-copy-every 0) the group restarts from its
checkpoint as without the option.

The job is train_resume_test's: FashionNet with SyncBatchNorm on the seeded synthetic data set,
2 single-threaded workers, batch 32 per rank (64 steps per epoch), a checkpoint every 16 steps,
cut at step 80 of 2 epochs.
"""
import os

import harness
import train_harness
from train_harness import REGROUPED_LINE, RESUMED_LINE, SHARDED_REGROUP_LINE, RegroupTestCase

WORKERS = 2
MAX_STEPS = RegroupTestCase.MAX_STEPS  # 80


@harness.elrun_only("torchrun restarts every worker after a failure")
class KeepSurvivorsTest(RegroupTestCase):

    def test_killed_workers_regroup_in_place_to_the_uninterrupted_result(self):
        os.makedirs(self.path("reference"))
        os.makedirs(self.path("killed"))
        self.run_job(["--standalone", "--nproc-per-node", str(WORKERS)], self.job_args("reference"),
                     "the uninterrupted reference run")
        run = self.launch(["--standalone", "--nproc-per-node", str(WORKERS), "--max-restarts", "2",
                           "--keep-survivors", "--log-dir", self.path("logs")], self.job_args("killed"))

        # Kill rank 1 mid-epoch 0; rank 0 must survive it.
        self.wait_for(run, "rank 0 to report step 20", lambda: self.latest_step(run) >= 20)
        before = self.workers(run)
        self.assertEqual(sorted(before), [0, 1], "expected the workers of ranks 0 and 1\n%s" % run.result())
        pid_1 = self.kill_worker(run, 1)
        self.wait_for(run, "a regroup after rank 1 was killed", lambda: REGROUPED_LINE.search(run.stdout))
        after = self.workers(run)
        self.assertEqual(after.get(0), before[0], "expected rank 0's worker (pid %d) to survive the kill of rank 1 "
                         "and regroup in place; the workers now: %s\n%s" % (before[0], after, run.result()))
        others = set(harness.descendants(run.proc.pid)) - {before[0], pid_1}
        self.assertTrue(any(os.path.basename(train_harness.train_command()[0]) in harness.cmdline(pid)
                            for pid in others), "expected a new elrun-train worker for rank 1\n%s" % run.result())

        # Then the survivor itself: rank 0 hosts the store and writes the checkpoints.
        offset = REGROUPED_LINE.search(run.stdout).end()
        first = int(REGROUPED_LINE.search(run.stdout).group(5))
        self.wait_for(run, "rank 0 to report step %d" % (first + 10),
                      lambda: self.latest_step(run, offset) >= first + 10)
        pid_0 = self.kill_worker(run, 0)
        result = self.wait_exit(run)
        self.assertExit(result, 0)
        self.assertEqual(RESUMED_LINE.findall(result.out), [], "expected no resume from disk\n%s" % result)

        regroups = [tuple(int(x) for x in m) for m in REGROUPED_LINE.findall(result.out)]
        self.assertEqual(len(regroups), 2, "expected two regroups, one per kill\n%s" % result)
        for generation, (gen, ranks, restarted, source, step, size, ms) in enumerate(regroups, 1):
            self.assertEqual((gen, ranks, restarted), (generation, WORKERS, 1), result)
            # Rank 1 was killed first, then rank 0: the state came from the other one.
            self.assertEqual(source, generation - 1, "expected the survivor's state (rank %d) in regroup %d"
                             % (generation - 1, generation))
            self.assertGreater(size, 0)
        self.assertGreaterEqual(regroups[0][4], 20)
        self.assertGreater(regroups[1][4], regroups[0][4])
        for attempt, rank, pid in ((0, 1, pid_1), (1, 0, pid_0)):
            self.assertRegex(result.err, r"attempt %d failed: local_rank %d \(rank %d, pid %d\) ended with [^;\n]*"
                             r"SIGKILL[^;\n]*; restarting local rank %d alone, 1 worker regroups in place "
                             r"\(restart %d of 2\)" % (attempt, rank, rank, pid, rank, attempt + 1), result)
        self.assertRegex(result.err, r"elrun-train: rank 0: .*; regrouping in place")
        self.assertEqual(sorted(os.listdir(os.path.join(self.path("logs"), os.listdir(self.path("logs"))[0]))),
                         ["attempt_0", "attempt_1", "attempt_2"], "expected one attempt per restart")

        # No step redone, none skipped: each rank's step times (its processes appended to one
        # file) go up by one from 0 to the last step.
        for rank in range(WORKERS):
            self.assertEqual(self.logged_steps("killed", rank), list(range(MAX_STEPS)),
                             "expected rank %d to log every step once" % rank)
        state, worst = self.assertSameCheckpoint(
            self.path("reference", "checkpoints", "checkpoint.pt"), self.path("killed", "checkpoints", "checkpoint.pt"),
            "the final checkpoints of the uninterrupted run and of the run regrouped in place twice")
        self.assertEqual(state["step"], MAX_STEPS)
        print("regrouped at steps %d and %d in %d and %d ms; largest difference %.3g"
              % (regroups[0][4], regroups[1][4], regroups[0][6], regroups[1][6], worst))

    def test_a_stopped_worker_is_killed_alone_and_the_survivor_regroups(self):
        os.makedirs(self.path("stopped"))
        run = self.launch(["--standalone", "--nproc-per-node", str(WORKERS), "--max-restarts", "1",
                           "--keep-survivors", "--worker-timeout", "1", "--inject-faults", "stop-worker:1@step20"],
                          self.job_args("stopped", max_steps=40))
        self.wait_for(run, "rank 0 to report step 10", lambda: self.latest_step(run) >= 10)
        survivor = self.workers(run)[0]
        self.wait_for(run, "a regroup after rank 1 was stopped", lambda: REGROUPED_LINE.search(run.stdout))
        self.assertEqual(self.workers(run).get(0), survivor, "expected rank 0 (pid %d) to survive\n%s"
                         % (survivor, run.result()))
        result = self.wait_exit(run)
        self.assertExit(result, 0)
        self.assertRegex(result.err, r"rank 1 \(local_rank 1, [^)]*\): no progress for 1\.\d s \(--worker-timeout 1\)"
                         r".*; it is stopped \(SIGSTOP or a tracer\), so no stacks; killing it")
        self.assertNotRegex(result.err, r"rank 0 \(local_rank 0, [^)]*\): no progress.*killing it")
        self.assertRegex(result.err, r"restarting local rank 1 alone, 1 worker regroups in place")
        self.assertEqual(self.logged_steps("stopped", 0), list(range(40)))

    def test_sharded_strategies_rebuild_a_lost_rank_from_its_neighbours_copy(self):
        # Each rank copies its neighbour's shards every 10 steps; the kill at step 25 loses rank
        # k's shards, so both ranks go back to step 20's set and redo the steps since.
        for strategy, killed in (("fsdp", 1), ("zero1", 0)):
            with self.subTest(strategy=strategy):
                reference, name = "reference_" + strategy, "killed_" + strategy
                os.makedirs(self.path(reference))
                os.makedirs(self.path(name))
                options = dict(strategy=strategy, sync_bn=None, optimizer="adam", lr=0.002, shard_copy_every=10)
                self.run_job(["--standalone", "--nproc-per-node", str(WORKERS)], self.job_args(reference, **options),
                             "the uninterrupted %s run" % strategy)
                result = self.run_job(["--standalone", "--nproc-per-node", str(WORKERS), "--max-restarts", "1",
                                       "--keep-survivors", "--inject-faults", "kill-worker:%d@step25" % killed],
                                      self.job_args(name, **options), "the %s run with rank %d killed"
                                      % (strategy, killed))
                self.assertEqual(RESUMED_LINE.findall(result.out), [], "expected no resume from disk\n%s" % result)
                self.assertRegex(result.err, r"restarting local rank %d alone, 1 worker regroups in place "
                                 r"\(restart 1 of 1\)" % killed)
                regroups = SHARDED_REGROUP_LINE.findall(result.out)
                self.assertEqual(len(regroups), 1, "expected one regroup from the copies\n%s" % result)
                gen, ranks, restarted, count, step, live, copies, size, back, ms = regroups[0]
                self.assertEqual((gen, ranks, restarted, count, live, copies), ("1", "2", "1", "2", "0", "2"), result)
                self.assertGreater(int(size), 0)
                # The copies of step 20, or of 30 when the kill came late on a loaded machine.
                step, back = int(step), int(back)
                self.assertIn(step, (20, 30), result)
                self.assertGreater(back, step, result)
                self.assertGreaterEqual(back, 25, result)
                # Each rank's processes logged steps 0 to where they stopped (the survivor: the step
                # it came back from), then from the copies' step to the end once more.
                for rank in range(WORKERS):
                    logged = self.logged_steps(name, rank)
                    reached = next((i for i in range(1, len(logged)) if logged[i] < logged[i - 1]), len(logged))
                    self.assertEqual(logged, list(range(reached)) + list(range(step, MAX_STEPS)),
                                     "expected rank %d to log steps 0-%d, then %d-%d" % (rank, reached - 1, step,
                                                                                        MAX_STEPS - 1))
                    self.assertGreaterEqual(reached, 25)
                    if rank != killed:
                        self.assertEqual(reached, back, "expected the survivor to come back from step %d" % back)
                _, worst = self.assertSameCheckpoint(
                    self.path(reference, "checkpoints", "model.pt"), self.path(name, "checkpoints", "model.pt"),
                    "the consolidated models of the uninterrupted %s run and of the one rebuilt from copies" % strategy)
                print("%s: rank %d killed at step 25, regrouped from step %d's copies in %s ms (%s bytes); largest "
                      "difference %.3g" % (strategy, killed, step, ms, size, worst))

    def test_without_copies_a_lost_shard_restarts_the_group_from_its_checkpoint(self):
        os.makedirs(self.path("zero1"))
        run = self.launch(["--standalone", "--nproc-per-node", str(WORKERS), "--max-restarts", "2",
                           "--keep-survivors", "--inject-faults", "kill-worker:1@step20"],
                          self.job_args("zero1", strategy="zero1", max_steps=40, sync_bn=None, shard_copy_every=0))
        result = self.wait_exit(run)
        self.assertExit(result, 0)
        self.assertRegex(result.err, r"restarting local rank 1 alone, 1 worker regroups in place \(restart 1 of 2\)")
        self.assertRegex(result.err, r"regroup: no whole set of shards is held in memory by the new group; elrun "
                         r"restarts the group from its checkpoint")
        self.assertRegex(result.err, r"attempt 1 failed: .*; restarting the worker group \(restart 2 of 2\)")
        resumed = RESUMED_LINE.findall(result.out)
        self.assertEqual([int(r[2]) for r in resumed], [16], "expected one resume from step 16's checkpoint\n%s"
                         % result)
        self.assertIsNone(SHARDED_REGROUP_LINE.search(result.out), result)

if __name__ == "__main__":
    harness.main()
