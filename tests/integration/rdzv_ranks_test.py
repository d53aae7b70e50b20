"""Nodes with different --nproc-per-node in one job: WORLD_SIZE is the sum of their nproc and each
node's RANKs start at the prefix sum of the nproc of the nodes before it in group-rank order."""
import harness
from rdzv_harness import RdzvTestCase


@harness.elrun_only("multi-node rendezvous through elrun-rdzv")
class MixedNprocTest(RdzvTestCase):

    def run_job(self, nodes):
        """nodes: {node: (nproc, --node-rank hint or None)}. Returns the workers' records."""
        daemon = self.start_daemon()
        agents = []
        for node, (nproc, hint) in nodes.items():
            args = ["--node-rank", str(hint)] if hint is not None else []
            agents.append(self.start_agent(node, daemon.port, nnodes=len(nodes), nproc=nproc,
                                           args=args))
        records = self.wait_workers(sum(n for n, _ in nodes.values()), alive=agents,
                                    what="every worker to start")
        self.assertAllExit(agents, 0)
        self.assertNoMoreWorkers()
        self.stop_daemon(daemon)
        self.assertEqual({(r["world"], r["groups"]) for r in records}, {(6, 3)},
                         "expected WORLD_SIZE 6 = 1 + 2 + 3 and 3 nodes\n%s" % self.summary())
        self.assertEqual(sorted(r["rank"] for r in records), list(range(6)))
        for r in records:
            self.assertEqual(r["nproc"], nodes[r["node"]][0], "expected LOCAL_WORLD_SIZE = nproc")
        return records

    def offsets(self, records):
        """{group rank: (nproc, lowest RANK)}, checking each node's ranks are one block."""
        nodes = {}
        for r in records:
            nodes.setdefault(r["group"], []).append((r["local"], r["rank"]))
        out = {}
        for group, places in nodes.items():
            base = min(rank for _, rank in places)
            self.assertEqual(sorted(places), [(i, base + i) for i in range(len(places))],
                             "expected RANK = offset + LOCAL_RANK on group rank %d" % group)
            out[group] = (len(places), base)
        return out

    def test_nproc_1_2_3_offsets_0_1_3(self):
        records = self.run_job({1: (1, 0), 2: (2, 1), 3: (3, 2)})
        self.assertEqual(self.offsets(records), {0: (1, 0), 1: (2, 1), 2: (3, 3)})

    def test_nproc_3_2_1_offsets_0_3_5(self):
        records = self.run_job({1: (1, 2), 2: (2, 1), 3: (3, 0)})
        self.assertEqual(self.offsets(records), {0: (3, 0), 1: (2, 3), 2: (1, 5)})

    def test_without_hints_offsets_are_prefix_sums_by_group_rank(self):
        offsets = self.offsets(self.run_job({1: (1, None), 2: (2, None), 3: (3, None)}))
        self.assertEqual(sorted(offsets), [0, 1, 2])
        base = 0
        for group in sorted(offsets):
            self.assertEqual(offsets[group][1], base, "expected group rank %d's first RANK to be "
                             "the sum of nproc before it, %r" % (group, offsets))
            base += offsets[group][0]


if __name__ == "__main__":
    harness.main()
