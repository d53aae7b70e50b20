"""elrun-train runs unchanged under elrun and under torchrun (torch 2.11's, through
tests/support/torchrun_compat.py): the same seeded job ends in the same checkpoint under both.
And gradient accumulation: 1 worker x 2 micro-batches of 32 ends where 2 workers x 32 do.

Jobs are short (40 steps of batch 32 per rank on the seeded synthetic data set, one intra-op
thread per worker); most of each run is LibTorch's and torchrun's start-up: 5 to 15 s on 2 idle
cores.
"""

import harness
import train_harness
from train_harness import TrainTestCase

STEPS = 40


class TrainLaunchersTest(TrainTestCase):

    def job(self, name, **options):
        return self.fresh_job(name, STEPS, **options)

    def checkpoint(self, name):
        return self.path(name, "checkpoints", "checkpoint.pt")

    def end(self, name):
        end = train_harness.end_record(self.path(name, "metrics.jsonl"))
        self.assertEqual(end["steps"], STEPS, "expected the %s job to stop at --max-steps %d"
                         % (name, STEPS))
        return end

    @harness.elrun_only("compares elrun itself with torchrun")
    def test_same_checkpoint_under_elrun_and_torchrun(self):
        elrun = self.run_job(["--standalone", "--nproc_per_node", "2"], self.job("elrun"),
                             "elrun-train under elrun")
        torchrun = self.run_job(["--standalone", "--nproc_per_node", "2"], self.job("torchrun"),
                                "elrun-train under torchrun", torchrun=True)
        for result in (elrun, torchrun):
            self.assertRegex(result.out, r"(?m)^done: %d steps" % STEPS,
                             "expected rank 0's summary line on the launcher's stdout\n%s"
                             % result)
        ends = self.end("elrun"), self.end("torchrun")
        self.assertEqual([e["world_size"] for e in ends], [2, 2],
                         "expected both jobs to run with WORLD_SIZE 2")
        self.assertEqual(ends[0]["test_accuracy"], ends[1]["test_accuracy"],
                         "expected the same test accuracy under both launchers")
        _, worst = self.assertSameCheckpoint(self.checkpoint("elrun"), self.checkpoint("torchrun"),
                                             "the checkpoints of the job under elrun and torchrun")
        print("largest difference %.3g; elrun %.1f s, torchrun %.1f s"
              % (worst, elrun.elapsed, torchrun.elapsed))

    def test_accumulation_over_half_the_world(self):
        # The MLP: BatchNorm would see 32-sample micro-batches in one job and 64 samples (synced)
        # in the other. Each step consumes the same 64 samples of the epoch in both jobs.
        self.run_job(["--standalone", "--nproc_per_node", "2"],
                     self.job("two", model="mlp", sync_bn=None, batch_size=32),
                     "2 workers x batch 32")
        self.run_job(["--standalone", "--nproc_per_node", "1"],
                     self.job("one", model="mlp", sync_bn=None, batch_size=64, accum_steps=2),
                     "1 worker x batch 64 in 2 micro-batches")
        self.end("two")
        self.end("one")
        _, worst = self.assertSameCheckpoint(
            self.checkpoint("two"), self.checkpoint("one"),
            "the checkpoints of 2 workers x 32 and 1 worker x 2 micro-batches of 32",
            ignore=("world_size",))
        print("largest difference %.3g" % worst)


if __name__ == "__main__":
    harness.main()
