"""elrun-train's kernel and transport options. --linear: the oneDNN route (the default) and ATen's
BLAS Linear train the same job to the same checkpoint, up to float rounding. --allreduce: DDP's
buckets and SyncBatchNorm's statistics through shared memory and through Gloo give the same
checkpoint, and the shared-memory segment leaves nothing in /dev/shm. Unknown values, and
device/backend pairs that cannot work, are one line on stderr and exit 2, before any rendezvous.

The jobs: 40 steps of batch 32 per worker on the seeded synthetic data set (FashionNet with
SyncBatchNorm, as the other train_* tests), ~10 s each on 2 idle cores.
"""
import glob
import json
import os
import socket
import subprocess
import time
import unittest

import harness
import train_harness
from tests.support import paths
from train_harness import TrainTestCase, train_args

STEPS = 40


def cuda_devices():
    """CUDA devices the torch environment sees (0 on a machine without a GPU or driver)."""
    out = subprocess.run([harness.PYTHON, "-c", "import torch; print(torch.cuda.device_count())"],
                         capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip() or 0)


class TrainOptionsTest(TrainTestCase):

    def job(self, name, **options):
        return self.fresh_job(name, STEPS, **options)

    def test_both_linear_kernels_train_to_the_same_checkpoint(self):
        for kernel in ("onednn", "aten"):
            self.run_job(["--standalone", "--nproc_per_node", "1"], self.job(kernel, linear=kernel),
                         "the job with --linear %s" % kernel)
            end = train_harness.end_record(self.path(kernel, "metrics.jsonl"))
            self.assertEqual((end["steps"], end["linear"]), (STEPS, kernel),
                             "expected %d steps with the %s kernel in %s" % (STEPS, kernel, end))
        # The kernels sum in different orders (relative differences ~1e-6 per product); 40 SGD
        # steps with momentum carry that into the parameters, measured up to ~2e-6.
        _, worst = self.assertSameCheckpoint(
            self.path("onednn", "checkpoints", "checkpoint.pt"),
            self.path("aten", "checkpoints", "checkpoint.pt"),
            "the checkpoints of --linear onednn and --linear aten", tolerance=1e-4)
        print("largest difference %.3g" % worst)

    def test_both_memory_formats_train_to_the_same_checkpoint_up_to_rounding(self):
        steps = 3
        for layout in ("contiguous", "channels-last"):
            self.run_job(["--standalone", "--nproc_per_node", "1"],
                         self.fresh_job(layout, steps, memory_format=layout),
                         "the job with --memory-format %s" % layout)
            end = train_harness.end_record(self.path(layout, "metrics.jsonl"))
            self.assertEqual((end["steps"], end["memory_format"]), (steps, layout),
                             "expected %d steps in %s layout in %s" % (steps, layout, end))
        # NHWC convolutions sum in another order: measured 6.6e-7 after 3 steps here; training
        # amplifies such differences step by step (docs/gpu.md), hence few steps.
        _, worst = self.assertSameCheckpoint(
            self.path("contiguous", "checkpoints", "checkpoint.pt"),
            self.path("channels-last", "checkpoints", "checkpoint.pt"),
            "the checkpoints of the two memory formats", tolerance=1e-4)
        print("largest difference %.3g" % worst)
        # Python's torch.load sees the layout the worker trained in.
        strides = subprocess.run(
            [harness.PYTHON, "-c", "import sys, torch; m = torch.load(sys.argv[1], weights_only=False)['model']; "
             "print(m['conv2.weight'].is_contiguous(memory_format=torch.channels_last))",
             self.path("channels-last", "checkpoints", "checkpoint.pt")],
            capture_output=True, text=True, timeout=120)
        self.assertEqual(strides.stdout.strip(), "True", strides.stderr)

    def test_profile_steps_write_one_trace_per_rank_that_trace_summary_reads(self):
        trace = self.path("trace.json")
        self.run_job(["--standalone", "--nproc_per_node", "2"],
                     self.fresh_job("profiled", 6, profile_steps="2:5", profile_trace=trace),
                     "the 2-worker job with --profile-steps 2:5")
        for rank in (0, 1):
            with open("%s.%d" % (trace, rank)) as f:
                events = json.load(f)["traceEvents"]
            steps = sorted(e["name"] for e in events if e.get("cat") == "user_annotation")
            self.assertEqual(steps, ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"],
                             "expected rank %d's trace to mark steps 2, 3 and 4" % rank)
            ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
            self.assertTrue({"aten::convolution", "aten::convolution_backward"} <= ops,
                            "expected the forward and backward convolutions among rank %d's operators" % rank)
        summary = subprocess.run(
            [harness.PYTHON, os.path.join(paths.HERE, "trace_summary.py"), trace + ".0",
             "--json", self.path("summary.json")], capture_output=True, text=True, timeout=120)
        self.assertEqual(summary.returncode, 0, summary.stderr)
        with open(self.path("summary.json")) as f:
            (result,) = json.load(f).values()
        self.assertEqual(result["steps"], 3)
        self.assertGreater(result["host_op_self_ms"], 0.5 * result["wall_ms"],
                           "expected the operators to fill most of a CPU step in %s" % result)
        self.assertTrue(any(name == "aten::convolution_backward" for name, _, _ in result["top_host"]),
                        "expected the backward convolution among the costliest operators in %s" % result)

    def test_shared_memory_and_gloo_all_reduce_train_to_the_same_checkpoint(self):
        segments = set(glob.glob("/dev/shm/elrun-allreduce-*"))
        for transport in ("shm", "gloo"):
            step_times = self.path(transport, "steps.tsv")
            self.run_job(["--standalone", "--nproc_per_node", "2"],
                         self.job(transport, allreduce=transport, step_times_file=step_times),
                         "the 2-worker job with --allreduce %s" % transport)
            end = train_harness.end_record(self.path(transport, "metrics.jsonl"))
            self.assertEqual((end["steps"], end["allreduce"]), (STEPS, transport),
                             "expected %d steps all-reduced through %s in %s"
                             % (STEPS, transport, end))
            quantiles = [end["step_ms_p10"], end["step_ms_p50"], end["step_ms_p90"]]
            self.assertTrue(0 < quantiles[0] <= quantiles[1] <= quantiles[2] < 1000 * end["seconds"],
                            "expected ordered, positive step-time percentiles within the run in %s" % end)
            self.assertStepTimes(step_times, end)
        # Both sum the two ranks' values rank 0 first (measured: bit-identical).
        _, worst = self.assertSameCheckpoint(
            self.path("shm", "checkpoints", "checkpoint.pt"),
            self.path("gloo", "checkpoints", "checkpoint.pt"),
            "the checkpoints of --allreduce shm and --allreduce gloo", tolerance=1e-5)
        print("largest difference %.3g" % worst)
        self.assertEqual(set(glob.glob("/dev/shm/elrun-allreduce-*")) - segments, set(),
                         "expected the job to leave no shared-memory segment behind")

    def assertStepTimes(self, path, end):
        """Every rank's --step-times-file has one line per step, CPU time within wall time, and
        rank 0's lines agree with its end record (the loop's schedstat split)."""
        for rank in (0, 1):
            with open("%s.%d" % (path, rank)) as f:
                lines = [line.rstrip("\n").split("\t") for line in f]
            self.assertEqual(lines[0], ["step", "step_ms", "cpu_ms"], "header of %s.%d" % (path, rank))
            rows = [(int(s), float(w), float(c)) for s, w, c in lines[1:]]
            self.assertEqual([r[0] for r in rows], list(range(STEPS)), "steps in %s.%d" % (path, rank))
            for step, wall_ms, cpu_ms in rows:
                self.assertTrue(0 < cpu_ms <= wall_ms + 0.01,
                                "step %d of rank %d: expected 0 < CPU %.3f ms <= wall %.3f ms"
                                % (step, rank, cpu_ms, wall_ms))
            if rank == 0:
                loop = [end["loop_cpu_s"], end["loop_runqueue_s"], end["loop_blocked_s"]]
                self.assertTrue(all(t >= 0 for t in loop) and sum(loop) <= end["seconds"] + 0.01,
                                "expected the loop's CPU, run-queue and blocked seconds to split its "
                                "time in %s" % end)
                # The steps are inside the loop; both clocks count the same thread.
                step_cpu_s = sum(r[2] for r in rows) / 1000
                self.assertTrue(0.5 * end["loop_cpu_s"] <= step_cpu_s <= end["loop_cpu_s"] + 0.05,
                                "expected the steps' CPU time %.3f s within the loop's %.3f s"
                                % (step_cpu_s, end["loop_cpu_s"]))

    def test_unwritable_step_times_file_is_one_line_and_exit_2(self):
        path = self.path("missing-directory", "steps.tsv")
        command = train_harness.train_command() + train_args(max_steps=1, step_times_file=path)
        result = subprocess.run(command, capture_output=True, text=True, timeout=60,
                                env=dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"))
        self.assertEqual(result.returncode, 2, "stderr:\n" + result.stderr)
        self.assertEqual(result.stderr.strip().splitlines(),
                         ["elrun-train: --step-times-file: cannot write %s.0" % path])

    def test_unknown_values_are_one_line_and_exit_2(self):
        for option, value, message in [
                ("linear", "mkl", "--linear=mkl: expected auto, onednn or aten"),
                ("allreduce", "tcp", "--allreduce=tcp: expected auto, shm or gloo"),
                ("strategy", "zero4", "--strategy=zero4: expected ddp, no_shard, zero1, zero2 or fsdp"),
                ("device", "tpu", "--device=tpu: expected auto, cpu or cuda"),
                ("backend", "mpi", "--backend=mpi: expected auto, gloo or nccl"),
                ("memory_format", "nhwc", "--memory-format=nhwc: expected auto, contiguous or channels-last"),
                ("profile_steps", "9:3", "--profile-steps 9:3: expected FIRST:END, step numbers with 0 <= FIRST < END"),
                ("precision", "fp8", "--precision=fp8: expected fp32, bf16 or fp16"),
                ("loss_scale", "0", "--loss-scale=0: expected a number in (0, 1e38]")]:
            command = train_harness.train_command() + train_args(max_steps=1, **{option: value})
            result = subprocess.run(command, capture_output=True, text=True, timeout=60,
                                    env=dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"))
            self.assertEqual(result.returncode, 2, "expected exit 2 for --%s %s; stderr:\n%s"
                             % (option, value, result.stderr))
            self.assertEqual(result.stderr.strip().splitlines(), ["elrun-train: " + message])
            self.assertNotIn("step", result.stdout)

    def test_options_are_checked_before_the_rendezvous(self):
        # Rank 1 of 2 with nobody hosting the store: a bad option must fail at once (exit 2), not
        # after the 120 s store timeout.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            for args, message in [
                    (["--backend", "nccl", "--device", "cpu"],
                     "--backend=nccl needs CUDA tensors: use --device cuda (or auto on a GPU machine), "
                     "or --backend gloo"),
                    (["--optimizer", "lamb"], "--optimizer=lamb: expected sgd, adam or adamw")]:
                start = time.monotonic()
                result = subprocess.run(train_harness.train_command() + train_args(max_steps=1) + args,
                                        capture_output=True, text=True, timeout=60, env=env)
                self.assertEqual(result.returncode, 2, "stderr:\n" + result.stderr)
                self.assertEqual(result.stderr.strip().splitlines(), ["elrun-train: " + message])
                self.assertLess(time.monotonic() - start, 20, "expected the error before any rendezvous")

    @unittest.skipIf(cuda_devices() > 0, "this machine has a GPU")
    def test_cuda_without_a_gpu_is_one_line_and_exit_2(self):
        for args, message in [
                (["--device", "cuda"],
                 "--device=cuda: no CUDA device is visible (0 visible); use --device cpu or auto"),
                (["--backend", "nccl"], "--backend=nccl needs CUDA tensors, and no CUDA device is visible "
                                        "(0 visible); use --backend gloo")]:
            result = subprocess.run(train_harness.train_command() + train_args(max_steps=1) + args,
                                    capture_output=True, text=True, timeout=60,
                                    env=dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"))
            self.assertEqual(result.returncode, 2, "stderr:\n" + result.stderr)
            self.assertEqual(result.stderr.strip().splitlines(), ["elrun-train: " + message])


if __name__ == "__main__":
    harness.main()
