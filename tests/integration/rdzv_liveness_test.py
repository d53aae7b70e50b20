"""A coordinator that stops answering: SIGSTOP'd, its stream neither breaks nor speaks. Every
agent must notice within about heartbeat_timeout (HTTP/2 keepalive pings that go unanswered),
stop its workers and exit with a cause naming the coordinator, instead of waiting for ever."""
import signal
import time
import unittest

import harness
import rdzv_harness
from rdzv_harness import RdzvTestCase

HEARTBEAT_TIMEOUT_S = 1.5
# Pings each keepalive interval (1 s at least), unanswered for heartbeat_timeout: about 2.5 s,
# then the workers' SIGTERM and exit. Before the fix the agents waited for ever.
EXIT_BOUND_S = 8.0


@harness.elrun_only("multi-node rendezvous through elrun-rdzv")
class CoordinatorLossTest(RdzvTestCase):

    def test_sigstop_of_the_coordinator_agents_stop_their_workers_and_exit(self):
        daemon = self.start_daemon()
        conf = {"heartbeat_interval": "0.2", "heartbeat_timeout": str(HEARTBEAT_TIMEOUT_S)}
        agents = [self.start_agent(node, daemon.port, nnodes=2, nproc=2, conf=conf,
                                   rule=rdzv_harness.hold_while_world(4),
                                   env={"TORCHELASTIC_ERROR_FILE": self.path("error.%d.json" % node)})
                  for node in (1, 2)]
        first = self.wait_workers(4, alive=agents, what="the job's 4 workers to start")
        fds = self.pidfds(first)

        stopped = time.monotonic()
        daemon.proc.send_signal(signal.SIGSTOP)
        self.wait_exit(agents, timeout=EXIT_BOUND_S + 20)
        took = time.monotonic() - stopped
        self.assertLess(took, EXIT_BOUND_S,
                        "expected both agents to give up on the frozen coordinator within "
                        "%.1f s; took %.2f s\n%s" % (EXIT_BOUND_S, took, self.summary()))
        for agent in agents:
            self.assertExit(agent.result(), 1)
            self.assertIn("lost the rendezvous coordinator at 127.0.0.1:%d" % daemon.port,
                          agent.stderr, "expected %s to name the coordinator\n%s"
                          % (agent.name, agent.result()))
            # An outer launcher or scheduler learns the cause from the launcher's error file.
            message = self.read_json("error.%d.json" % agent.node)["message"]["message"]
            self.assertTrue(message.startswith("RendezvousError: lost the rendezvous coordinator"),
                            message)
        self.assertDead(fds, "the workers and their grandchildren")
        self.assertNoMoreWorkers()
        daemon.proc.send_signal(signal.SIGCONT)
        self.stop_daemon(daemon)

    def test_a_daemon_restarted_by_its_supervisor_the_nodes_rejoin_and_the_job_goes_on(self):
        # What systemd's Restart=always does after elrun-rdzv dies: the same port, a new process
        # that knows nothing of the job. The nodes lose the stream, stop their workers, rejoin
        # within rejoin_timeout, see another incarnation and accept its round 1.
        daemon = self.start_daemon()
        conf = {"heartbeat_interval": "0.2", "heartbeat_timeout": str(HEARTBEAT_TIMEOUT_S), "rejoin_timeout": "20"}
        agents = [self.start_agent(node, daemon.port, nnodes=2, nproc=1, conf=conf, rule=rdzv_harness.GATED,
                                   args=["--history-file", self.path("history.%d" % node)])
                  for node in (1, 2)]
        first = self.wait_workers(2, alive=agents, what="the job's 2 workers to start")
        fds = self.pidfds(first)
        daemon.proc.kill()
        self.wait_exit([daemon])
        self.assertDead(fds, "the first round's workers, stopped when the coordinator went away")
        again = self.start_daemon(port=daemon.port)  # The port it had: free since it died.
        second = self.wait_workers(2, alive=agents, what="the job's workers under the restarted daemon")
        self.assertEqual(sorted((r["world"], r["restarts"]) for r in second), [(2, 0), (2, 0)])
        self.release(2)
        self.assertAllExit(agents, 0)
        for agent in agents:
            self.assertIn("the rendezvous coordinator at 127.0.0.1:%d restarted" % daemon.port, agent.stderr)
            self.assertEqual([r["round"] for r in agent.rounds()], [1, 1])
        from tests.support import history_check
        histories = {n: history_check.read_jsonl(self.path("history.%d" % n)) for n in (1, 2)}
        self.assertEqual(history_check.check(histories), [], histories)
        self.stop_daemon(again)


if __name__ == "__main__":
    unittest.main()
