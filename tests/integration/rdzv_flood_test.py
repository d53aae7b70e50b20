"""Denial of service without credentials: a flood of silent TCP connections against a daemon
whose descriptor limit is 1024 (soft and hard, so it cannot raise it). gRPC 1.51's own listener
stopped accepting for good after one EMFILE, and a legitimate job never formed again. The
coordinator's connection gate bounds connections in all and per address, closes silent ones,
and never runs out of descriptors: a job forms during a flood from one address, and within 1 s
after a flood from many addresses ends.

Issue 31's attacks on the gate: connections that speak HTTP/2 but never prove the token were all
still open 35 s later, keeping the per-address and total limits full; now the gate closes them
within its 5 s authentication deadline. And 400 addresses that reconnect at once against
--max-connections 256 kept a 2-node job from ever forming; now the oldest unauthenticated
connection makes room for a newcomer, and an authenticated one keeps its place."""
import resource
import select
import selectors
import socket
import threading
import time
import unittest

import harness
import rdzv_harness
from rdzv_harness import RdzvTestCase

FLOOD = 1100  # Connections, beyond the daemon's 1024 descriptors.
DAEMON_FDS = 1024
FORM_BOUND_S = 1.0
SETTLE_TIMEOUT_S = 20.0  # The gate closes silent connections after 5 s.
AUTH_DEADLINE_S = 5.0  # The gate's default auth_timeout.
# What an HTTP/2 client sends first: the preface and an empty SETTINGS frame.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


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


    def test_connections_that_never_authenticate_are_closed_by_the_deadline(self):
        # 64 connections from one address (its default limit), each speaking HTTP/2 and then
        # waiting for ever without proving the token.
        daemon = self.start_daemon()
        socks = []
        started = time.monotonic()
        for _ in range(64):
            s = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
            s.sendall(H2_PREFACE)
            socks.append(s)
        try:
            deadline = started + AUTH_DEADLINE_S + 5.0
            open_socks = list(socks)
            while open_socks and time.monotonic() < deadline:
                readable, _, _ = select.select(open_socks, [], [], 0.5)
                for s in readable:
                    try:
                        data = s.recv(65536)
                    except OSError:
                        data = b""
                    if not data:  # Closed; anything else is gRPC's own frames.
                        open_socks.remove(s)
            took = time.monotonic() - started
            self.assertEqual(len(open_socks), 0, "expected the gate to close all 64 unauthenticated connections "
                             "within %.0f s; %d still open" % (AUTH_DEADLINE_S + 5.0, len(open_socks)))
            print("64 unauthenticated connections closed %.1f s after they opened" % took)
            # Their places are free again: a job forms from the same address.
            self.form_job(daemon, "after-idle")
        finally:
            for s in socks:
                s.close()
        self.stop_daemon(daemon)

    def test_a_job_forms_while_400_addresses_reconnect_against_256_places(self):
        daemon = self.start_daemon(args=["--max-connections", "256"])
        stop, filled = threading.Event(), threading.Event()
        counts = {"connected": 0}

        def reconnect_flood():
            """One connection per address of 127.0.1.0-127.0.2.143, each sending the HTTP/2
            preface and opened again as soon as the daemon closes it; until `stop`, 120 s at
            most."""
            sources = ["127.0.%d.%d" % (1 + i // 256, i % 256) for i in range(400)]
            selector = selectors.DefaultSelector()  # epoll: descriptors may pass 1024.

            def open_one(source):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setblocking(False)
                s.bind((source, 0))
                try:
                    s.connect(("127.0.0.1", daemon.port))
                except BlockingIOError:
                    pass
                selector.register(s, selectors.EVENT_WRITE, source)

            for source in sources:
                open_one(source)
            end = time.monotonic() + 120
            while not stop.is_set() and time.monotonic() < end:
                for key, events in selector.select(0.2):
                    s, source = key.fileobj, key.data
                    if events & selectors.EVENT_WRITE:  # Connected (or refused): say the preface.
                        try:
                            s.send(H2_PREFACE)
                            counts["connected"] += 1
                            if counts["connected"] >= 256:
                                filled.set()
                            selector.modify(s, selectors.EVENT_READ, source)
                            continue
                        except OSError:
                            data = b""
                    else:
                        try:
                            data = s.recv(65536)
                        except (BlockingIOError, InterruptedError):
                            continue
                        except OSError:
                            data = b""
                    if not data:  # Closed: at once again, from the same address.
                        selector.unregister(s)
                        s.close()
                        open_one(source)
            for key in list(selector.get_map().values()):
                key.fileobj.close()
            selector.close()

        flooder = threading.Thread(target=reconnect_flood)
        flooder.start()
        try:
            self.assertTrue(filled.wait(30), "expected the flood to fill the daemon's 256 places within 30 s")
            took = self.form_job(daemon, "during-reconnect-flood")
            print("a 2-node job formed in %.1f s while 400 addresses reconnected (%d connections so far)"
                  % (took, counts["connected"]))
        finally:
            stop.set()
            flooder.join()
        self.stop_daemon(daemon)


if __name__ == "__main__":
    unittest.main()
