"""A node lost in the middle of a multi-node job: killed with SIGKILL (its stream breaks at once),
frozen with SIGSTOP (no heartbeat for heartbeat_timeout) or stopped with SIGTERM (forwarded to its
workers). The survivors form a new round without it, with no restart spent, and finish; nothing
of the lost node keeps running."""
import glob
import os
import signal
import time

import harness
import rdzv_harness
from rdzv_harness import RdzvTestCase

# Heartbeats for the SIGSTOP case: a frozen agent is removed about HEARTBEAT_TIMEOUT_S after it
# stopped; the survivors must have started their new round within REMOVAL_BOUND_S.
HEARTBEAT_TIMEOUT_S = 1.5
REMOVAL_BOUND_S = HEARTBEAT_TIMEOUT_S + 3.0


@harness.elrun_only("multi-node rendezvous through elrun-rdzv")
class NodeLossTest(RdzvTestCase):

    def victim(self, agents, records):
        """The agent of a node that is not group rank 0 (which provides the master), and the
        ready records of its workers."""
        group_of = {r["node"]: r["group"] for r in records}
        agent = [a for a in agents if group_of[a.node] == 2][0]
        return agent, [r for r in records if r["node"] == agent.node]

    def check_new_round(self, survivors, records, world, restarts=0):
        self.assertEqual({(r["world"], r["groups"], r["restarts"]) for r in records},
                         {(world, len(survivors), restarts)},
                         "expected every worker of the new round to see WORLD_SIZE %d, "
                         "GROUP_WORLD_SIZE %d and TORCHELASTIC_RESTART_COUNT %d\n%s"
                         % (world, len(survivors), restarts, self.summary()))
        self.assertEqual(sorted(r["rank"] for r in records), list(range(world)))
        self.assertEqual(sorted({r["node"] for r in records}),
                         sorted(a.node for a in survivors),
                         "expected the new round to be made of the surviving nodes")

    def test_kill9_of_a_node_survivors_rejoin_and_finish(self):
        daemon = self.start_daemon()
        worker = [harness.worker("torch_elastic.py")]
        # Round 1 (world 8) holds after its all-reduces; round 2 (world 6) finishes.
        env = {"GLOO_SOCKET_IFNAME": "lo", "HOLD_WORLDS": "8"}
        agents = [self.start_agent(node, daemon.port, nnodes="3:4", nproc=2, worker=worker,
                                   env=env)
                  for node in (1, 2, 3, 4)]
        first = self.wait_workers(8, alive=agents, what="round 1's 8 workers to all-reduce")
        victim, victim_records = self.victim(agents, first)
        survivors = [a for a in agents if a is not victim]
        master = [r["node"] for r in first if r["group"] == 0][0]
        victim_fds = self.pidfds(victim_records)

        victim.proc.kill()  # SIGKILL; our unreaped child.
        self.assertDead(victim_fds, "the killed node's workers and their grandchildren")
        second = self.wait_workers(6, alive=survivors,
                                   what="the 3 survivors' 6 workers to all-reduce in round 2")
        self.assertAllExit(survivors, 0)
        self.wait_exit([victim])
        self.assertEqual(victim.rc, -signal.SIGKILL)
        self.assertNoMoreWorkers()

        self.check_new_round(survivors, second, world=6)
        self.assertEqual([r["node"] for r in second if r["group"] == 0][0], master,
                         "expected group rank 0 to stay on node %d, which survived" % master)
        self.assertEqual(len(glob.glob(self.path("torch_w6_r*.json"))), 6,
                         "expected a result file from each of the 6 workers of round 2")
        for agent in survivors:
            self.assertIn("round 1 ended (a node was lost", agent.stderr,
                          "expected %s to say why round 1 ended\n%s" % (agent.name, agent.result()))
            self.assertEqual([(r["round"], r["world"], r["restarts"]) for r in agent.rounds()],
                             [(1, 8, 0), (2, 6, 0)],
                             "expected rounds of world 8 then 6 on %s, no restart spent\n%s"
                             % (agent.name, agent.result()))
        self.stop_daemon(daemon)

    def test_sigstop_of_a_node_removed_after_heartbeat_timeout(self):
        daemon = self.start_daemon()
        conf = {"heartbeat_interval": "0.2", "heartbeat_timeout": str(HEARTBEAT_TIMEOUT_S)}
        agents = [self.start_agent(node, daemon.port, nnodes="3:4", nproc=2, conf=conf,
                                   rule=rdzv_harness.hold_while_world(8))
                  for node in (1, 2, 3, 4)]
        first = self.wait_workers(8, alive=agents, what="round 1's 8 workers to start")
        victim, victim_records = self.victim(agents, first)
        survivors = [a for a in agents if a is not victim]
        victim_fds = self.pidfds(victim_records)

        stopped = time.monotonic()
        victim.proc.send_signal(signal.SIGSTOP)
        second = self.wait_workers(6, alive=survivors, timeout=REMOVAL_BOUND_S + 5,
                                   what="the 3 survivors' workers to start round 2")
        removed_after = time.monotonic() - stopped
        self.assertLess(removed_after, REMOVAL_BOUND_S,
                        "expected the frozen node removed and round 2 started within "
                        "heartbeat_timeout + 3 s = %.1f s of SIGSTOP; took %.2f s"
                        % (REMOVAL_BOUND_S, removed_after))
        self.check_new_round(survivors, second, world=6)
        self.assertAllExit(survivors, 0)
        for agent in survivors:
            self.assertRegex(agent.stderr, r"round 1 ended \(a node was lost: .*no heartbeat",
                             "expected %s to name the missing heartbeat\n%s"
                             % (agent.name, agent.result()))
        # The frozen node's workers ran on meanwhile, and must not outlive their agent.
        self.assertEqual([p for p in victim_fds.fds if not harness.is_running(p)], [],
                         "expected the frozen node's workers to run on while it is stopped")
        victim.proc.send_signal(signal.SIGCONT)
        self.wait_exit([victim], timeout=10)
        self.assertExit(victim.result(), 1)
        self.assertIn("removed from run job", victim.stderr,
                      "expected the resumed node to say it was removed\n%s" % victim.result())
        self.assertDead(victim_fds, "the resumed node's workers and their grandchildren")
        self.assertNoMoreWorkers()
        self.stop_daemon(daemon)

    # Regression: elrun must block its handled signals before gRPC starts threads, or a SIGTERM
    # delivered to one of them kills elrun (returncode -15) instead of being forwarded.
    def test_sigterm_to_a_node_forwarded_then_survivors_go_on(self):
        daemon = self.start_daemon()
        # The trap is set before the worker reports ready: a SIGTERM right after the report
        # must find it (under load it once arrived before a trap set by the rule).
        trap = "trap 'echo TERM > \"$OUT_DIR/term.$NODE.$LOCAL_RANK\"; exit 0' TERM"
        agents = [self.start_agent(node, daemon.port, nnodes="2:3", nproc=2,
                                   rule=rdzv_harness.hold_while_world(6), env={"SETUP": trap})
                  for node in (1, 2, 3)]
        first = self.wait_workers(6, alive=agents, what="round 1's 6 workers to start")
        victim, victim_records = self.victim(agents, first)
        survivors = [a for a in agents if a is not victim]
        node = victim_records[0]["node"]

        victim.proc.send_signal(signal.SIGTERM)  # Our unreaped child.
        self.wait_exit([victim], timeout=10)
        self.assertExit(victim.result(), 128 + signal.SIGTERM)
        for local in (0, 1):
            self.assertTrue(os.path.exists(self.path("term.%d.%d" % (node, local))),
                            "expected node %d's local rank %d to get the forwarded SIGTERM"
                            % (node, local))
        second = self.wait_workers(4, alive=survivors, what="the survivors to start round 2")
        self.check_new_round(survivors, second, world=4)
        self.assertAllExit(survivors, 0)
        self.stop_daemon(daemon)


if __name__ == "__main__":
    harness.main()
