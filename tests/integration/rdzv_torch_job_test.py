"""A real PyTorch gloo job across 4 elrun agents (4 simulated nodes x 2 workers) that meet at the
elrun-rdzv daemon: every worker all-reduces over the whole world and every agent exits 0."""
import glob
import json

import harness
from rdzv_harness import RdzvTestCase


@harness.elrun_only("multi-node rendezvous through elrun-rdzv")
class TorchJobTest(RdzvTestCase):

    def test_four_nodes_two_workers_allreduce(self):
        daemon = self.start_daemon()
        worker = [harness.worker("torch_elastic.py")]
        # GLOO_SOCKET_IFNAME keeps gloo on loopback whatever the host name resolves to.
        agents = [self.start_agent(node, daemon.port, nnodes=4, nproc=2, worker=worker,
                                   env={"GLOO_SOCKET_IFNAME": "lo"})
                  for node in (1, 2, 3, 4)]
        records = self.wait_workers(8, alive=agents,
                                    what="all 8 workers to all-reduce and report")
        self.assertAllExit(agents, 0)
        self.assertNoMoreWorkers()

        self.assertEqual(sorted(r["rank"] for r in records), list(range(8)),
                         "expected ranks 0..7 once each\n%s" % self.summary())
        self.assertEqual({(r["world"], r["groups"], r["restarts"]) for r in records},
                         {(8, 4, 0)}, "expected WORLD_SIZE 8, GROUP_WORLD_SIZE 4, no restart")
        by_node = {}
        for r in records:
            by_node.setdefault(r["node"], set()).add((r["group"], r["rank"]))
        self.assertEqual(sorted(by_node), [1, 2, 3, 4], "expected 2 workers on each node")
        for node, places in by_node.items():
            (group,) = {g for g, _ in places}  # One group rank per node.
            self.assertEqual(sorted(rank for _, rank in places), [2 * group, 2 * group + 1],
                             "expected node %d (group rank %d) to hold ranks %d and %d"
                             % (node, group, 2 * group, 2 * group + 1))
        (master_node,) = {r["node"] for r in records if r["group"] == 0}
        self.assertEqual({r["master_addr"] for r in records}, {"127.0.0.%d" % master_node},
                         "expected MASTER_ADDR to be group rank 0's --local-addr")

        files = sorted(glob.glob(self.path("torch_w8_r*.json")))
        self.assertEqual(len(files), 8, "expected one result file per worker, got %s" % files)
        for path in files:
            with open(path) as f:
                result = json.load(f)
            self.assertEqual(result["sums"], [36.0 + 8 * step for step in range(5)],
                             "expected rank %d's all_reduce sums for a world of 8" % result["rank"])
        for agent in agents:
            rounds = agent.rounds()
            self.assertEqual([(r["round"], r["world"], r["restarts"]) for r in rounds],
                             [(1, 8, 0)], "expected %s to run one round of world size 8\n%s"
                             % (agent.name, agent.result()))
        self.stop_daemon(daemon)


if __name__ == "__main__":
    harness.main()
