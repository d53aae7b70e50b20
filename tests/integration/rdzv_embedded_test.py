"""The embedded coordinator: with no elrun-rdzv daemon, the first elrun whose --rdzv-endpoint is a
local address hosts the rendezvous itself; the others find the port taken and join as clients."""

import harness
from rdzv_harness import RdzvTestCase

HOSTING = "hosting the rendezvous coordinator on 127.0.0.1:%d"
JOINED = "joined; waiting for the round to complete"


@harness.elrun_only("multi-node rendezvous through an embedded coordinator")
class EmbeddedCoordinatorTest(RdzvTestCase):

    def test_first_elrun_hosts_three_nodes_finish(self):
        port = self.reserve_port()  # Held until the test ends; the host binds it (SO_REUSEADDR).
        host = self.start_agent(1, port, nnodes=3, nproc=2)
        self.pump(lambda: HOSTING % port in host.stderr, "node 1 to host the coordinator",
                  10, alive=[host])
        # Group ranks follow join order: the others start once the host has joined (hosting is
        # logged before the host's own join reaches the coordinator).
        self.pump(lambda: JOINED in host.stderr, "node 1 to join its own coordinator", 10,
                  alive=[host])
        agents = [host] + [self.start_agent(node, port, nnodes=3, nproc=2) for node in (2, 3)]
        records = self.wait_workers(6, alive=agents, what="the 3 nodes' 6 workers to start")
        self.assertAllExit(agents, 0)
        self.assertNoMoreWorkers()
        self.assertEqual({(r["world"], r["groups"]) for r in records}, {(6, 3)})
        self.assertEqual(sorted(r["rank"] for r in records), list(range(6)))
        self.assertEqual({r["node"]: r["group"] for r in records}[1], 0,
                         "expected the first joiner (the host) to be group rank 0")
        for agent in agents[1:]:
            self.assertNotIn("hosting the rendezvous", agent.stderr,
                             "expected only node 1 to host the coordinator\n%s" % agent.result())
            self.assertEqual([(r["round"], r["world"]) for r in agent.rounds()], [(1, 6)],
                             agent.result())


if __name__ == "__main__":
    harness.main()
