"""Scale-up: a node that arrives while a job runs below its maximum of nodes (--nnodes 4:5) ends
the round; the running nodes and the newcomer form a bigger round at once (no restart spent, the
running nodes keep their group ranks) and the job finishes there."""
import harness
import rdzv_harness
from rdzv_harness import RdzvTestCase


@harness.elrun_only("multi-node rendezvous through elrun-rdzv")
class ScaleUpTest(RdzvTestCase):

    def test_fifth_node_joins_running_job_world_grows_to_10(self):
        daemon = self.start_daemon()
        # last_call_timeout=0: round 1 starts as soon as the minimum of 4 nodes have joined.
        options = dict(nnodes="4:5", nproc=2, conf={"last_call_timeout": "0"},
                       rule=rdzv_harness.hold_while_world(8))
        agents = [self.start_agent(node, daemon.port, **options) for node in (1, 2, 3, 4)]
        first = self.wait_workers(8, alive=agents, what="round 1's 8 workers to start")
        self.assertEqual({(r["world"], r["groups"]) for r in first}, {(8, 4)},
                         "expected round 1 to have the 4 nodes\n%s" % self.summary())
        group_of = {r["node"]: r["group"] for r in first}

        newcomer = self.start_agent(5, daemon.port, **options)
        agents.append(newcomer)
        second = self.wait_workers(10, alive=agents, what="round 2's 10 workers to start")
        self.assertAllExit(agents, 0)
        self.assertNoMoreWorkers()

        self.assertEqual({(r["world"], r["groups"], r["restarts"]) for r in second},
                         {(10, 5, 0)}, "expected round 2 to have 5 nodes, 10 workers and no "
                         "restart spent\n%s" % self.summary())
        self.assertEqual(sorted(r["rank"] for r in second), list(range(10)))
        group_of[5] = 4
        self.assertEqual({r["node"]: r["group"] for r in second}, group_of,
                         "expected the running nodes to keep their group ranks and the newcomer "
                         "to get group rank 4")
        for agent in agents[:4]:
            self.assertIn("round 1 ended (a node joined", agent.stderr,
                          "expected %s to say why round 1 ended\n%s" % (agent.name, agent.result()))
            self.assertEqual([(r["round"], r["world"], r["restarts"]) for r in agent.rounds()],
                             [(1, 8, 0), (2, 10, 0)], agent.result())
        self.assertEqual([(r["round"], r["world"]) for r in newcomer.rounds()], [(2, 10)],
                         "expected the newcomer to start in round 2\n%s" % newcomer.result())
        self.stop_daemon(daemon)


if __name__ == "__main__":
    harness.main()
