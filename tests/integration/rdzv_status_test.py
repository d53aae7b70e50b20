"""elrun-rdzv's --http-listen: Prometheus metrics read with a real HTTP client, and the live
status page rendered by a real headless browser (Debian's chromium), both behind the daemon's
token, while a two-node job runs and after one of its workers fails and restarts; each node's
goodput (from its workers' heartbeats) in the status and the metrics."""
import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import harness
import rdzv_harness
from rdzv_harness import RdzvTestCase

TOKEN = "status-s3cret"
BROWSER_TIMEOUT_S = 90
# Attempt 0: node 1's local rank 0 fails once the others run; later attempts are held (GATED).
FAIL_ONCE = ('if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$NODE" = 1 ] && [ "$LOCAL_RANK" = 0 ]; '
             'then exit 3; fi; ' + rdzv_harness.GATED)
# Beats steps 0..4 (the progress heartbeat's line format), then waits for its release.
BEAT_5 = ('for i in 0 1 2 3 4; do echo "$$ $i 5.0" > "$ELRUN_HEARTBEAT_FILE"; done; ' + rdzv_harness.GATED)
PROGRESS_TIMEOUT_S = 20  # Agents send their progress every 2 s.


@harness.elrun_only("elrun-rdzv's status page")
class StatusTest(RdzvTestCase):

    def start_status_daemon(self):
        port_file = self.path("http.port")
        daemon = self.start_daemon(token=TOKEN, args=["--http-listen", "127.0.0.1:0",
                                                      "--http-port-file", port_file])
        daemon.http = "http://127.0.0.1:%s" % self.read_text(port_file).strip()
        return daemon

    def wait_restarted(self, agents):
        """Until the 4 workers of the round after the failure (restart count 1) run."""
        self.pump(lambda: sum("restarts=1 " in line for line in self.ready.lines) >= 4,
                  "the 4 workers of the restarted round", rdzv_harness.ROUND_TIMEOUT_S, agents)

    def get(self, url, token=TOKEN):
        request = urllib.request.Request(url)
        if token is not None:
            request.add_header("Authorization", "Bearer " + token)
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers.get("Content-Type"), response.read().decode()

    def metrics(self, daemon):
        status, kind, text = self.get(daemon.http + "/metrics")
        self.assertEqual(status, 200)
        self.assertEqual(kind, "text/plain; version=0.0.4; charset=utf-8")
        return {m[0]: float(m[1]) for m in re.findall(r"^(elrun_rdzv_\S+) (\S+)$", text, re.M)}

    def test_metrics_follow_the_job_and_require_the_token(self):
        daemon = self.start_status_daemon()
        for token in (None, "wrong"):
            with self.assertRaises(urllib.error.HTTPError) as refused:
                self.get(daemon.http + "/metrics", token=token)
            self.assertEqual(refused.exception.code, 401)
        agents = [self.start_agent(node, daemon.port, nnodes=2, nproc=2, rule=FAIL_ONCE,
                                   args=["--max-restarts", "1"], env={"ELRUN_RDZV_TOKEN": TOKEN})
                  for node in (1, 2)]
        self.wait_restarted(agents)
        outsider = self.start_agent(3, daemon.port, nnodes=2, nproc=1, env={"ELRUN_RDZV_TOKEN": "bad"})
        self.wait_exit([outsider], timeout=10)
        m = self.metrics(daemon)
        self.assertEqual(m['elrun_rdzv_jobs{phase="running"}'], 1)
        self.assertEqual(m['elrun_rdzv_nodes{state="active"}'], 2)
        self.assertEqual(m["elrun_rdzv_rounds_started_total"], 2)
        self.assertEqual(m["elrun_rdzv_restarts_total"], 1)
        self.assertEqual(m['elrun_rdzv_refused_total{reason="unauthenticated"}'], 1)
        self.assertGreaterEqual(m['elrun_rdzv_connections_total{result="admitted"}'], 3)
        status, kind, body = self.get(daemon.http + "/status.json?token=" + TOKEN, token=None)
        self.assertEqual((status, kind), (200, "application/json"))
        self.assertIn('"run_id": "job", "phase": "running", "round": 2, "restarts": 1', body)
        self.release(4)
        self.assertAllExit(agents, 0)
        m = self.metrics(daemon)
        self.assertEqual(m['elrun_rdzv_jobs_ended_total{result="succeeded"}'], 1)
        self.stop_daemon(daemon)

    def test_each_nodes_goodput_is_in_the_status_and_the_metrics(self):
        daemon = self.start_status_daemon()
        agents = [self.start_agent(node, daemon.port, nnodes=2, nproc=2, rule=BEAT_5,
                                   env={"ELRUN_RDZV_TOKEN": TOKEN}) for node in (1, 2)]
        self.pump(lambda: len(self.ready.lines) >= 4, "the 4 workers", rdzv_harness.ROUND_TIMEOUT_S, agents)
        deadline = time.monotonic() + PROGRESS_TIMEOUT_S
        nodes = []
        while time.monotonic() < deadline:  # Bounded: the agents report every 2 s.
            _, _, body = self.get(daemon.http + "/status.json")
            nodes = json.loads(body)["jobs"][0]["nodes"]
            if all(n["step"] == 4 and n["goodput"] is not None for n in nodes):
                break
            time.sleep(0.2)
        self.assertEqual([n["step"] for n in nodes], [4, 4], nodes)
        for node in nodes:
            self.assertGreater(node["goodput"], 0)
            self.assertLessEqual(node["goodput"], 1)
            self.assertEqual((node["lost_s"], node["faults"]), (0, 0))
        _, _, text = self.get(daemon.http + "/metrics")
        samples = re.findall(r'^elrun_rdzv_node_step\{run_id="job",node_id="[^"]+"\} (\S+)$', text, re.M)
        self.assertEqual(samples, ["4", "4"], text)
        self.assertEqual(len(re.findall(r"^elrun_rdzv_node_goodput\{", text, re.M)), 2)
        self.release(4)
        self.assertAllExit(agents, 0)
        self.stop_daemon(daemon)

    def test_the_status_page_renders_the_job_live_in_a_browser(self):
        browser = shutil.which("chromium")
        self.assertIsNotNone(browser, "chromium is not installed: run scripts/setup.sh")
        daemon = self.start_status_daemon()
        agents = [self.start_agent(node, daemon.port, nnodes=2, nproc=2, rule=FAIL_ONCE,
                                   args=["--max-restarts", "1"], env={"ELRUN_RDZV_TOKEN": TOKEN})
                  for node in (1, 2)]
        self.wait_restarted(agents)
        # Five seconds of the page's own time: it must have refreshed itself several times.
        dom = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--user-data-dir=" + self.path("chromium"), "--virtual-time-budget=5000",
             "--dump-dom", daemon.http + "/?token=" + TOKEN],
            capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S).stdout
        refreshes = re.search(r'<body data-refreshes="(\d+)"', dom)
        self.assertIsNotNone(refreshes, "expected the rendered page\n" + dom[-3000:])
        self.assertGreaterEqual(int(refreshes.group(1)), 3, "expected the page to refresh itself")
        self.assertIn('<section data-run-id="job"><h2>run job</h2>', dom)
        self.assertIn("running, round 2, restarts 1 of 1, nodes 2 (min 2, max 2)", dom)
        self.assertIn("last failure: node ", dom)
        self.assertIn("local_rank 0", dom)
        rows = re.findall(r'<tr class="node"><td>(\d+)</td><td>([^<]+)</td><td>active</td><td>2</td>'
                          r'<td>(127\.0\.0\.\d)</td><td>-</td><td>-</td><td>(?:-|[0-9.]+)</td><td>(?:-|\d+)</td></tr>',
                          dom)
        # (No beats: step and goodput unknown; time lost and faults are known once the node's first
        # Progress, sent every 2 s, has come, which the page may or may not have seen yet.)
        self.assertEqual([r[0] for r in rows], ["0", "1"], "expected both nodes by group rank\n" + dom[-3000:])
        self.assertEqual(sorted(r[2] for r in rows), ["127.0.0.1", "127.0.0.2"])
        # Without the token the page loads but its data does not.
        denied = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--user-data-dir=" + self.path("chromium2"), "--virtual-time-budget=2000",
             "--dump-dom", daemon.http + "/"], capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S).stdout
        self.assertNotIn("run job", denied)
        self.release(4)
        self.assertAllExit(agents, 0)
        self.stop_daemon(daemon)


if __name__ == "__main__":
    harness.main()
