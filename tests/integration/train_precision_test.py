"""elrun-train --precision under elrun, 2 workers, on the byte-level GPT: bf16 and fp16 with
ddp (autocast), zero2 (autocast) and fsdp (units gathered in it) end within 5% of fp32's
validation loss after 30 AdamW steps; fp16 scales the loss dynamically. A forced overflow (an
initial loss scale of 1e8, far too large for fp16 gradients) skips steps on every rank and halves
the scale at each, exactly; the scale is checkpointed, and a resumed run goes on with it instead
of starting the overflows again. Each job: 2 blocks of width 64, 64-byte sequences, 16 per rank,
1 thread per worker; 2 to 13 s each on 2 idle cores (fp16 on a CPU without fp16 arithmetic is
the slowest).
"""
import re

import harness
import train_harness
from train_harness import TrainTestCase

DONE_LINE = re.compile(r"^done: (\d+) steps, .* validation loss ([\d.]+), ", re.M)
FP16_LINE = re.compile(r"^fp16: (\d+) of (\d+) steps skipped for inf/NaN gradients, loss scale (\S+)$",
                       re.M)


class PrecisionTest(TrainTestCase):

    def gpt_args(self, name, precision, strategy, max_steps=30, **options):
        settings = dict(model="gpt", dataset=None, sync_bn=None, strategy=strategy, optimizer="adamw",
                        lr=3e-3, weight_decay=0.01, warmup_fraction=0.001, gpt_layers=2, gpt_width=64,
                        gpt_heads=4, gpt_context=64, batch_size=16, eval_samples=128, sample_bytes=0,
                        precision=precision)
        settings.update(options)
        return self.fresh_job(name, max_steps=max_steps, **settings)

    def gpt_job(self, name, precision, strategy, max_steps=30, **options):
        args = self.gpt_args(name, precision, strategy, max_steps, **options)
        result = self.run_job(["--standalone", "--nproc_per_node", "2"], args,
                              "the %s %s job" % (precision, strategy))
        done = DONE_LINE.search(result.out)
        self.assertIsNotNone(done, "expected the GPT summary line\n%s" % result)
        end = train_harness.end_record(self.path(name, "metrics.jsonl"))
        self.assertEqual(end["precision"], precision)
        return result, float(done.group(2)), end

    def test_bf16_and_fp16_end_near_fp32_with_every_kind_of_strategy(self):
        _, fp32, _ = self.gpt_job("fp32", "fp32", "ddp")
        self.assertLess(fp32, 3.5, "expected 30 steps to learn")
        for precision, strategy in (("bf16", "ddp"), ("fp16", "zero2"), ("bf16", "fsdp"),
                                    ("fp16", "fsdp")):
            result, loss, end = self.gpt_job("%s_%s" % (precision, strategy), precision, strategy)
            self.assertLess(abs(loss - fp32), 0.05 * fp32,
                            "%s %s: validation loss %.4f, fp32's %.4f" % (precision, strategy, loss, fp32))
            if precision == "fp16":
                self.assertIsNotNone(FP16_LINE.search(result.out), "expected the fp16 line\n%s" % result)
                self.assertIn("loss_scale", end)
            else:
                self.assertNotIn("loss_scale", end)

    def test_forced_overflow_skips_steps_halves_the_scale_and_resumes_it(self):
        result, loss, end = self.gpt_job("overflow", "fp16", "zero2", loss_scale=1e8)
        skipped = end["skipped_steps"]
        self.assertGreater(skipped, 0, "expected a scale of 1e8 to overflow fp16 gradients")
        self.assertLess(skipped, 30, "expected the scale to come down far enough to train")
        # No growth within 2000 steps: each skipped step halved the scale, nothing else moved it.
        self.assertEqual(end["loss_scale"], 1e8 / 2 ** skipped)
        state = train_harness.load_checkpoint(self.path("overflow", "checkpoints", "model.pt"))
        self.assertEqual(state["loss_scale"], 1e8 / 2 ** skipped)
        self.assertGreater(state["loss_scale_growth_tracker"], 0)  # Finite steps since the last skip.
        self.assertLessEqual(state["loss_scale_growth_tracker"], 30 - skipped)

        args = self.gpt_args("resumed", "fp16", "zero2", max_steps=40, loss_scale=1e8)
        args[args.index("--checkpoint-dir") + 1] = self.path("overflow", "checkpoints")
        resumed = self.run_job(["--standalone", "--nproc_per_node", "2"], args, "the resumed fp16 job")
        line = FP16_LINE.search(resumed.out)
        self.assertIsNotNone(line, "expected the fp16 line\n%s" % resumed)
        self.assertEqual((int(line.group(1)), int(line.group(2))), (0, 10),
                         "expected the resumed run to keep the checkpointed scale, not overflow again")
        self.assertAlmostEqual(float(line.group(3)), 1e8 / 2 ** skipped, delta=1e8 / 2 ** skipped * 1e-5)


if __name__ == "__main__":
    harness.main()
