"""elrun-train's --model gpt under elrun: a byte-level GPT trained on the Python standard library's
modules, sharded (--strategy fsdp) over 2 workers, learns (its validation loss ends far below
ln 256, the loss of knowing nothing), reports perplexity = exp(validation loss) and tokens/s,
writes a sample of text, and exports a consolidated model.pt that Python's torch.load opens with
every parameter of the model and its AdamW state. A run checkpointed on 2 workers resumes on 3.

The job: 2 blocks of width 64 (4 heads), 64-byte sequences, 16 per rank, AdamW; 1 intra-op
thread per worker. Each test runs 1 or 2 LibTorch jobs: 15 to 30 s on 2 idle cores.
"""
import math
import re

import harness
import train_harness
from train_harness import RESUMED_LINE, TrainTestCase

DONE_LINE = re.compile(r"^done: (\d+) steps, .* \((\d+) tokens/s\), validation loss ([\d.]+), "
                       r"perplexity ([\d.]+) \((\d+) sequences\)$", re.M)
SAMPLE_LINE = re.compile(r"^sample \((\d+) prompt bytes, then (\d+) sampled\):$", re.M)
CORPUS_LINE = re.compile(r"^text corpus (\S+): (\d+) training files \((\d+) bytes\), (\d+) "
                         r"validation files \((\d+) bytes\)$", re.M)


def gpt_args(test, name, **options):
    settings = dict(model="gpt", dataset=None, sync_bn=None, strategy="fsdp", optimizer="adamw",
                    lr=3e-3, weight_decay=0.01, warmup_fraction=0.001, gpt_layers=2, gpt_width=64,
                    gpt_heads=4, gpt_context=64, batch_size=16, log_every=10, eval_samples=256,
                    sample_bytes=80)
    settings.update(options)
    return test.fresh_job(name, **settings)


class GptTest(TrainTestCase):

    def test_fsdp_gpt_learns_reports_samples_and_exports(self):
        result = self.run_job(["--standalone", "--nproc_per_node", "2"],
                              gpt_args(self, "gpt", max_steps=60), "the 2-worker GPT job")
        corpus = CORPUS_LINE.search(result.out)
        self.assertIsNotNone(corpus, "expected rank 0 to name the text corpus\n%s" % result)
        self.assertTrue(corpus.group(1).startswith("/usr/lib/python3."), corpus.group(0))
        self.assertGreater(int(corpus.group(3)), 1000000, "expected megabytes of training text")
        done = DONE_LINE.search(result.out)
        self.assertIsNotNone(done, "expected the GPT summary line\n%s" % result)
        steps, tokens_per_s, loss, perplexity, sequences = (
            int(done.group(1)), int(done.group(2)), float(done.group(3)), float(done.group(4)),
            int(done.group(5)))
        self.assertEqual((steps, sequences), (60, 256))
        self.assertGreater(tokens_per_s, 0)
        # Knowing nothing is ln 256 = 5.55 nats per byte; byte frequencies alone give ~3.3.
        self.assertLess(loss, 3.3, "expected 60 AdamW steps to learn more than byte frequencies"
                        "\n%s" % result)
        self.assertAlmostEqual(perplexity, math.exp(loss), delta=perplexity * 1e-3)
        end = train_harness.end_record(self.path("gpt", "metrics.jsonl"))
        self.assertEqual((end["strategy"], end["optimizer"], end["world_size"]),
                         ("fsdp", "adamw", 2))
        self.assertAlmostEqual(end["validation_loss"], loss, delta=1e-3)
        self.assertNotIn("test_accuracy", end)
        sample = SAMPLE_LINE.search(result.out)
        self.assertIsNotNone(sample, "expected rank 0 to print a sample\n%s" % result)
        self.assertEqual(int(sample.group(2)), 80)
        self.assertEqual(len(SAMPLE_LINE.findall(result.out)), 1, "expected one sample (rank 0)")

        state = train_harness.load_checkpoint(self.path("gpt", "checkpoints", "model.pt"))
        self.assertEqual(state["optimizer_kind"], "adamw")
        names = sorted(state["model"])
        self.assertIn("block1.qkv.weight", names)
        self.assertIn("head.out.weight", names)
        self.assertEqual(tuple(state["model"]["embed.tokens.weight"].shape), (256, 64))
        params = sum(t.numel() for t in state["model"].values())
        # embed 256*64 + 64*64, 2 blocks of 4*64 + 64*192+192 + 64*64+64 + 64*256+256 + 256*64+64,
        # head 2*64 + 64*256.
        self.assertEqual(params, 20480 + 2 * 49984 + 16512)
        self.assertEqual(sorted(state["optimizer"]),
                         sorted("%s.%s" % (n, f) for n in names
                                for f in ("exp_avg", "exp_avg_sq", "step")))

    def test_checkpoint_of_2_workers_resumes_on_3(self):
        self.run_job(["--standalone", "--nproc_per_node", "2"],
                     gpt_args(self, "two", max_steps=8, sample_bytes=0, eval_samples=16),
                     "the first GPT job, 2 workers")
        args = gpt_args(self, "three", max_steps=12, sample_bytes=0, eval_samples=16)
        # The second job continues from the first's checkpoints.
        args[args.index("--checkpoint-dir") + 1] = self.path("two", "checkpoints")
        result = self.run_job(["--standalone", "--nproc_per_node", "3"], args,
                              "the resumed GPT job, 3 workers")
        resumed = RESUMED_LINE.findall(result.out)
        self.assertEqual([tuple(int(x) for x in r[1:]) for r in resumed],
                         [(0, 8, 8 * 16 * 2, 2, 3)],
                         "expected one resume at step 8 (256 sequences), written by 2 ranks, now 3"
                         "\n%s" % result)
        done = DONE_LINE.search(result.out)
        self.assertIsNotNone(done, "expected the GPT summary line\n%s" % result)
        self.assertEqual(int(done.group(1)), 12)


if __name__ == "__main__":
    harness.main()
