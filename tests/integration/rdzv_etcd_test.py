"""The etcd-v3 rendezvous backend against a real 3-member etcd cluster on loopback
(tests/support/etcd_cluster.py): a job forms with the grpc backend's ranks and leaves no key behind; the etcd
leader killed with SIGKILL mid-job costs no restart, and one stopped with SIGSTOP does not stall
the job; an agent killed with SIGKILL is lost when its lease expires and the survivors form a
new round, and a node that arrives scales the job up; the leading agent (the one that replays
the log) killed with SIGKILL, or stalled with SIGSTOP past its lease: the next in line takes
over; a node that joins after the last node to join died finds its place from the line; agents
renew their leases on the etcd leader; a quiet job's leader makes etcd drop its read buffer
(agent/etcd/etcd_quiet_trim.h), and no lease is left behind; two jobs on one cluster stay apart;
a rendezvous token is proven over etcd and a wrong or missing one refused; etcd's user and
password, and TLS to etcd, are honoured; a wrong password or an unreachable
cluster is a one-line error."""
import signal
import time
import unittest

import harness
from tests.support import etcd_cluster
from tests.support.etcd_cluster import EtcdCluster, make_tls_files
from rdzv_harness import GATED, RdzvTestCase

# The agents' lease TTL (heartbeat_timeout): a node killed with SIGKILL is lost this long after
# its last renewal; the survivors' new round must start within LOSS_BOUND_S of the kill.
LEASE_S = 2
LOSS_BOUND_S = LEASE_S + 4.0
PREFIX = "/elrun/rdzv/"


@harness.elrun_only("elrun's etcd-v3 rendezvous backend")
class EtcdRendezvousTest(RdzvTestCase):

    def cluster(self, **kwargs):
        cluster = EtcdCluster(self.tmp, members=3, **kwargs)
        self.addCleanup(cluster.close)  # Before the harness's leak check (cleanups run LIFO).
        return cluster

    def agent(self, cluster, node, run_id="job", nnodes=2, nproc=2, rule=GATED, conf=None, env=None):
        settings = {"heartbeat_timeout": str(LEASE_S), "last_call_timeout": "1"}
        settings.update(conf or {})
        return self.start_agent(node, 0, run_id=run_id, nnodes=nnodes, nproc=nproc, rule=rule,
                                conf=settings, env=env, backend="etcd-v3", endpoint=cluster.endpoints)

    def hold(self, seconds, alive):
        """Watches for `seconds` that every agent in `alive` keeps running and no worker starts."""
        try:
            self.pump(lambda: len(self.ready.lines) > self.seen, "a worker start", seconds, alive)
        except AssertionError as e:
            if "did not happen" in str(e):
                return
            raise
        self.fail("expected no new round while holding\n%s" % self.summary())

    def check_round(self, records, world, nodes, restarts=0):
        self.assertEqual(sorted(r["rank"] for r in records), list(range(world)), self.summary())
        self.assertEqual({(r["world"], r["groups"], r["restarts"]) for r in records},
                         {(world, nodes, restarts)}, self.summary())

    def test_job_forms_and_leaves_no_key(self):
        cluster = self.cluster()
        agents = [self.agent(cluster, node, rule="exit 0") for node in (1, 2)]
        records = self.wait_workers(4, what="both nodes' 4 workers")
        self.check_round(records, 4, 2)
        self.assertEqual(sorted({(r["node"], r["group"]) for r in records}) in
                         ([(1, 0), (2, 1)], [(1, 1), (2, 0)]), True, self.summary())
        self.assertAllExit(agents, 0)
        self.assertEqual(cluster.keys(PREFIX), [], "expected the job's keys removed at its end")

    def test_a_quiet_job_makes_etcd_drop_its_read_buffer_and_leaks_no_lease(self):
        # etcd 3.4 copies its read buffer into every read, each lease renewal's included, until
        # a delete-only commit drops it (agent/etcd/etcd_quiet_trim.h). The leading agent makes one
        # once the job has written nothing for a second: it revokes the spare lease it granted
        # when the job began to write.
        cluster = self.cluster()
        agents = [self.agent(cluster, node) for node in (1, 2)]
        self.check_round(self.wait_workers(4, alive=agents, what="round 1's 4 workers"), 4, 2)

        def spares():  # (granted, revoked) beyond the 2 agents' own leases, on one member.
            return (cluster.metric(0, "etcd_debugging_lease_granted_total") - 2,
                    cluster.metric(0, "etcd_debugging_lease_revoked_total"))

        deadline = time.monotonic() + 10.0
        for _ in range(200):  # Bounded: each round polls etcd or times out.
            granted, revoked = spares()
            if granted >= 1 and revoked == granted or time.monotonic() >= deadline:
                break
            self.hold(etcd_cluster.POLL_S, agents)  # Polls etcd; the job must go on meanwhile.
        self.assertGreaterEqual(granted, 1, "expected the leader to grant a spare lease")
        self.assertEqual(revoked, granted, "expected every spare lease revoked once the job was "
                         "quiet\n%s" % self.summary())
        self.assertEqual(len(cluster.leases()), 2, "expected only the 2 agents' leases left")
        self.hold(1.5, agents)  # Quiet: no trim again while nothing is written.
        self.assertEqual(spares(), (granted, revoked))
        self.release(4)
        self.assertAllExit(agents, 0)
        self.assertEqual(cluster.keys(PREFIX), [])
        self.assertEqual(cluster.leases(), [], "expected no lease left after the job")

    def test_agents_renew_their_leases_on_the_etcd_leader(self):
        # An etcd follower forwards each renewal to the leader as an HTTP request of its own,
        # which costs etcd more than the renewal: the agents' keepalive streams are on the leader.
        cluster = self.cluster()
        agents = [self.agent(cluster, node) for node in (1, 2)]
        self.check_round(self.wait_workers(4, alive=agents, what="round 1's 4 workers"), 4, 2)
        leader = cluster.leader()

        def renewals():  # LeaseKeepAlive requests each member received.
            return [cluster.metric(i, "grpc_server_msg_received_total",
                                   {"grpc_method": "LeaseKeepAlive"}) for i in range(3)]

        before = renewals()
        self.hold(2.0 * LEASE_S, agents)  # Each agent renews every LEASE_S/3.
        grown = [a - b for a, b in zip(renewals(), before)]
        self.assertEqual(cluster.leader(), leader, "the etcd leader changed during the test")
        self.assertGreaterEqual(grown[leader], 4, "expected renewals on the leader: %s" % grown)
        self.assertEqual([g for i, g in enumerate(grown) if i != leader], [0, 0],
                         "expected no renewal on a follower: %s" % grown)
        self.release(4)
        self.assertAllExit(agents, 0)

    def test_leader_killed_mid_job_costs_no_restart(self):
        cluster = self.cluster()
        agents = [self.agent(cluster, node) for node in (1, 2)]
        self.check_round(self.wait_workers(4, alive=agents, what="round 1's 4 workers"), 4, 2)
        leader = cluster.leader()
        cluster.kill(leader)
        cluster.wait_for_leader(exclude=leader)
        # Longer than two lease TTLs with one member gone: the leases were renewed through the
        # new leader, or the agents would have lost each other and started round 2.
        self.hold(2.5 * LEASE_S, agents)
        self.assertNoMoreWorkers()
        self.release(4)
        self.assertAllExit(agents, 0)
        for agent in agents:
            self.assertNotIn("round 1 ended", agent.result().err)
        self.assertEqual(cluster.keys(PREFIX), [])

    def test_leader_stopped_mid_job_the_job_still_finishes(self):
        # A SIGSTOPped member keeps its connections open: the agents' calls on it time out and
        # move on, and their watches on it end by HTTP/2 keepalive (5 s pings, 2 s to answer).
        cluster = self.cluster()
        agents = [self.agent(cluster, node) for node in (1, 2)]
        self.check_round(self.wait_workers(4, alive=agents, what="round 1's 4 workers"), 4, 2)
        leader = cluster.leader()
        cluster.kill(leader, signal.SIGSTOP, wait=False)
        cluster.wait_for_leader(exclude=leader)
        self.release(4)  # Their ends must reach every agent through the surviving members.
        self.assertAllExit(agents, 0)
        self.assertNoMoreWorkers()
        cluster.kill(leader, signal.SIGCONT, wait=False)

    def kill_and_wait_round(self, victim, survivors, name):
        """SIGKILLs victim; the 2 survivors' next round must start within LOSS_BOUND_S. Returns
        its records and how long after the kill it started."""
        victim.proc.kill()
        killed_at = time.monotonic()
        records = self.wait_workers(2, alive=survivors, what="%s of the 2 survivors" % name,
                                    timeout=LOSS_BOUND_S)
        lost_after = time.monotonic() - killed_at
        self.check_round(records, 2, 2)
        return records, lost_after

    def test_agent_killed_survivors_form_a_new_round_and_a_newcomer_scales_up(self):
        cluster = self.cluster()
        agents = [self.agent(cluster, node, nnodes="2:3", nproc=1) for node in (1, 2)]
        self.check_round(self.wait_workers(2, alive=agents, what="round 1's 2 workers"), 2, 2)
        newcomer = self.agent(cluster, 3, nnodes="2:3", nproc=1)
        agents.append(newcomer)
        second = self.wait_workers(3, alive=agents, what="round 2 with the newcomer (scale-up)")
        self.check_round(second, 3, 3)
        victim = [a for a in agents if a.node == [r["node"] for r in second if r["group"] == 1][0]][0]
        survivors = [a for a in agents if a is not victim]
        third, lost_after = self.kill_and_wait_round(victim, survivors, "round 3")
        self.assertEqual(sorted(r["node"] for r in third), sorted(a.node for a in survivors))
        self.release(2)
        self.assertAllExit(survivors, 0)
        stderr = survivors[0].result().err
        self.assertIn("a node was lost", stderr)
        self.assertIn("etcd lease ended", stderr)
        print("node lost %.2f s after kill -9 (lease TTL %d s)" % (lost_after, LEASE_S))
        self.assertEqual(cluster.keys(PREFIX), [])

    LEADER_KEY = PREFIX + "job/leader"

    TAIL_KEY = PREFIX + "job/tail"

    def agent_with_id(self, agents, node_id):
        """The agent whose node id (host:pid:suffix) is node_id."""
        pid = int(node_id.split(":")[-2])
        found = [a for a in agents if a.proc.pid == pid]
        self.assertEqual(len(found), 1, "no agent has pid %d (%s)" % (pid, node_id))
        return found[0]

    def leading_agent(self, cluster, agents):
        """The agent whose id the job's leader key holds."""
        node_id = cluster.get(self.LEADER_KEY)
        self.assertIsNotNone(node_id, "expected the leading agent's id at %s" % self.LEADER_KEY)
        return self.agent_with_id(agents, node_id)

    def test_a_node_joining_after_the_last_joiner_died_reads_its_place_from_the_line(self):
        # The last node to join holds tail (its key under nodes/) under its own lease, and the
        # next node to join reads it to find the node just before it. Once that node is dead
        # tail is gone too, and a joining node reads the line under nodes/ instead.
        cluster = self.cluster()
        agents = [self.agent(cluster, node, nnodes="2:3", nproc=1) for node in (1, 2)]
        self.check_round(self.wait_workers(2, alive=agents, what="round 1's 2 workers"), 2, 2)
        tail = cluster.get(self.TAIL_KEY)
        self.assertIsNotNone(tail, "expected the last node to join at %s" % self.TAIL_KEY)
        self.assertTrue(tail.startswith(PREFIX + "job/nodes/"), tail)
        last = self.agent_with_id(agents, tail[len(PREFIX + "job/nodes/"):])
        survivor = [a for a in agents if a is not last][0]
        last.proc.kill()
        deadline = time.monotonic() + LOSS_BOUND_S
        for _ in range(int(LOSS_BOUND_S / etcd_cluster.POLL_S) + 10):  # Bounded: polls etcd.
            if cluster.get(self.TAIL_KEY) is None or time.monotonic() >= deadline:
                break
            self.hold(etcd_cluster.POLL_S, [survivor])
        self.assertIsNone(cluster.get(self.TAIL_KEY), "expected tail gone with its node's lease")
        newcomer = self.agent(cluster, 3, nnodes="2:3", nproc=1)
        records = self.wait_workers(2, alive=[survivor, newcomer],
                                    what="round 2 of the survivor and the newcomer")
        self.check_round(records, 2, 2)
        self.assertEqual(sorted(r["node"] for r in records), sorted([survivor.node, 3]))
        tail = cluster.get(self.TAIL_KEY)
        self.assertIsNotNone(tail, "expected the newcomer at %s" % self.TAIL_KEY)
        self.assertIs(self.agent_with_id([survivor, newcomer], tail[len(PREFIX + "job/nodes/"):]),
                      newcomer)
        self.release(2)
        self.assertAllExit([survivor, newcomer], 0)
        self.assertEqual(cluster.keys(PREFIX), [])

    def three_nodes_and_their_leader(self, cluster):
        agents = [self.agent(cluster, node, nnodes="2:3", nproc=1) for node in (1, 2, 3)]
        self.first_records = self.wait_workers(3, alive=agents, what="round 1's 3 workers")
        self.check_round(self.first_records, 3, 3)
        leader = self.leading_agent(cluster, agents)
        return leader, [a for a in agents if a is not leader]

    def test_leading_agent_killed_the_next_takes_over(self):
        # One agent leads (replays the log, writes everyone's outputs): its kill -9 must cost
        # only a new round of the survivors, led by the next in line, with no restart spent.
        cluster = self.cluster()
        victim, survivors = self.three_nodes_and_their_leader(cluster)
        _, lost_after = self.kill_and_wait_round(victim, survivors, "round 2")
        self.leading_agent(cluster, survivors)
        self.release(2)
        self.assertAllExit(survivors, 0)
        self.assertIn("a node was lost", survivors[0].result().err)
        print("leading agent lost %.2f s after kill -9 (lease TTL %d s)" % (lost_after, LEASE_S))
        self.assertEqual(cluster.keys(PREFIX), [])

    def test_leading_agent_stalled_is_deposed_then_rejoins(self):
        # SIGSTOP the leading agent past its lease: the next in line leads the survivors' new
        # round; resumed, the stalled agent finds its lease gone, stops its worker (it writes
        # nothing into the job's log as it was) and rejoins as a new node: the job grows back to
        # 3 nodes in round 3, no restart spent. Before, it left the job (exit 1).
        cluster = self.cluster()
        stalled, survivors = self.three_nodes_and_their_leader(cluster)
        stalled_fds = self.pidfds([r for r in self.first_records if r["node"] == stalled.node])
        stalled.proc.send_signal(signal.SIGSTOP)
        try:
            second = self.wait_workers(2, alive=survivors, what="round 2 of the 2 survivors",
                                       timeout=LOSS_BOUND_S)
        finally:
            stalled.proc.send_signal(signal.SIGCONT)
        self.check_round(second, 2, 2)
        self.leading_agent(cluster, survivors)
        self.assertDead(stalled_fds, "the stalled node's round-1 worker and its grandchild")
        third = self.wait_workers(3, alive=survivors + [stalled], what="round 3, the stalled node back",
                                  timeout=LOSS_BOUND_S + 30)
        self.check_round(third, 3, 3)
        self.assertIn("etcd lease", stalled.result().err)  # Expired, or ended (its replica saw it).
        self.release(3)
        self.assertAllExit(survivors + [stalled], 0)
        self.assertEqual(cluster.keys(PREFIX), [])

    def test_two_jobs_on_one_cluster_stay_apart(self):
        cluster = self.cluster()
        agents = [self.agent(cluster, node, run_id=run, rule="exit 0")
                  for run, nodes in (("job-a", (1, 2)), ("job-b", (3, 4))) for node in nodes]
        records = self.wait_workers(8, what="both jobs' 8 workers")
        for run, nodes in (("job-a", {1, 2}), ("job-b", {3, 4})):
            mine = [r for r in records if r["run"] == run]
            self.check_round(mine, 4, 2)
            self.assertEqual({r["node"] for r in mine}, nodes, self.summary())
        self.assertAllExit(agents, 0)
        self.assertEqual(cluster.keys(PREFIX), [])

    def test_a_rendezvous_token_is_proven_over_etcd_and_a_wrong_one_refused(self):
        # Each session's Challenge is made from its session id by the agent itself (the leader
        # does not write it): the proofs of the Join and of the Welcome must still hold.
        cluster = self.cluster()
        token = {"ELRUN_RDZV_TOKEN": "s3cret-token"}
        agents = [self.agent(cluster, node, env=token) for node in (1, 2)]
        self.check_round(self.wait_workers(4, alive=agents, what="the token job's 4 workers"), 4, 2)
        refused = [(self.agent(cluster, 3, env={"ELRUN_RDZV_TOKEN": "not-the-token"}), "wrong rendezvous token"),
                   (self.agent(cluster, 4), "this coordinator requires a token")]
        for outsider, reason in refused:
            self.assertAllExit([outsider], 1)
            lines = [l for l in outsider.result().err.splitlines() if l.startswith("elrun:")]
            self.assertEqual(len(lines), 1, outsider.result().err)
            self.assertIn("refused this node: " + reason, lines[0])
        self.assertEqual([a.rc for a in agents], [None, None], "expected the job to run on\n%s" % self.summary())
        self.release(4)
        self.assertAllExit(agents, 0)
        self.assertEqual(cluster.keys(PREFIX), [])

    def test_etcd_user_and_password(self):
        cluster = self.cluster(auth=("root", "pw"))
        good = [self.agent(cluster, node, rule="exit 0", conf={"etcd_user": "root"},
                           env={"ELRUN_ETCD_PASSWORD": "pw"}) for node in (1, 2)]
        self.check_round(self.wait_workers(4, what="the authenticated job's workers"), 4, 2)
        self.assertAllExit(good, 0)
        bad = self.agent(cluster, 3, run_id="other", conf={"etcd_user": "root"},
                         env={"ELRUN_ETCD_PASSWORD": "wrong"})
        self.assertAllExit([bad], 1)
        lines = [l for l in bad.result().err.splitlines() if l.startswith("elrun:")]
        self.assertEqual(len(lines), 1, bad.result().err)
        self.assertIn("etcd refused user 'root'", lines[0])
        self.assertNotIn("wrong", bad.result().err)

    def test_a_user_per_job_reaches_its_own_job_and_no_other(self):
        # The operator's step (docs/operations.md): a role per job prefix, a user with it.
        cluster = self.cluster(auth=("root", "pw"))
        cluster.etcdctl("role", "add", "job-a")
        cluster.etcdctl("role", "grant-permission", "--prefix=true", "job-a", "readwrite", PREFIX + "job-a/")
        cluster.etcdctl("user", "add", "user-a:pw-job-a-7Q")
        cluster.etcdctl("user", "grant-role", "user-a", "job-a")
        cluster.put(PREFIX + "job-b/marker", "b")
        conf = {"etcd_user": "user-a"}
        env = {"ELRUN_ETCD_PASSWORD": "pw-job-a-7Q"}
        agents = [self.agent(cluster, node, run_id="job-a", rule="exit 0", conf=conf, env=env) for node in (1, 2)]
        self.check_round(self.wait_workers(4, what="job-a's workers, as user-a"), 4, 2)
        self.assertAllExit(agents, 0)
        self.assertEqual(cluster.keys(PREFIX + "job-a/"), [], "expected job-a's keys removed at its end")
        # The same user cannot join, read or write another job's keys.
        outsider = self.agent(cluster, 3, run_id="job-b", conf=conf, env=env)
        self.assertAllExit([outsider], 1)
        lines = [l for l in outsider.result().err.splitlines() if l.startswith("elrun:")]
        self.assertEqual(len(lines), 1, outsider.result().err)
        self.assertIn("permission denied", lines[0])
        self.assertNotIn("pw-job-a-7Q", outsider.result().err)
        self.assertEqual(cluster.get(PREFIX + "job-b/marker"), "b")
        self.assertEqual(cluster.keys(PREFIX + "job-b/"), [PREFIX + "job-b/marker"])

    def test_unreachable_etcd_is_a_one_line_error(self):
        # A port nothing listens on: every member is tried for 10 s (etcd may be electing).
        agent = self.start_agent(1, 0, backend="etcd-v3", nnodes=2,
                                 endpoint="127.0.0.1:%d" % harness.free_port())
        self.assertAllExit([agent], 1)
        lines = [l for l in agent.result().err.splitlines() if l.startswith("elrun:")]
        self.assertEqual(len(lines), 1, agent.result().err)
        self.assertIn("cannot join the rendezvous in etcd at 127.0.0.1:", lines[0])

    def test_a_run_id_that_would_reach_into_other_keys_is_refused(self):
        agent = self.start_agent(1, 0, run_id="job/log", backend="etcd-v3", nnodes=2,
                                 endpoint="127.0.0.1:%d" % harness.free_port())
        self.assertAllExit([agent], 1)
        self.assertIn("run id 'job/log' must be non-empty, without '/'", agent.result().err)

    def test_tls_to_etcd(self):
        tls = make_tls_files(self.tmp)
        cluster = self.cluster(tls=tls)
        # etcd 3.4 asks for a client certificate whenever it has a trusted CA: mutual TLS.
        conf = {"protocol": "https", "cacert": tls.ca, "cert": tls.client_cert, "key": tls.client_key}
        agents = [self.agent(cluster, node, rule="exit 0", conf=conf) for node in (1, 2)]
        self.check_round(self.wait_workers(4, what="the TLS job's workers"), 4, 2)
        self.assertAllExit(agents, 0)
        self.assertEqual(cluster.keys(PREFIX), [])


if __name__ == "__main__":
    unittest.main()
