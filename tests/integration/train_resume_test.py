"""elrun-train under elrun survives SIGKILLed workers and resumes exactly: rank 1 killed mid-epoch,
the group restarted from the last checkpoint, then rank 0 (the checkpoint writer) killed in the
restarted attempt and the group restarted again; the job ends with the same steps, parameters,
BatchNorm running statistics and momentum buffers (within 1e-6) as an uninterrupted run.

The job: FashionNet with SyncBatchNorm on the seeded synthetic data set, 2 workers with one
intra-op thread each, batch 32 per rank (64 steps per epoch), a checkpoint every 16 steps, cut
at step 80 of 2 epochs so that the resumed attempts also cross an epoch boundary. Each run
takes 10 to 25 s on 2 idle cores (three LibTorch start-ups in the killed one).
"""
import os

import harness
import train_harness
from train_harness import RESUMED_LINE, TrainTestCase, train_args

WORKERS = 2
BATCH = 32
STEPS_PER_EPOCH = train_harness.SYNTHETIC_TRAIN_SAMPLES // (WORKERS * BATCH)  # 64
CHECKPOINT_EVERY = 16
MAX_STEPS = STEPS_PER_EPOCH + CHECKPOINT_EVERY  # 80: epoch 0, then 16 steps into epoch 1.
# The first kill: once rank 0 has reported this step, the step-16 checkpoint is on disk and
# the rest of epoch 0 (steps 25 to 64, some 4 s) leaves plenty of time to kill mid-epoch.
FIRST_KILL_AFTER = CHECKPOINT_EVERY + 8


class TrainResumeTest(TrainTestCase):

    def job_args(self, name):
        return train_args(batch_size=BATCH, epochs=2, max_steps=MAX_STEPS,
                          checkpoint_every=CHECKPOINT_EVERY,
                          checkpoint_dir=self.path(name, "checkpoints"),
                          metrics_file=self.path(name, "metrics.jsonl"),
                          step_times_file=self.path(name, "steps.tsv"))

    def logged_steps(self, name, rank):
        """The steps in rank `rank`'s --step-times-file of job `name`, which must have one header."""
        with open(self.path(name, "steps.tsv.%d" % rank)) as f:
            lines = [line.split("\t")[0] for line in f]
        self.assertEqual(lines[:1], ["step"], "expected %s/steps.tsv.%d to start with its header"
                         % (name, rank))
        return [int(step) for step in lines[1:]]

    def wait_for_step(self, run, after, step, what):
        """Waits until rank 0 reports `step` (or later) in output after offset `after` of its
        stdout. Fails if the job ends first, or if the first step seen is already past epoch 0
        (the kill would land too late to test a mid-epoch resume)."""
        def latest():
            found = train_harness.STEP_LINE.findall(run.stdout[after:])
            return int(found[-1][1]) if found else 0
        run.pump(lambda: latest() >= step, train_harness.TRAIN_TIMEOUT_S)
        seen = latest()
        if seen < step:
            self.fail("expected rank 0 to reach step %d before %s; %s\n%s"
                      % (step, what, "the job exited first" if run.rc is not None
                         else "it did not within %.0f s" % train_harness.TRAIN_TIMEOUT_S,
                         run.result()))
        if seen >= STEPS_PER_EPOCH:
            self.fail("the job was already at step %d (epoch 0 ends at step %d) when the test "
                      "could %s: the kill would land too late to test a mid-epoch resume "
                      "(machine too slow to read the progress lines?)\n%s"
                      % (seen, STEPS_PER_EPOCH, what, run.result()))
        return seen

    def resumes(self, stdout):
        """rank 0's "resumed from" lines: [(epoch, step, sample, written_by, now)]."""
        return [tuple(int(x) for x in m[1:]) for m in RESUMED_LINE.findall(stdout)]

    def test_sigkilled_workers_resume_to_the_uninterrupted_result(self):
        os.makedirs(self.path("reference"))
        os.makedirs(self.path("killed"))
        reference = self.run_job(["--standalone", "--nproc_per_node", str(WORKERS)],
                                 self.job_args("reference"), "the uninterrupted reference run")
        self.assertEqual(self.resumes(reference.out), [],
                         "expected the reference run to start from scratch\n%s" % reference)
        ref_end = train_harness.end_record(self.path("reference", "metrics.jsonl"))
        self.assertEqual(ref_end["steps"], MAX_STEPS,
                         "expected the reference run to stop at --max-steps %d" % MAX_STEPS)

        checkpoint = self.path("killed", "checkpoints", "checkpoint.pt")
        run = self.launch(["--standalone", "--nproc_per_node", str(WORKERS), "--max_restarts",
                           "2", "--log_dir", self.path("logs")], self.job_args("killed"))

        # Attempt 0: kill rank 1 mid-epoch, after the first checkpoint.
        seen_1 = self.wait_for_step(run, 0, FIRST_KILL_AFTER, "kill rank 1")
        self.assertTrue(os.path.exists(checkpoint),
                        "expected %s once rank 0 reported step %d" % (checkpoint, seen_1))
        pid_1 = self.kill_worker(run, 1)

        # Attempt 1 resumes; once it has written a checkpoint of its own, kill rank 0 (the
        # checkpoint writer) mid-epoch too.
        run.pump(lambda: len(self.resumes(run.stdout)) >= 1, train_harness.TRAIN_TIMEOUT_S)
        resumes = self.resumes(run.stdout)
        self.assertEqual(len(resumes), 1, "expected rank 0 of the restarted attempt to print "
                         "\"resumed from ...\" after rank 1 was killed at step %d\n%s"
                         % (seen_1, run.result()))
        step_1 = resumes[0][1]
        offset = RESUMED_LINE.search(run.stdout).end()
        seen_2 = self.wait_for_step(run, offset, step_1 + CHECKPOINT_EVERY + 4, "kill rank 0")
        pid_0 = self.kill_worker(run, 0)

        result = self.wait_exit(run)
        self.assertExit(result, 0)
        resumes = self.resumes(result.out)
        self.assertEqual(len(resumes), 2, "expected two resumes, one per restart\n%s" % result)
        step_2 = resumes[1][1]

        # Both resumes were mid-epoch 0, from a checkpoint that the attempt before wrote: step 16
        # or later, then a later one (periodic, or rank 0's save when SIGTERMed after rank 1 died).
        for (epoch, step, sample, written_by, now), low, seen in (
                (resumes[0], CHECKPOINT_EVERY, seen_1), (resumes[1], step_1 + 1, seen_2)):
            self.assertTrue(low <= step < STEPS_PER_EPOCH and epoch == 0 and 0 < sample
                            < train_harness.SYNTHETIC_TRAIN_SAMPLES,
                            "expected a resume mid-epoch 0 (steps %d to %d) after the kill at "
                            "step %d; got epoch %d, step %d, sample %d (a kill that landed too "
                            "late?)\n%s" % (low, STEPS_PER_EPOCH - 1, seen, epoch, step, sample,
                                            result))
            self.assertEqual(sample, step * WORKERS * BATCH,
                             "expected the resumed sample position to be step x world x batch")
            self.assertEqual((written_by, now), (WORKERS, WORKERS),
                             "expected checkpoints written by and resumed under 2 ranks")

        if not harness.TORCHRUN_REFERENCE:
            # elrun's restart warnings name the killed workers and their signal.
            for attempt, rank, pid in ((0, 1, pid_1), (1, 0, pid_0)):
                self.assertRegex(result.err, r"attempt %d failed: local_rank %d \(rank %d, pid %d\)"
                                 r" ended with [^;\n]*SIGKILL[^;\n]*; restarting the worker group "
                                 r"\(restart %d of 2\)" % (attempt, rank, rank, pid, attempt + 1),
                                 "expected elrun to report the SIGKILLed worker of attempt %d"
                                 % attempt)
            runs = os.listdir(self.path("logs"))
            self.assertEqual(len(runs), 1, "expected one run directory under --log-dir")
            self.assertEqual(sorted(os.listdir(self.path("logs", runs[0]))),
                             ["attempt_0", "attempt_1", "attempt_2"],
                             "expected exactly three attempts (two restarts)")

        # Every rank's step times: the reference's once each; the killed run's appended by each
        # attempt, going back only to a step it resumed at, and complete.
        resumed_at = {resume[1] for resume in resumes}
        for rank in range(WORKERS):
            self.assertEqual(self.logged_steps("reference", rank), list(range(MAX_STEPS)))
            steps = self.logged_steps("killed", rank)
            for before, step in zip(steps, steps[1:]):
                self.assertTrue(step == before + 1 or step in resumed_at,
                                "rank %d's step times go from step %d to %d; expected the next "
                                "step or a resume step (%s)" % (rank, before, step, sorted(resumed_at)))
            self.assertEqual((set(steps), steps[-1]), (set(range(MAX_STEPS)), MAX_STEPS - 1),
                             "expected rank %d's step times to cover every step" % rank)

        end = train_harness.end_record(self.path("killed", "metrics.jsonl"))
        self.assertEqual(end["steps"], ref_end["steps"],
                         "expected the restarted job to end at the reference's step count")
        state, worst = self.assertSameCheckpoint(
            self.path("reference", "checkpoints", "checkpoint.pt"), checkpoint,
            "the final checkpoints of the uninterrupted run and of the run resumed at steps "
            "%d and %d" % (step_1, step_2))
        self.assertEqual((state["step"], state["epoch"], state["samples_seen"]),
                         (MAX_STEPS, 1, CHECKPOINT_EVERY * WORKERS * BATCH),
                         "expected the final checkpoint to hold step 80, 16 steps into epoch 1")
        print("resumed at steps %d and %d (killed after %d and %d); largest difference %.3g; "
              "reference %.1f s, killed run %.1f s"
              % (step_1, step_2, seen_1, seen_2, worst, reference.elapsed, result.elapsed))


if __name__ == "__main__":
    harness.main()
