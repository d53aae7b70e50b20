"""The chaos soak's CI case: bench/chaos_soak.py with a fixed seed, 5 epochs, a fault every 3-5 s
for up to 30 s (40 s with the network's three kinds more), at least one of each kind: a worker
SIGKILLed, a worker SIGSTOPped, an agent SIGKILLed, a node added, on an elastic 2:4-node
elrun-train job; then an uninterrupted run of the same job. Once on the grpc backend (elrun-rdzv),
once on the etcd-v3 backend with a real 3-member etcd cluster, where the etcd leader is SIGKILLed
too, and once with every node in a test host of its own (--network: links cut, lossy and dropped
one way too; skipped where network namespaces cannot be made). Each case is a shard of its own
(BUILD: shard_count), about three minutes on 2 cores; the long soak is a benchmark
(docs/chaos_soak.md). The script's own checks must all pass: every resume from a committed step,
the final checkpoint loads, no process left, nothing new in /dev/shm, surviving agents exit 0,
accuracy within 0.5 points of the uninterrupted run."""
import json
import os
import subprocess
import sys

import harness
from harness import ElrunTestCase

SCRIPT = os.path.join(harness.HERE, "..", "..", "bench", "chaos_soak.py")


@harness.elrun_only("the soak drives elrun's elastic agents and elrun-rdzv")
class ChaosSoakTest(ElrunTestCase):

    def test_the_job_finishes_whatever_happens_to_it(self):
        self.soak("grpc", {"kill9_worker", "sigstop_worker", "kill9_agent", "add_node"})

    def test_on_the_etcd_backend_too_with_the_etcd_leader_killed(self):
        self.soak("etcd-v3", {"kill9_worker", "sigstop_worker", "kill9_agent", "add_node",
                              "kill9_etcd_leader"})

    def test_on_test_hosts_with_real_links_cut_lossy_and_dropped(self):
        from tests.support import netlab
        reason = netlab.unavailable()
        if reason:
            self.skipTest(reason)
        self.soak("grpc", {"kill9_worker", "sigstop_worker", "kill9_agent", "add_node", "cut_node", "lossy_node",
                           "drop_one_way"}, ["--network"], duration=40)

    def soak(self, backend, kinds, extra=(), duration=30):
        report = self.path("soak.json")
        # Debian's Python runs the script (matplotlib); the torch environment loads the checkpoint.
        command = ["/usr/bin/python3", SCRIPT, "--seed", "1", "--duration", str(duration), "--interval", "3:5",
                   "--rdzv-backend", backend,
                   "--epochs", "5", "--checkpoint-every", "20", "--timeout", "300",
                   "--elrun", harness.bazel_binary("launcher", "elrun", "ELRUN_BIN")[0],
                   "--elrun-rdzv", harness.bazel_binary("agent/daemon", "elrun-rdzv", "ELRUN_RDZV_BIN")[0],
                   "--elrun-train", harness.bazel_binary("trainer/app", "elrun-train", "ELRUN_TRAIN_BIN")[0],
                   "--python", harness.PYTHON, "--json", report, "--png", self.path("soak.png")] + list(extra)
        result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=self.tmp)
        sys.stdout.write(result.stdout)
        self.assertEqual(result.returncode, 0, "expected every check of the soak to pass\n%s\n%s"
                         % (result.stdout, result.stderr[-4000:]))
        with open(report) as f:
            data = json.load(f)
        self.assertEqual({fault["kind"] for fault in data["chaos"]["faults"]}, kinds,
                         "expected at least one fault of each kind")
        self.assertEqual(data["chaos"]["checks"], [])
        self.assertIsNotNone(data["chaos"]["steps"], "expected rank 0 to finish its 5 epochs")
        self.assertTrue(os.path.getsize(self.path("soak.png")) > 0)


if __name__ == "__main__":
    harness.main()
