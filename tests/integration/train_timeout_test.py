"""elrun-train's --collective-timeout: a peer that stops mid-training (SIGSTOP, as a hung or
swapped-out process looks to the others) makes the other rank fail within twice the timeout,
through the shared-memory all-reduce and through Gloo alike, instead of waiting for the old
fixed 120 s. elrun then ends the job with rank 0's failure as the root cause.

With elrun's --worker-timeout, elrun-train's per-step heartbeats let elrun see the stall itself,
long before a collective timeout of 300 s: the stopped rank is killed at once (it cannot print its
stacks), and the rank waiting on it, hung too, is spared as only waiting for a stopped peer; its
all-reduce then fails on the dead peer, and the stopped rank is the root cause.
"""
import os
import signal
import time

import harness
import train_harness
from train_harness import TrainTestCase

TIMEOUT_S = 3


class CollectiveTimeoutTest(TrainTestCase):

    def stop_rank_1_and_time_the_end(self, transport, launcher_args=(), collective_timeout=TIMEOUT_S):
        run = self.launch(["--standalone", "--nproc_per_node", "2", "--shutdown-timeout", "1"] + list(launcher_args),
                          self.fresh_job(transport, 5000, allreduce=transport,
                                         collective_timeout=collective_timeout))
        run.pump(lambda: len(train_harness.STEP_LINE.findall(run.stdout)) >= 3,
                 train_harness.TRAIN_TIMEOUT_S)
        self.assertGreaterEqual(len(train_harness.STEP_LINE.findall(run.stdout)), 3,
                                "expected the job to train before the test stopped rank 1\n%s"
                                % run.result())
        pid = self.workers(run).get(1)
        self.assertIsNotNone(pid, "expected rank 1's worker\n%s" % run.result())
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        result = self.wait_exit(run, timeout=120)
        return result, time.monotonic() - stopped

    def test_a_stopped_peer_fails_the_other_rank_within_twice_the_timeout(self):
        for transport in ("shm", "gloo"):
            result, took = self.stop_rank_1_and_time_the_end(transport)
            print("--allreduce %s: the job ended %.1f s after rank 1 stopped" % (transport, took))
            self.assertExit(result, 1)
            # Rank 0 fails within 2 x the timeout; elrun's stop adds its 1 s shutdown timeout.
            self.assertLess(took, 2 * TIMEOUT_S + 1 + 2,
                            "expected the job to end within 2 x --collective-timeout %d s after "
                            "rank 1 stopped (--allreduce %s); took %.1f s\n%s"
                            % (TIMEOUT_S, transport, took, result))
            if not harness.TORCHRUN_REFERENCE:
                self.assertIn("Root Cause (first observed failure):\n", result.err)
                root = result.err.split("Root Cause (first observed failure):\n", 1)[1]
                self.assertIn("rank      : 0 (local_rank: 0", root,
                              "expected rank 0's failure as the root cause\n%s" % result)

    @harness.elrun_only("torchrun has no progress heartbeats")
    def test_heartbeats_catch_the_stall_before_any_collective_timeout(self):
        result, took = self.stop_rank_1_and_time_the_end(
            "shm", launcher_args=["--worker-timeout", str(TIMEOUT_S)], collective_timeout=300)
        print("--worker-timeout %d: the job ended %.1f s after rank 1 stopped" % (TIMEOUT_S, took))
        self.assertExit(result, 1)
        # Judged within a tenth of the limit after it and killed at once (no stack grace).
        self.assertLess(took, TIMEOUT_S + 0.5 + 5, result)
        self.assertRegex(result.err, r"rank 1 \(local_rank 1, [^)]*\): no progress for 3\.\d s \(--worker-timeout 3\): "
                         r"its last heartbeat, step \d+.*; it is stopped \(SIGSTOP or a tracer\), so no stacks; "
                         r"killing it")
        # Rank 0, if judged before rank 1 died, is spared ("a peer, rank 1 ..., is stopped: killing only
        # that one"): never killed by the watchdog.
        self.assertNotRegex(result.err, r"rank 0 \(local_rank 0, [^)]*\): no progress[^\n]*; killing it")
        self.assertNotIn("stack of the thread that got SIGUSR1", result.err, result)
        root = result.err.split("Root Cause (first observed failure):\n", 1)[1]
        self.assertIn("rank      : 1 (local_rank: 1", root, result)
        self.assertIn("by elrun's heartbeat watchdog: no progress for", root, result)


if __name__ == "__main__":
    harness.main()
