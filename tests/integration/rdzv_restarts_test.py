"""A worker failure on one node of a multi-node job spends one restart of the job-wide
--max-restarts: every node restarts its workers with TORCHELASTIC_RESTART_COUNT + 1. With none
left, every node exits 1 and the failing node prints the root-cause report."""
import harness
from rdzv_harness import RdzvTestCase

# Node 2's local rank 0 fails (exit 7) on the test's release while TORCHELASTIC_RESTART_COUNT is
# 0; every other worker holds in that round. After a restart every worker exits 0.
RULE = r'''
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
  if [ "$NODE" = 2 ] && [ "$LOCAL_RANK" = 0 ]; then read go < "$GO"; exit 7; fi
  wait
fi
exit 0
'''


@harness.elrun_only("multi-node rendezvous through elrun-rdzv")
class RestartsTest(RdzvTestCase):

    def start_job(self, max_restarts):
        daemon = self.start_daemon()
        agents = [self.start_agent(node, daemon.port, nnodes=3, nproc=2, rule=RULE,
                                   args=["--max-restarts", str(max_restarts)])
                  for node in (1, 2, 3)]
        first = self.wait_workers(6, alive=agents, what="round 1's 6 workers to start")
        self.assertEqual({r["restarts"] for r in first}, {0})
        return daemon, agents, first

    def test_failure_spends_one_restart_on_every_node(self):
        daemon, agents, first = self.start_job(max_restarts=1)
        self.release(1)  # Node 2's local rank 0 exits 7.
        second = self.wait_workers(6, alive=agents, what="every node to restart its workers")
        self.assertAllExit(agents, 0)
        self.assertNoMoreWorkers()
        self.assertEqual({r["restarts"] for r in second}, {1},
                         "expected TORCHELASTIC_RESTART_COUNT 1 on every node after one failure"
                         "\n%s" % self.summary())
        self.assertEqual(sorted(r["node"] for r in second), [1, 1, 2, 2, 3, 3])
        self.assertEqual(sorted(r["rank"] for r in second), list(range(6)))
        for agent in agents:
            self.assertIn("round 1 ended (a worker failed", agent.stderr, agent.result())
            self.assertEqual([(r["round"], r["world"], r["restarts"]) for r in agent.rounds()],
                             [(1, 6, 0), (2, 6, 1)], agent.result())
        self.stop_daemon(daemon)

    def test_failure_without_restarts_ends_the_job_on_every_node(self):
        daemon, agents, first = self.start_job(max_restarts=0)
        failing = [r for r in first if r["node"] == 2 and r["local"] == 0][0]
        self.release(1)
        self.assertAllExit(agents, 1)
        self.assertNoMoreWorkers()
        for agent in agents:
            self.assertRegex(agent.stderr, r"elrun: the job failed: .*\(group rank %d\).*no "
                             r"restarts left \(max_restarts 0\)" % failing["group"],
                             "expected %s to name the failed node and the spent restarts\n%s"
                             % (agent.name, agent.result()))
        err = agents[1].stderr
        self.assertIn("Root Cause (first observed failure):", err,
                      "expected the failing node to print the root-cause report\n%s"
                      % agents[1].result())
        report = err[err.index("Root Cause"):]
        for pattern in (r"rank      : %d \(local_rank: 0, group_rank: %d\)"
                        % (failing["rank"], failing["group"]),
                        r"exitcode  : 7", r"pid       : %d" % failing["pid"]):
            self.assertRegex(report, pattern, "expected the root cause to show %r\n%s"
                             % (pattern, agents[1].result()))
        self.stop_daemon(daemon)


if __name__ == "__main__":
    harness.main()
