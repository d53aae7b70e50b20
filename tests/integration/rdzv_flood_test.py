"""Denial of service without credentials: a flood of silent TCP connections against a daemon
whose descriptor limit is 1024 (soft and hard, so it cannot raise it). gRPC 1.51's own listener
stopped accepting for good after one EMFILE, and a legitimate job never formed again. The
coordinator's connection gate bounds connections in all and per address, closes silent ones,
and never runs out of descriptors: a job forms during a flood from one address, and within 1 s
after a flood from many addresses ends."""
import resource
import select
import socket
import time
import unittest

import harness
import rdzv_harness
from rdzv_harness import RdzvTestCase

FLOOD = 1100  # Connections, beyond the daemon's 1024 descriptors.
DAEMON_FDS = 1024
FORM_BOUND_S = 1.0
SETTLE_TIMEOUT_S = 20.0  # The gate closes silent connections after 5 s.


def limit_descriptors():
    resource.setrlimit(resource.RLIMIT_NOFILE, (DAEMON_FDS, DAEMON_FDS))


@harness.elrun_only("multi-node rendezvous through elrun-rdzv")
class FloodTest(RdzvTestCase):

    def setUp(self):
        super().setUp()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = FLOOD + 512
        if hard != resource.RLIM_INFINITY and hard < want:
            self.fail("this test needs %d descriptors; the hard limit is %d" % (want, hard))
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
        self.addCleanup(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))
        self.flood_socks = []
        self.addCleanup(self.end_flood)

    def flood(self, port, sources):
        """FLOOD silent connections to the daemon, spread over `sources` (loopback addresses)."""
        for i in range(FLOOD):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.bind((sources[i % len(sources)], 0))
            try:
                s.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            self.flood_socks.append(s)

    def wait_flood_closed(self):
        """Waits until the daemon has closed every flood connection (refused at once, or silent
        for the gate's 5 s), each seen as EOF or a reset."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        open_socks = list(self.flood_socks)
        for _ in range(100000):
            if not open_socks or time.monotonic() > deadline:
                break
            poller = select.poll()
            by_fd = {s.fileno(): s for s in open_socks}
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(500):
                s = by_fd[fd]
                try:
                    data = s.recv(1)
                except BlockingIOError:
                    continue  # Not closed after all.
                except OSError:  # Reset or refused: closed by the daemon.
                    data = b""
                if not data:
                    open_socks.remove(s)
        self.assertEqual(len(open_socks), 0,
                         "expected the daemon to close all %d flood connections within %.0f s; "
                         "%d still open" % (FLOOD, SETTLE_TIMEOUT_S, len(open_socks)))

    def end_flood(self):
        for s in self.flood_socks:
            s.close()
        self.flood_socks = []

    def form_job(self, daemon, run_id, bound=None):
        """Starts a 2-node job and waits for both agents' round 1; returns how long that took."""
        started = time.monotonic()
        agents = [self.start_agent(node, daemon.port, run_id=run_id, nnodes=2, nproc=1)
                  for node in (1, 2)]
        self.pump(lambda: all(rdzv_harness.ROUND_LINE.search(a.stderr) for a in agents),
                  "both agents of %s to start round 1" % run_id, 30, alive=agents)
        took = time.monotonic() - started
        self.wait_workers(2, alive=())
        self.assertAllExit(agents, 0)
        return took

    def test_a_job_forms_within_1s_after_a_flood_from_many_addresses(self):
        daemon = self.start_daemon(preexec_fn=limit_descriptors)
        self.flood(daemon.port, ["127.0.0.%d" % n for n in range(10, 32)])
        self.wait_flood_closed()
        self.end_flood()
        took = self.form_job(daemon, "after-flood")
        self.assertLess(took, FORM_BOUND_S,
                        "expected a job to form within %.1f s after the flood; took %.2f s"
                        % (FORM_BOUND_S, took))
        self.stop_daemon(daemon)

    def test_a_job_of_80_nodes_on_one_machine_forms(self):
        # Every agent comes from 127.0.0.1: a per-address limit of 64 kept 16 of them out, and
        # the 64 inside waited for them until join_timeout.
        daemon = self.start_daemon()
        agents = [self.start_agent(1, daemon.port, nnodes=80, nproc=1, env={"LOGLEVEL": None})
                  for _ in range(80)]
        records = self.wait_workers(80, alive=agents, what="the 80 workers of the round")
        self.assertEqual(sorted(r["rank"] for r in records), list(range(80)))
        self.assertAllExit(agents, 0)
        self.stop_daemon(daemon)

    def test_a_job_forms_while_one_address_floods(self):
        daemon = self.start_daemon(preexec_fn=limit_descriptors)
        self.flood(daemon.port, ["127.0.0.9"])
        took = self.form_job(daemon, "during-flood")
        self.assertLess(took, 10.0, "expected the job to form during the flood\n%s" % self.summary())
        self.end_flood()
        self.stop_daemon(daemon)


if __name__ == "__main__":
    unittest.main()
