"""What may not enter a running job: a node with a wrong or missing rendezvous token is refused
with one clear line and exit 1, so is a node with the daemon's token but not the run's own
credential (run_token), and a node with another --rdzv-id joins another job (where it
fails on its own after its join_timeout); the job itself goes on unchanged and succeeds. One
daemon serves two jobs at once, each with its own world."""
import time

import harness
import rdzv_harness
from rdzv_harness import RdzvTestCase

TOKEN = "s3cret-token"


@harness.elrun_only("multi-node rendezvous through elrun-rdzv")
class IsolationTest(RdzvTestCase):

    def start_held_job(self, daemon, **options):
        """Nodes 1 and 2 of run "job", 2 workers each, held (GATED) once they run."""
        agents = [self.start_agent(node, daemon.port, nproc=2, rule=rdzv_harness.GATED,
                                   **options) for node in (1, 2)]
        records = self.wait_workers(4, alive=agents, what="the job's 4 workers to start")
        self.assertEqual({r["world"] for r in records}, {4})
        return agents

    def finish_held_job(self, agents):
        """Releases the job's 4 workers; expects one round of world 4 and exit 0 everywhere."""
        self.release(4)
        self.assertAllExit(agents, 0)
        self.assertNoMoreWorkers()
        for agent in agents:
            self.assertEqual([(r["round"], r["world"]) for r in agent.rounds()], [(1, 4)],
                             "expected the job to keep its single round of world 4\n%s"
                             % agent.result())

    def start_outsider(self, daemon, node, **options):
        """A 1-worker node with elrun's default log level (its stderr is only its errors)."""
        env = {"LOGLEVEL": None}
        env.update(options.pop("env", {}))
        return self.start_agent(node, daemon.port, nproc=1, env=env, **options)

    def test_a_coordinator_that_cannot_prove_the_token_is_not_trusted(self):
        # What a squatter on the endpoint's port looks like to an agent: a coordinator without
        # the token. The agent proves the token without sending it, sees no proof back, and
        # leaves before anything from it can start a worker.
        daemon = self.start_daemon()  # No token.
        agent = self.start_outsider(daemon, 1, nnodes=1, env={"ELRUN_RDZV_TOKEN": TOKEN},
                                    rule="touch \"$OUT_DIR/ran\"")
        self.wait_exit([agent], timeout=10)
        self.assertExit(agent.result(), 1)
        self.assertEqual(agent.stderr, "elrun: the rendezvous coordinator at 127.0.0.1:%d could "
                         "not prove it knows the token (is another process holding that port?); "
                         "leaving the job\n" % daemon.port, agent.result())
        self.assertNoMoreWorkers()
        self.stop_daemon(daemon)

    def test_wrong_or_missing_token_refused_while_job_runs(self):
        daemon = self.start_daemon(token=TOKEN)
        agents = self.start_held_job(daemon, nnodes=2, env={"ELRUN_RDZV_TOKEN": TOKEN})
        refused = [  # (agent, why it is refused)
            (self.start_outsider(daemon, 3, nnodes=2, env={"ELRUN_RDZV_TOKEN": "not-the-token"}),
             "wrong rendezvous token"),
            (self.start_outsider(daemon, 4, nnodes=2),
             "this coordinator requires a token (--rdzv-conf token=... or ELRUN_RDZV_TOKEN)"),
            # A token from --rdzv-conf is checked the same way.
            (self.start_outsider(daemon, 5, nnodes=2, conf={"token": "also-wrong"}),
             "wrong rendezvous token"),
        ]
        self.wait_exit([agent for agent, _ in refused], timeout=10)
        for agent, reason in refused:
            self.assertExit(agent.result(), 1)
            self.assertEqual(agent.stderr, "elrun: the rendezvous at 127.0.0.1:%d refused this "
                             "node: %s\n" % (daemon.port, reason),
                             "expected exactly one line naming the refusal\n%s" % agent.result())
            self.assertLess(agent.result().elapsed, 5.0, "expected a prompt refusal")
        self.assertEqual([a.rc for a in agents], [None, None],
                         "expected the job to run on\n%s" % self.summary())
        self.finish_held_job(agents)
        self.stop_daemon(daemon)

    def test_the_daemon_token_alone_does_not_enter_a_run(self):
        # One daemon token for all, and a run_token per run: the run's first node binds the
        # run to its credential. A node holding only the daemon's token, or another run's
        # token, is refused with one line; before, it was wait-listed in the job and could
        # have ended its rounds or failed it.
        daemon = self.start_daemon(token=TOKEN)
        # Node 1 and 2 hold the same secrets, node 2's on its command line.
        agents = [self.start_agent(1, daemon.port, nnodes=2, nproc=2, rule=rdzv_harness.GATED,
                                   env={"ELRUN_RDZV_TOKEN": TOKEN, "ELRUN_RUN_TOKEN": "run-1"}),
                  self.start_agent(2, daemon.port, nnodes=2, nproc=2, rule=rdzv_harness.GATED,
                                   conf={"token": TOKEN, "run_token": "run-1"})]
        self.wait_workers(4, alive=agents, what="the job's 4 workers to start")
        shown = harness.cmdline(agents[1].proc.pid)
        self.assertNotIn(TOKEN, shown, "expected token= blanked in /proc/PID/cmdline")
        self.assertNotIn("run-1", shown, "expected run_token= blanked in /proc/PID/cmdline")
        self.assertIn("run_token=*****", shown)
        refused = [
            (self.start_outsider(daemon, 3, nnodes=2, env={"ELRUN_RDZV_TOKEN": TOKEN}),
             "another run credential by its first node; this node has a different one"),
            (self.start_outsider(daemon, 4, nnodes=2, env={"ELRUN_RDZV_TOKEN": TOKEN},
                                 conf={"run_token": "run-2"}),
             "another run credential by its first node; this node has a different one"),
        ]
        self.wait_exit([agent for agent, _ in refused], timeout=10)
        for agent, reason in refused:
            self.assertExit(agent.result(), 1)
            self.assertEqual(agent.stderr, "elrun: the rendezvous at 127.0.0.1:%d refused this "
                             "node: run job is bound to %s (every node of a run needs the same "
                             "run_token, or token when there is no run_token)\n"
                             % (daemon.port, reason),
                             "expected exactly one line naming the refusal\n%s" % agent.result())
        self.assertEqual([a.rc for a in agents], [None, None],
                         "expected the job to run on\n%s" % self.summary())
        self.finish_held_job(agents)
        self.stop_daemon(daemon)

    def test_require_run_token_the_daemon_token_alone_reaches_no_run(self):
        # elrun-rdzv --require-run-token: a run whose nodes hold only the daemon's token (their
        # run key is the token's own) cannot even begin; a run with its own run_token can.
        daemon = self.start_daemon(token=TOKEN, args=["--require-run-token"])
        outsider = self.start_outsider(daemon, 3, nnodes=2, env={"ELRUN_RDZV_TOKEN": TOKEN})
        self.wait_exit([outsider], timeout=10)
        self.assertExit(outsider.result(), 1)
        self.assertEqual(outsider.stderr, "elrun: the rendezvous at 127.0.0.1:%d refused this node: run job has no "
                         "credential of its own, and this coordinator requires one for every run "
                         "(run_token_file=PATH or ELRUN_RUN_TOKEN on every node)\n" % daemon.port,
                         "expected exactly one line naming the refusal\n%s" % outsider.result())
        agents = [self.start_agent(node, daemon.port, nnodes=2, nproc=1, rule=rdzv_harness.EXIT_0,
                                   env={"ELRUN_RDZV_TOKEN": TOKEN, "ELRUN_RUN_TOKEN": "run-1"}) for node in (1, 2)]
        self.wait_workers(2, alive=agents, what="the job's 2 workers, with their run_token")
        self.assertAllExit(agents, 0)
        self.stop_daemon(daemon)

    def test_other_run_id_does_not_enter_the_job(self):
        daemon = self.start_daemon()
        # 2:3 with no last call: the job runs with 2 nodes and would scale up to a third.
        options = dict(nnodes="2:3", conf={"last_call_timeout": "0"})
        agents = self.start_held_job(daemon, **options)
        started = time.monotonic()
        outsider = self.start_outsider(daemon, 3, run_id="other-job", nnodes="2:3",
                                       conf={"last_call_timeout": "0", "join_timeout": "1"})
        self.wait_exit([outsider], timeout=10)
        took = time.monotonic() - started
        self.assertExit(outsider.result(), 1)
        self.assertEqual(outsider.stderr, "elrun: the job failed: only 1 of min 2 nodes joined "
                         "within join_timeout 1000 ms\n",
                         "expected one line saying the other job never formed\n%s"
                         % outsider.result())
        self.assertLess(took, 5.0, "expected the outsider to give up about join_timeout=1 s "
                        "after it started")
        self.assertEqual([a.rc for a in agents], [None, None],
                         "expected the job to run on\n%s" % self.summary())
        self.finish_held_job(agents)
        self.stop_daemon(daemon)

    def test_one_daemon_serves_two_jobs_at_once(self):
        daemon = self.start_daemon()
        jobs = {"alpha": (1, (1, 2)), "beta": (3, (3, 4))}  # run id: (nproc, nodes)
        agents = [self.start_agent(node, daemon.port, run_id=run_id, nnodes=2, nproc=nproc,
                                   rule=rdzv_harness.GATED)
                  for run_id, (nproc, nodes) in jobs.items() for node in nodes]
        # Every worker of both jobs runs before any is released: the jobs run at the same time.
        records = self.wait_workers(8, alive=agents, what="both jobs' workers to start")
        self.release(8)
        self.assertAllExit(agents, 0)
        self.assertNoMoreWorkers()
        masters = set()
        for run_id, (nproc, nodes) in jobs.items():
            mine = [r for r in records if r["run"] == run_id]
            self.assertEqual(sorted(r["node"] for r in mine), sorted(list(nodes) * nproc),
                             "expected run %s to hold exactly its own nodes' workers\n%s"
                             % (run_id, self.summary()))
            self.assertEqual({r["world"] for r in mine}, {2 * nproc})
            self.assertEqual(sorted(r["rank"] for r in mine), list(range(2 * nproc)))
            (master,) = {(r["master_addr"], r["master_port"]) for r in mine}
            self.assertIn(master[0], ["127.0.0.%d" % n for n in nodes],
                          "expected run %s's master on one of its own nodes" % run_id)
            masters.add(master)
        self.assertEqual(len(masters), 2, "expected each job its own master")
        self.stop_daemon(daemon)


if __name__ == "__main__":
    harness.main()
