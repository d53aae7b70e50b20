"""elrun-train's checkpoints on a disk that fills up: the checkpoint directory is a tmpfs the test
mounts with room for one checkpoint and a half, so the first save fits and the second runs out of
space while the first is still there. The save fails with a clear error, the job trains on, its
end fails with that cause; the checkpoint saved before stays current, byte for byte what an
uninterrupted run saved at that step, no partial or temporary file is left, and a resume loads it.
Once with ddp (checkpoint.pt), once with fsdp (a set of shard files that LATEST publishes).

Needs root (mount); skips otherwise. Each case runs three jobs of 2 single-threaded workers.
"""
import os
import subprocess

import harness
import train_harness
from train_harness import RESUMED_LINE, TrainTestCase

CHECKPOINT_EVERY = 16
LAUNCHER = ["--nproc-per-node", "2", "--max-restarts", "0", "--monitor-interval", "0.1"]


def all_files(path):
    """Every file under path, and every directory (with a trailing /), relative to it."""
    found = []
    for root, dirs, files in os.walk(path):
        found += [os.path.relpath(os.path.join(root, d), path) + "/" for d in dirs]
        found += [os.path.relpath(os.path.join(root, f), path) for f in files]
    return sorted(found)


class FullDiskTest(TrainTestCase):

    def setUp(self):
        if os.geteuid() != 0:
            self.skipTest("mounting a size-limited tmpfs needs root")
        super().setUp()

    def small_disk(self, name, size):
        """A tmpfs of `size` bytes (whole pages) at path(name), unmounted at the end."""
        path = self.path(name)
        os.makedirs(path)
        pages = max(1, size // 4096)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%d,mode=0755" % (pages * 4096), "tmpfs", path],
                       check=True, timeout=20)
        self.addCleanup(subprocess.run, ["umount", "-l", path], timeout=20)
        return path

    def job(self, checkpoints, max_steps, strategy):
        return train_harness.train_args(max_steps=max_steps, checkpoint_every=CHECKPOINT_EVERY,
                                        checkpoint_dir=checkpoints, strategy=strategy)

    def check_full_disk(self, strategy, latest_files):
        # The reference: an uninterrupted run that ends at the first checkpoint's step.
        reference = self.path("reference")
        self.run_job(LAUNCHER, self.job(reference, CHECKPOINT_EVERY, strategy), "the reference run")
        size = sum(os.path.getsize(os.path.join(reference, f)) for f in latest_files(CHECKPOINT_EVERY)
                   if not f.endswith("/"))

        disk = self.small_disk("disk", size * 3 // 2)
        run = self.launch(LAUNCHER, self.job(disk, 3 * CHECKPOINT_EVERY, strategy))
        result = self.wait_exit(run)
        self.assertEqual(result.rc, 1, "expected the job to fail with the final save's cause\n%s" % result)
        self.assertIn("elrun-train: the checkpoint of step %d was not saved: " % (2 * CHECKPOINT_EVERY), result.err)
        self.assertIn("No space left on device; the last one saved stays current", result.err)
        self.assertIn("elrun-train: the job's final checkpoint was not saved: ", result.err)
        # Training went on past the failed save to its last step.
        steps = [int(m[1]) for m in train_harness.STEP_LINE.findall(result.out)]
        self.assertEqual(max(steps), 3 * CHECKPOINT_EVERY, result)

        # What is on the disk is the first checkpoint, whole, and nothing else.
        self.assertEqual(all_files(disk), latest_files(CHECKPOINT_EVERY),
                         "expected only the step-%d checkpoint on the full disk" % CHECKPOINT_EVERY)
        for name in [f for f in all_files(disk) if not f.endswith("/")]:
            with open(os.path.join(disk, name), "rb") as a, open(os.path.join(reference, name), "rb") as b:
                self.assertTrue(a.read() == b.read(), "expected %s to be what the uninterrupted run saved" % name)

        # A resume (the directory copied to a disk with room) starts from it and finishes.
        resumed = self.path("resumed")
        subprocess.run(["cp", "-a", disk, resumed], check=True, timeout=60)
        result = self.run_job(LAUNCHER, self.job(resumed, 3 * CHECKPOINT_EVERY, strategy), "the resumed run")
        found = RESUMED_LINE.search(result.out)
        self.assertIsNotNone(found, result)
        self.assertEqual(int(found.group(3)), CHECKPOINT_EVERY, result)

    def test_ddp_checkpoint_on_a_full_disk(self):
        self.check_full_disk("ddp", lambda step: ["checkpoint.pt"])

    def test_fsdp_shard_set_on_a_full_disk(self):
        self.check_full_disk("fsdp", lambda step: [
            "sharded/", "sharded/LATEST", "sharded/step-%d-of-2/" % step,
            "sharded/step-%d-of-2/shard-0-of-2.pt" % step, "sharded/step-%d-of-2/shard-1-of-2.pt" % step])


if __name__ == "__main__":
    harness.main()
