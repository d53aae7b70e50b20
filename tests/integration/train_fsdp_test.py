"""elrun-train's sharded strategies under elrun: FULL_SHARD (--strategy fsdp) resumed from its
sharded checkpoint after a SIGKILLed worker ends in the same consolidated model.pt as an
uninterrupted run (Adam with rank 0 killed, SGD with rank 1 killed), and a sharded checkpoint
moves between world sizes (2 -> 3 -> 1 workers) without changing a bit of the state it holds.

The job: FashionNet with SyncBatchNorm on the seeded synthetic data set, one intra-op thread per
worker. FSDP wraps each of its six layers as a unit, flat-sharded across the ranks with padding
(conv1's 320 and bn1's 64 parameters are not multiples of 3), so resharding cuts padded units at
other boundaries.

Sharded strategies checkpoint into <dir>/sharded/step-<S>-of-<K>/shard-<k>-of-<K>.pt (published
by rank 0 through <dir>/sharded/LATEST) and export a consolidated <dir>/model.pt at the end: that
file is what these tests compare (parameters, BatchNorm buffers, and Adam's exp_avg, exp_avg_sq
and step or SGD's momentum of every parameter).

A load-only job is one whose --epochs are already done when it resumes: it trains no step and
only re-exports. (--max-steps equal to the saved step would not do: elrun-train checks
--max-steps after each step, so a job resumed at step S with --max-steps S still trains step
S + 1.) Each test runs 2 to 5 LibTorch jobs: 20 to 35 s on 2 idle cores.
"""
import os
import shutil

import harness
import train_harness
from train_harness import RESUMED_LINE, TrainTestCase, train_args

SAMPLES = train_harness.SYNTHETIC_TRAIN_SAMPLES  # 4096


def resumes(stdout):
    """rank 0's "resumed from" lines: [(epoch, step, sample, written_by, now)]."""
    return [tuple(int(x) for x in m[1:]) for m in RESUMED_LINE.findall(stdout)]


class FsdpTestCase(TrainTestCase):

    def fsdp_args(self, name, optimizer="adam", **options):
        """The FULL_SHARD job (Adam at its default lr 1e-3, or SGD at 0.02 with momentum 0.9)
        writing into <tmp>/<name>/ (checkpoints/, metrics.jsonl)."""
        os.makedirs(self.path(name), exist_ok=True)
        settings = dict(strategy="fsdp", optimizer=optimizer,
                        lr=None if optimizer == "adam" else 0.02,
                        checkpoint_dir=self.path(name, "checkpoints"),
                        metrics_file=self.path(name, "metrics.jsonl"))
        settings.update(options)
        return train_args(**settings)

    def latest(self, name):
        """The step directory <name>/checkpoints/sharded/LATEST names, or None."""
        try:
            with open(self.path(name, "checkpoints", "sharded", "LATEST")) as f:
                return f.read().strip()
        except FileNotFoundError:
            return None

    def assertShardSet(self, name, step, shards):
        """Expects LATEST to name step-<step>-of-<shards> holding exactly its shard files."""
        step_dir = "step-%d-of-%d" % (step, shards)
        self.assertEqual(self.latest(name), step_dir, "expected %s's sharded/LATEST to name the "
                         "final shard set" % name)
        self.assertEqual(sorted(os.listdir(self.path(name, "checkpoints", "sharded", step_dir))),
                         sorted("shard-%d-of-%d.pt" % (k, shards) for k in range(shards)),
                         "expected one shard file per rank in %s" % step_dir)

    def model(self, name):
        return self.path(name, "checkpoints", "model.pt")

    def assertOptimizerState(self, state, what, kind="adam"):
        """Guards against a vacuous comparison: every parameter has its optimizer state (Adam:
        "<param>.exp_avg", ".exp_avg_sq", ".step"; SGD: its momentum buffer as "<param>")."""
        self.assertEqual(state.get("optimizer_kind"), kind, "expected %s state in %s"
                         % (kind, what))
        params = [k for k in state["model"] if not k.endswith(("running_mean", "running_var",
                                                                "num_batches_tracked"))]
        self.assertTrue(params, "expected parameters in %s" % what)
        fields = ("exp_avg", "exp_avg_sq", "step") if kind == "adam" else ("",)
        expected = sorted(("%s.%s" % (p, f)).rstrip(".") for p in params for f in fields)
        self.assertEqual(sorted(state["optimizer"]), expected,
                         "expected the %s state of every parameter in %s" % (kind, what))


class FullShardResumeTest(FsdpTestCase):
    """SIGKILL of a FULL_SHARD worker mid-epoch; elrun restarts the group, which resumes from the
    last published sharded checkpoint and ends where an uninterrupted run ends. Adam, rank 0
    (the one that publishes LATEST) killed; FullShardSgdResumeTest: SGD, rank 1 killed."""

    WORKERS = 2
    BATCH = 32
    STEPS_PER_EPOCH = SAMPLES // (WORKERS * BATCH)  # 64
    CHECKPOINT_EVERY = 8
    MAX_STEPS = STEPS_PER_EPOCH + 2 * CHECKPOINT_EVERY  # 80: epoch 0, then 16 steps of epoch 1.
    # Rank 0 prints step S after the step-S checkpoint is published (rank 0 writes LATEST before
    # the collective that ends every rank's save), so at this step one checkpoint is published
    # and a later one may be in progress; the rest of epoch 0 (44 steps) is time to kill in.
    KILL_AFTER = 2 * CHECKPOINT_EVERY + 4  # 20
    KILLED_RANK = 0  # The rank that publishes LATEST.
    OPTIMIZER = "adam"

    def job_args(self, name):
        return self.fsdp_args(name, optimizer=self.OPTIMIZER, batch_size=self.BATCH, epochs=2,
                              max_steps=self.MAX_STEPS, checkpoint_every=self.CHECKPOINT_EVERY)

    def test_sigkilled_full_shard_worker_resumes_to_the_uninterrupted_result(self):
        launcher = ["--standalone", "--nproc_per_node", str(self.WORKERS)]
        reference = self.run_job(launcher, self.job_args("reference"),
                                 "the uninterrupted FULL_SHARD reference run")
        self.assertEqual(resumes(reference.out), [],
                         "expected the reference run to start from scratch\n%s" % reference)
        ref_end = train_harness.end_record(self.path("reference", "metrics.jsonl"))
        self.assertEqual((ref_end["steps"], ref_end["strategy"], ref_end["world_size"]),
                         (self.MAX_STEPS, "fsdp", self.WORKERS),
                         "expected the reference run to stop at --max-steps %d under fsdp"
                         % self.MAX_STEPS)
        self.assertShardSet("reference", self.MAX_STEPS, self.WORKERS)

        run = self.launch(launcher + ["--max_restarts", "1"], self.job_args("killed"))
        seen = self.wait_for_step(run, self.KILL_AFTER)
        published = self.latest("killed")
        self.assertIsNotNone(published, "expected a published sharded checkpoint (sharded/LATEST)"
                             " once rank 0 reported step %d\n%s" % (seen, run.result()))
        published_step = int(published.split("-")[1])
        self.assertTrue(self.CHECKPOINT_EVERY <= published_step <= seen
                        and published.endswith("-of-%d" % self.WORKERS),
                        "expected LATEST to name a 2-shard checkpoint of step %d to %d; it names %s"
                        % (self.CHECKPOINT_EVERY, seen, published))
        killed_pid = self.kill_worker(run, self.KILLED_RANK)

        result = self.wait_exit(run)
        self.assertExit(result, 0)
        found = resumes(result.out)
        self.assertEqual(len(found), 1, "expected rank 0 of the restarted attempt to print one "
                         "\"resumed from ...\" line after rank %d was SIGKILLed at step %d\n%s"
                         % (self.KILLED_RANK, seen, result))
        epoch, step, sample, written_by, now = found[0]
        # The resume is from a checkpoint published before or just after the kill: at least the
        # one LATEST named when the test killed, at most the last one before rank 0's reported
        # step (a save needs every rank), and in any case mid-epoch 0.
        self.assertTrue(published_step <= step < self.STEPS_PER_EPOCH and epoch == 0
                        and step % self.CHECKPOINT_EVERY == 0,
                        "expected a resume mid-epoch 0 from a periodic checkpoint at step %d or "
                        "later (LATEST when rank %d was killed after step %d); got epoch %d, "
                        "step %d (a kill that landed too late?)\n%s"
                        % (published_step, self.KILLED_RANK, seen, epoch, step, result))
        self.assertEqual((sample, written_by, now),
                         (step * self.WORKERS * self.BATCH, self.WORKERS, self.WORKERS),
                         "expected the resumed sample position step x world x batch, and a "
                         "checkpoint written by and resumed under 2 ranks\n%s" % result)
        self.assertEqual(RESUMED_LINE.search(result.out).group(1),
                         self.path("killed", "checkpoints"),
                         "expected the resume from the job's --checkpoint-dir")
        if not harness.TORCHRUN_REFERENCE:
            self.assertRegex(result.err, r"attempt 0 failed: local_rank %d \(rank %d, pid %d\) "
                             r"ended with [^;\n]*SIGKILL[^;\n]*; restarting the worker group "
                             r"\(restart 1 of 1\)" % (self.KILLED_RANK, self.KILLED_RANK,
                                                       killed_pid),
                             "expected elrun to report the SIGKILLed worker and restart the group")

        end = train_harness.end_record(self.path("killed", "metrics.jsonl"))
        self.assertEqual(end["steps"], self.MAX_STEPS,
                         "expected the restarted job to end at the reference's step count")
        self.assertShardSet("killed", self.MAX_STEPS, self.WORKERS)
        state, worst = self.assertSameCheckpoint(
            self.model("reference"), self.model("killed"),
            "the consolidated model.pt of the uninterrupted FULL_SHARD run and of the run resumed "
            "at step %d" % step)
        self.assertOptimizerState(state, "model.pt", self.OPTIMIZER)
        self.assertEqual((state["step"], state["epoch"], state["samples_seen"],
                          state["world_size"]),
                         (self.MAX_STEPS, 1, 2 * self.CHECKPOINT_EVERY * self.WORKERS * self.BATCH,
                          self.WORKERS),
                         "expected model.pt to hold step 80, 16 steps into epoch 1, 2 ranks")
        print("%s: killed rank %d after step %d (LATEST %s); resumed at step %d; largest "
              "difference %.3g; reference %.1f s, killed run %.1f s"
              % (self.OPTIMIZER, self.KILLED_RANK, seen, published, step, worst, reference.elapsed,
                 result.elapsed))

    def wait_for_step(self, run, step):
        """Waits until rank 0 reports `step` or later. Fails if the job ends first, or if it is
        already past epoch 0 (a kill then would not test a mid-epoch resume)."""
        def latest():
            found = train_harness.STEP_LINE.findall(run.stdout)
            return int(found[-1][1]) if found else 0
        run.pump(lambda: latest() >= step, train_harness.TRAIN_TIMEOUT_S)
        seen = latest()
        if seen < step:
            self.fail("expected rank 0 to reach step %d before the kill; %s\n%s"
                      % (step, "the job exited first" if run.rc is not None
                         else "it did not within %.0f s" % train_harness.TRAIN_TIMEOUT_S,
                         run.result()))
        if seen >= self.STEPS_PER_EPOCH:
            self.fail("the job was already at step %d (epoch 0 ends at step %d) when the test "
                      "could kill a worker: the kill would land too late to test a mid-epoch "
                      "resume (machine too slow to read the progress lines?)\n%s"
                      % (seen, self.STEPS_PER_EPOCH, run.result()))
        return seen


class FullShardSgdResumeTest(FullShardResumeTest):
    """The same with SGD momentum as the sharded optimizer state, and rank 1 killed."""

    KILLED_RANK = 1
    OPTIMIZER = "sgd"


class ReshardTest(FsdpTestCase):
    """A FULL_SHARD checkpoint written by 2 ranks resumed by 3, then by 1: each load-only job
    (its --epochs already done, so it trains no step and only exports model.pt) gives exactly the
    parameters, buffers and Adam state it loaded; each training job resumes where the last
    stopped and finishes.

    Training continued under another world size is not compared with an uninterrupted run: the
    global batch of a step (world x batch samples) and so the trajectory differ."""

    BATCH = 64

    def job(self, name, workers, expect, **options):
        """Runs a FULL_SHARD job of `workers` ranks in <tmp>/<name>; returns (Result, resumes)."""
        result = self.run_job(["--standalone", "--nproc_per_node", str(workers)],
                              self.fsdp_args(name, batch_size=self.BATCH, **options),
                              "the %d-worker job %s" % (workers, name))
        self.elapsed.append("%s on %d: %.1f s" % (name, workers, result.elapsed))
        found = resumes(result.out)
        self.assertEqual(found, expect, "expected the %d-worker job %s to resume as %s (epoch, "
                         "step, sample, written by, now)\n%s" % (workers, name, expect, result))
        return result

    def copy_job(self, source, name):
        """A copy of <tmp>/<source>/checkpoints as <tmp>/<name>/checkpoints."""
        os.makedirs(self.path(name))
        shutil.copytree(self.path(source, "checkpoints"), self.path(name, "checkpoints"))

    def assertLoadedExactly(self, saved, loaded, workers):
        """model.pt of a load-only job equals the one it loaded from, bit for bit (except its
        world size); returns the loaded state."""
        state, _ = self.assertSameCheckpoint(
            self.model(saved), self.model(loaded),
            "model.pt of %s and model.pt re-exported by %d workers that loaded its sharded "
            "checkpoint" % (saved, workers), tolerance=0.0, ignore=("world_size",))
        self.assertEqual(train_harness.load_checkpoint(self.model(loaded))["world_size"], workers,
                         "expected the re-exported model.pt to record %d ranks" % workers)
        end = train_harness.end_record(self.path(loaded, "metrics.jsonl"))
        self.assertEqual(end["steps"], state["step"], "expected the load-only job to train no step")
        return state

    def test_sharded_checkpoint_moves_from_2_to_3_to_1_workers(self):
        # 2 workers train epoch 0: 32 steps of 2 x 64 samples; the export is at an epoch end.
        steps_0 = SAMPLES // (2 * self.BATCH)  # 32
        self.elapsed = []
        self.job("w2", 2, [], epochs=1, checkpoint_every=8)
        self.assertShardSet("w2", steps_0, 2)
        self.assertOptimizerState(train_harness.load_checkpoint(self.model("w2")),
                                  "w2's model.pt")

        # 3 workers load it and train no step (epoch 0 of --epochs 1 is done): exact.
        self.copy_job("w2", "w3_load")
        self.job("w3_load", 3, [(1, steps_0, 0, 2, 3)], epochs=1)
        self.assertLoadedExactly("w2", "w3_load", 3)
        self.assertShardSet("w3_load", steps_0, 3)

        # 3 workers resume the 2-rank checkpoint and train all of epoch 1, checkpointing every 4:
        # 1365 samples per rank (drop_last drops 1 of 4096), 21 batches of 64 and one of 21.
        steps_1 = steps_0 + -(-(SAMPLES // 3) // self.BATCH)  # 32 + 22 = 54
        self.job("w2", 3, [(1, steps_0, 0, 2, 3)], epochs=2, checkpoint_every=4)
        self.assertShardSet("w2", steps_1, 3)
        end = train_harness.end_record(self.path("w2", "metrics.jsonl"))
        self.assertEqual((end["steps"], end["world_size"]), (steps_1, 3),
                         "expected the 3-worker job to finish epoch 1 at step %d" % steps_1)

        # 1 worker loads the 3-rank checkpoint and trains no step: exact again.
        self.copy_job("w2", "w1_load")
        self.job("w1_load", 1, [(2, steps_1, 0, 3, 1)], epochs=2)
        self.assertLoadedExactly("w2", "w1_load", 1)
        self.assertShardSet("w1_load", steps_1, 1)

        # 1 worker resumes the 3-rank checkpoint and trains 10 steps of epoch 2.
        self.job("w2", 1, [(2, steps_1, 0, 3, 1)], epochs=3, max_steps=steps_1 + 10)
        self.assertShardSet("w2", steps_1 + 10, 1)
        state = train_harness.load_checkpoint(self.model("w2"))
        self.assertOptimizerState(state, "the final model.pt")
        self.assertEqual((state["step"], state["epoch"], state["samples_seen"],
                          state["world_size"]), (steps_1 + 10, 2, 10 * self.BATCH, 1),
                         "expected the final model.pt 10 steps into epoch 2, of 1 rank")
        print("jobs: %s" % ", ".join(self.elapsed))


if __name__ == "__main__":
    harness.main()
