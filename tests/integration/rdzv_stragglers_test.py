"""Stragglers judged across nodes: with --straggler-factor each agent sends its workers' paces
(from their progress heartbeats) through the rendezvous and gets back the job's median, so a
slow rank is named even when it is the only worker of its node, and every node's end summary
names the job's slowest ranks."""
import re
import unittest

import harness
from rdzv_harness import RdzvTestCase

WORKER = harness.worker("heartbeat_worker.py")


@harness.elrun_only("elrun's progress heartbeats and its rendezvous")
class CrossNodeStragglerTest(RdzvTestCase):

    def test_a_slow_rank_alone_on_its_node_is_judged_against_the_job(self):
        daemon = self.start_daemon()
        # Three nodes of one worker each; global rank 1 steps 4x slower than the others.
        agents = [self.start_agent(node, daemon.port, nnodes=3, nproc=1, args=["--straggler-factor", "1.5"],
                                   worker=[WORKER, "pace-rank", "1", "7"])
                  for node in (1, 2, 3)]
        self.assertAllExit(agents, 0)
        errs = {a.node: a.result().err for a in agents}
        straggler = re.compile(
            r"\[elrun\] warning: rank 1 \(local_rank 0, host [^,]+, pid \d+\) is a straggler: median step "
            r"1[23]\d\.\d ms over its last \d+ beats, [3-4]\.\d\dx the job's median of 3\d\.\d ms over 3 ranks "
            r"\(--straggler-factor 1\.5\)")
        flagged = [n for n, err in errs.items() if straggler.search(err)]
        self.assertEqual(len(flagged), 1, "expected exactly the slow rank's node to name it\n%s" % self.summary())
        for node, err in errs.items():
            self.assertNotRegex(err, r"rank [02] \(local_rank 0.*straggler", self.summary())
            self.assertRegex(err, r"slowest ranks of the job \(3 ranks\) by median step time: rank 1 \(host [^)]+\) "
                             r"1[23]\d\.\d ms, ", "node %d's summary\n%s" % (node, self.summary()))


if __name__ == "__main__":
    unittest.main()
