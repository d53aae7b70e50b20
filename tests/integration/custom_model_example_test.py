"""The README's worked example (examples/custom_model): a user's own LibTorch module, its blocks
wrapped with FullyShard, trained under elrun on 2 workers; it learns, writes a sharded checkpoint
and a consolidated model.pt that Python's torch.load opens under the plain model's names, and
resumes on 3 workers from where the 2 left off. Two jobs of a few seconds each.
"""
import os
import re

import harness

STEP_LINE = re.compile(r"^step (\d+) loss ([\d.]+)$", re.M)
DONE_LINE = re.compile(r"^done: (\d+) steps on (\d+) ranks$", re.M)


class CustomModelExampleTest(harness.ElrunTestCase):

    def run_example(self, workers, steps):
        example = harness.bazel_binary("examples/custom_model", "train_custom_model", "ELRUN_EXAMPLE_BIN")
        env = self.env(OMP_NUM_THREADS="1")
        result = self.elrun(["--standalone", "--nproc-per-node", str(workers), "--no-python"] + example
                            + [self.path("ckpt"), str(steps)], env=env)
        self.assertExit(result, 0)
        done = DONE_LINE.search(result.out)
        self.assertIsNotNone(done, "expected the example's last line\n%s" % result)
        self.assertEqual((int(done.group(1)), int(done.group(2))), (steps, workers))
        return {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(result.out)}

    def test_learns_exports_for_python_and_resumes_at_another_world_size(self):
        first = self.run_example(2, 160)
        self.assertEqual(sorted(first), [0, 50, 100, 150])
        self.assertLess(first[150], 0.5 * first[0], "expected the loss to fall: %s" % first)

        import torch  # The checkpoint as a Python user reads it.
        state = torch.load(os.path.join(self.path("ckpt"), "model.pt"))
        self.assertEqual(state["step"], 160)
        model = state["model"]
        expected = {"embed.weight": (64, 16), "embed.bias": (64,), "head.weight": (4, 64),
                    "head.bias": (4,)}
        for block in range(4):
            expected.update({"block%d.norm.weight" % block: (64,), "block%d.norm.bias" % block: (64,),
                             "block%d.up.weight" % block: (256, 64), "block%d.up.bias" % block: (256,),
                             "block%d.down.weight" % block: (64, 256), "block%d.down.bias" % block: (64,)})
        self.assertEqual({name: tuple(t.shape) for name, t in model.items()}, expected)

        resumed = self.run_example(3, 260)
        self.assertEqual(sorted(resumed), [200, 250], "expected the 3 workers to go on from step 160")
        self.assertLess(resumed[250], 0.5 * first[0])


if __name__ == "__main__":
    harness.main()
