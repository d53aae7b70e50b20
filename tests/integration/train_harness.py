"""Helpers for the integration tests of elrun-train (the LibTorch worker, //trainer/app:elrun-train):
its command line, a launcher run whose output is read as it arrives (so a test can act at a given
training step), and checkpoints compared through Python's torch.load.
Everything waits on pipes and pidfds with bounded deadlines, never with sleeps; cleanup is
harness.ElrunTestCase's (SIGKILL and reap whatever is left, fail on leftovers).
Single-threaded, like harness: unittest runs one test at a time in this process.
"""
import json
import os
import re
import select
import time

import harness
from harness import ElrunTestCase
from tests.support import paths

# One training job from start to exit, restarts included. A job of these tests takes 10 to 25 s
# on 2 idle cores (LibTorch start-up is several seconds per attempt); allow for a loaded machine.
TRAIN_TIMEOUT_S = 150.0

# Rank 0's progress line (--log-every 1 prints one per step) and its line after a resume.
STEP_LINE = re.compile(r"^epoch (\d+)\s+step (\d+)\s", re.M)
RESUMED_LINE = re.compile(r"^resumed from (\S+): epoch (\d+), step (\d+), sample (\d+) "
                          r"\(written by (\d+) ranks, now (\d+)\)", re.M)
# --keep-survivors: rank 0's line after the job regrouped around workers that kept their processes.
REGROUPED_LINE = re.compile(r"^regrouped in place \(generation (\d+)\): (\d+) ranks, (\d+) restarted; the live "
                            r"state of rank (\d+) at step (\d+) \((\d+) bytes, not from disk\), (\d+) ms after "
                            r"(?:its collective failed|this replacement started|this standby worker was called in)",
                            re.M)
# The same for the sharded strategies: the set of shard files the new group rebuilt from memory.
SHARDED_REGROUP_LINE = re.compile(
    r"^regrouped in place \(generation (\d+)\): (\d+) ranks, (\d+) restarted; the (\d+)-shard set of step (\d+) "
    r"from memory \((\d+) live, (\d+) from copies; (\d+) bytes, not from disk\)(?:; back from step (\d+))?, "
    r"(\d+) ms after (?:its collective failed|this replacement started|this standby worker was called in)", re.M)

# The data set of these tests: 4096 seeded training samples (elrun-train --dataset synthetic).
SYNTHETIC_TRAIN_SAMPLES = 4096


def train_command():
    """The command that starts elrun-train, as a list (ELRUN_TRAIN_BIN overrides)."""
    return harness.bazel_binary("trainer/app", "elrun-train", "ELRUN_TRAIN_BIN")


def torchrun_command():
    """torch 2.11's torchrun through tests/support/torchrun_compat.py, with exits
    noticed every 0.1 s instead of torchrun's default 5 s. TORCHRUN_COMPAT overrides the path."""
    path = os.environ.get("TORCHRUN_COMPAT") or paths.TORCHRUN_COMPAT
    return [harness.PYTHON, path, "--monitor_interval", "0.1"]


def train_args(**options):
    """elrun-train's arguments: the deterministic CPU job of these tests, with `options` (Python
    names, e.g. max_steps=40; True for a flag, None to drop an option) over the defaults."""
    settings = {"model": "fashionnet", "dataset": "synthetic", "sync_bn": True, "threads": 1,
                "seed": 7, "batch_size": 32, "lr": 0.02, "epochs": 1, "log_every": 1}
    settings.update(options)
    args = []
    for key, value in settings.items():
        if value is None or value is False:
            continue
        args.append("--" + key.replace("_", "-"))
        if value is not True:
            args.append(str(value))
    return args


def end_record(metrics_path):
    """The last line of a --metrics-file, which must be rank 0's {"event": "end", ...}."""
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records or records[-1].get("event") != "end":
        raise AssertionError("expected %s to end with an \"end\" record; its last lines: %s"
                             % (metrics_path, records[-3:]))
    return records[-1]


def load_checkpoint(path):
    """A checkpoint.pt of elrun-train, read by Python's torch.load."""
    import torch  # Only the tests of this module pay for importing torch.
    return torch.load(path)  # torch 2.11 default: weights_only=True.


def checkpoint_differences(a, b, tolerance, ignore=()):
    """What differs between two checkpoints: progress fields (except those in `ignore`), tensor
    names or shapes, and every tensor (model parameters and buffers, optimizer momentum) whose
    largest absolute difference exceeds `tolerance`, worst first. Also returns the largest
    difference seen overall."""
    problems = []
    for key in ("step", "epoch", "samples_seen", "world_size"):
        if key not in ignore and a.get(key) != b.get(key):
            problems.append((float("inf"), "%s: %r vs %r" % (key, a.get(key), b.get(key))))
    worst = 0.0
    for part in ("model", "optimizer"):
        ta, tb = a.get(part, {}), b.get(part, {})
        if sorted(ta) != sorted(tb):
            problems.append((float("inf"), "%s names differ: only in the first %s, only in the "
                             "second %s" % (part, sorted(set(ta) - set(tb)),
                                            sorted(set(tb) - set(ta)))))
        for name in sorted(set(ta) & set(tb)):
            x, y = ta[name], tb[name]
            if x.shape != y.shape:
                problems.append((float("inf"), "%s[%s]: shape %s vs %s"
                                 % (part, name, tuple(x.shape), tuple(y.shape))))
                continue
            diff = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
            worst = max(worst, diff)
            if not diff <= tolerance:  # Also catches NaN.
                problems.append((diff, "%s[%s]: max |difference| %.3g (largest value %.3g)"
                                 % (part, name, diff, x.double().abs().max().item())))
    problems.sort(key=lambda p: -p[0])
    return [text for _, text in problems], worst


class LiveRun(harness.WatchedProcess):
    """A started launcher (elrun or torchrun), pumped until a condition on its output holds."""

    def pump(self, until, timeout):
        """Reads output and the exit as they come until until() is true, the launcher has exited
        or timeout seconds have passed. Returns until()."""
        deadline = time.monotonic() + timeout
        for _ in range(1000000):  # Bounded: each round reads output, sees the exit or times out.
            if until() or self.rc is not None:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            watch = list(self.streams) + [self.pidfd]
            ready, _, _ = select.select(watch, [], [], remaining)
            for fd in ready:
                if fd == self.pidfd:
                    self.reap()
                elif fd in self.streams:
                    self.read(fd)
        return until()

    def result(self):
        end = self.exited_at if self.exited_at is not None else time.monotonic()
        return harness.Result(self.proc.args_for_report, self.rc, self.stdout, self.stderr,
                              end - self.proc.started_at)

    def close(self):
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class TrainTestCase(ElrunTestCase):
    """Runs elrun-train jobs under a launcher and compares what they leave behind."""

    def fresh_job(self, name, max_steps, **options):
        """train_args for a job of max_steps whose checkpoints and metrics go to a new directory
        `name` of the test (name/checkpoints, name/metrics.jsonl)."""
        os.makedirs(self.path(name))
        return train_args(max_steps=max_steps, checkpoint_dir=self.path(name, "checkpoints"),
                          metrics_file=self.path(name, "metrics.jsonl"), **options)

    def launch(self, launcher_args, trainer_args, torchrun=False, env=None):
        """Starts elrun (or, with torchrun=True, Debian's torchrun) with launcher_args, then
        elrun-train with trainer_args (--no-python, spelled as that launcher wants it)."""
        command = torchrun_command() if torchrun else None
        flag = "--no_python" if torchrun or harness.TORCHRUN_REFERENCE else "--no-python"
        proc = self.start(list(launcher_args) + [flag] + train_command() + list(trainer_args),
                          command=command, env=env)
        run = LiveRun(proc)
        self.addCleanup(run.close)
        return run

    def wait_exit(self, run, timeout=TRAIN_TIMEOUT_S):
        """Waits for the launcher to exit; fails (and reports its output) after timeout."""
        if not run.pump(lambda: False, timeout) and run.rc is None:
            self.fail("expected the training job to finish within %.0f s; it did not (its "
                      "processes: %s)\n%s" % (timeout, harness.describe(
                          harness.descendants(run.proc.pid)), run.result()))
        return run.result()

    def workers(self, run):
        """{rank: pid} of the elrun-train processes below the launcher now, by the RANK they were
        started with. A standby spare of --keep-survivors (ELRUN_STANDBY=1) keeps the environment
        of the launch it was made from even after elrun handed it another worker's: left out."""
        found = {}
        train = os.path.basename(train_command()[0])
        for pid in harness.descendants(run.proc.pid):
            if train not in harness.cmdline(pid):
                continue
            try:
                with open("/proc/%d/environ" % pid, "rb") as f:
                    env = dict(item.split(b"=", 1) for item in f.read().split(b"\0")
                               if b"=" in item)
            except OSError:
                continue  # Gone since the scan.
            if b"RANK" in env and env.get(b"ELRUN_STANDBY") != b"1":
                found[int(env[b"RANK"])] = pid
        return found

    def kill_worker(self, run, rank):
        """SIGKILLs the elrun-train worker of `rank` below the launcher (never the launcher) and
        waits until it is dead. Returns its pid."""
        pid = self.workers(run).get(rank)
        self.assertIsNotNone(pid, "expected a running elrun-train worker of rank %d below the "
                             "launcher; found %s\n%s" % (rank, self.workers(run), run.result()))
        start = harness.descendants(run.proc.pid).get(pid)
        fds = harness.Pidfds([pid])
        try:
            stat = harness.proc_stat(pid)
            self.assertTrue(fds.fds and stat is not None and stat[3] == start
                            and stat[0] not in ("Z", "X"),
                            "expected rank %d's worker (pid %d) to be running when the test "
                            "killed it\n%s" % (rank, pid, run.result()))
            fds.kill_all()
            alive = fds.wait_all_dead(harness.DEATH_TIMEOUT_S)
            self.assertEqual(alive, [], "expected rank %d's worker %d dead after SIGKILL"
                             % (rank, pid))
        finally:
            fds.close()
        return pid

    def run_job(self, launcher_args, trainer_args, what, torchrun=False, env=None):
        """Runs a training job to completion; expects exit 0 and returns its Result."""
        run = self.launch(launcher_args, trainer_args, torchrun=torchrun, env=env)
        result = self.wait_exit(run)
        self.assertEqual(result.rc, 0, "expected %s to exit 0\n%s" % (what, result))
        return result

    def assertSameCheckpoint(self, path_a, path_b, what, tolerance=1e-6, ignore=()):
        """Expects two checkpoints to hold the same progress (but the fields in `ignore`) and,
        within `tolerance`, the same parameters, buffers (BatchNorm running statistics) and
        momentum buffers. Returns the first one (as torch.load gives it) and the largest
        difference."""
        a, b = load_checkpoint(path_a), load_checkpoint(path_b)
        problems, worst = checkpoint_differences(a, b, tolerance, ignore)
        self.assertEqual(problems, [], "expected %s to hold the same state within %g; they "
                         "differ (largest difference %.3g):\n  %s\n(%s\n %s)"
                         % (what, tolerance, worst, "\n  ".join(problems[:20]), path_a, path_b))
        return a, worst


class RegroupTestCase(TrainTestCase):
    """--keep-survivors jobs: train_resume_test's job (FashionNet with SyncBatchNorm on the seeded
    synthetic data set, batch 32 per rank, a checkpoint every 16 steps, cut at step 80 of 2
    epochs) and waits on what one launcher prints."""
    BATCH = 32
    CHECKPOINT_EVERY = 16
    MAX_STEPS = SYNTHETIC_TRAIN_SAMPLES // (2 * BATCH) + CHECKPOINT_EVERY  # 80 with 2 workers.

    def job_args(self, name, **options):
        settings = dict(batch_size=self.BATCH, epochs=2, max_steps=self.MAX_STEPS,
                        checkpoint_every=self.CHECKPOINT_EVERY, checkpoint_dir=self.path(name, "checkpoints"),
                        metrics_file=self.path(name, "metrics.jsonl"), step_times_file=self.path(name, "steps.tsv"))
        settings.update(options)
        return train_args(**settings)

    def logged_steps(self, name, rank):
        """The steps of rank's --step-times-file, as its processes appended them."""
        with open(self.path(name, "steps.tsv.%d" % rank)) as f:
            lines = [line.split("\t")[0] for line in f]
        self.assertEqual(lines[:1], ["step"], "expected %s/steps.tsv.%d to start with its header" % (name, rank))
        return [int(step) for step in lines[1:]]

    def wait_for(self, run, what, until, other=None):
        """Pumps `run` until until(); fails, with its output (and other's), when it exits first or
        TRAIN_TIMEOUT_S passes."""
        run.pump(until, TRAIN_TIMEOUT_S)
        if not until():
            self.fail("expected %s; %s\n%s%s" % (what, "the job exited first" if run.rc is not None else
                                                 "it did not happen within %.0f s" % TRAIN_TIMEOUT_S,
                                                 run.result(), "\n" + str(other.result()) if other else ""))

    def latest_step(self, run, after=0):
        found = STEP_LINE.findall(run.stdout[after:])
        return int(found[-1][1]) if found else 0

