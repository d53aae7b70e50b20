#!/usr/bin/python3
"""Rendezvous at scale, etcd-v3 backend: a real etcd on loopback against N simulated nodes."""
import os
import signal
import subprocess
import sys
import tempfile
import time

from bench import etcd_scale_report, results, runner
from bench.machine import (
    loadavg,
    machine_info,
    peak_rss_mib,
    pid_cpu_seconds,
    sh_out,
    wait_idle,
)
from tests.support import etcd_cluster, paths
from tests.support.procs import kill_group, log

BENCH = "etcd_scale_bench"
LOAD = paths.binary("etcd_load")
SMOKE = ["--sizes", "20", "--runs", "1", "--steady", "2", "--settle", "1"]


def threads(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Stalled(RuntimeError):
    """etcd_load did not print what was expected in time (or exited)."""


class LoadOutput(runner.Lines):
    """etcd_load's stdout (runner.Lines); keeps the last progress line and the counts of ended
    sessions for the report."""

    def __init__(self, proc):
        super().__init__(proc, "etcd_load", Stalled, self._note)
        self.last_progress = None
        self.ended = 0
        self.notes = []  # ended / job_ended / open_failed lines (the first few).
        self.reasons = {}  # Why sessions ended (shortened) -> how many.

    def _note(self, text):
        if text.startswith("progress "):
            self.last_progress = text
        elif text.startswith(("ended ", "job_ended ", "open_failed ")):
            if text.startswith("ended "):
                self.ended += 1
                reason = " ".join(text.split()[3:])
                reason = reason.split(" (")[0].split(":")[0] + ": " + reason.split(": ", 1)[-1][:48]
                self.reasons[reason] = self.reasons.get(reason, 0) + 1
            if len(self.notes) < 5:
                self.notes.append(text)


class SpreadCluster(etcd_cluster.EtcdCluster):
    """An EtcdCluster whose members also listen on `ports - 1` more client ports each, so that
    etcd_load can spread its nodes over that many connections per member (gRPC would otherwise
    carry every node of the process over one connection per member). endpoint_groups: the
    --endpoints value for etcd_load, one comma list of the members per port, ';' between."""

    def __init__(self, tmpdir, members, ports):
        self.ports = max(1, ports)
        self.extra_ports = {}  # (host, member index) -> its extra client ports.
        super().__init__(tmpdir, members=members)

    def _member_args(self, m):
        args = super()._member_args(m)
        if self.ports > 1:
            # Picked per address: a start retried on another address picks anew.
            extra = self.extra_ports.setdefault(
                (m.host, m.index), etcd_cluster.pick_ports(m.host, self.ports - 1))
            urls = [self.client_url(m.index)] + ["%s://%s:%d" % (self.scheme, m.host, p) for p in extra]
            args += ["--listen-client-urls", ",".join(urls)]  # The last one counts.
        return args

    @property
    def endpoint_groups(self):
        groups = [self.endpoints]
        for k in range(self.ports - 1):
            groups.append(",".join("%s:%d" % (m.host, self.extra_ports[(m.host, m.index)][k])
                                   for m in self.members))
        return ";".join(groups)


def etcd_cpu(cluster):
    return sum(pid_cpu_seconds(m.proc.pid) for m in cluster.members if m.running())


def etcd_rss(cluster):
    return max(peak_rss_mib(m.proc.pid) for m in cluster.members if m.running())


def run_once(n, args, tmp):
    lose = max(1, n // 100)
    r = {"n": n, "lost": lose, "ok": False}
    with SpreadCluster(tmp, args.members, args.connections) as cluster:
        load = None
        err_path = os.path.join(tmp, "etcd_load.%d.err" % n)
        try:
            with open(err_path, "wb") as err:
                cpu0 = etcd_cpu(cluster)
                load = subprocess.Popen(
                    [args.load, "--endpoints", cluster.endpoint_groups, "--nodes", str(n),
                     "--min-nodes", str(n - lose), "--run-id", "scale%d" % n,
                     "--lease-ms", str(args.lease_ms), "--last-call-ms", str(args.last_call_ms),
                     "--open-threads", str(args.open_threads)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                    start_new_session=True)
            out = LoadOutput(load)
            started = time.monotonic()
            # Formation: the first round that every live node holds (the sessions open meanwhile).
            formed = out.expect(lambda f: f[0] in ("formed", "opened", "open_failed"),
                                "formation", args.timeout)
            while formed[0] != "formed":
                if formed[0] == "open_failed":
                    raise Stalled("a session did not open: " + " ".join(formed))
                r["open_s"] = float(formed[2])
                try:
                    formed = out.expect(lambda f: f[0] in ("formed", "open_failed"), "formation",
                                        args.timeout - (time.monotonic() - started))
                except Stalled:
                    raise Stalled("no formation within %.0f s (every session open after %.1f s)"
                                  % (args.timeout, r["open_s"]))
            r["formation_s"], r["round"] = float(formed[2]), int(formed[1])
            r["formed_nodes"] = int(formed[3])
            r["etcd_cpu_s"] = etcd_cpu(cluster) - cpu0
            r["load_cpu_s"] = pid_cpu_seconds(load.pid)
            if "open_s" not in r:  # Formed before the last Open returned (it prints next).
                r["open_s"] = float(out.expect(lambda f: f[0] == "opened", "opened",
                                               args.timeout)[2])
            time.sleep(args.settle)  # Let the post-formation burst pass before the window.
            e0, l0, t0 = etcd_cpu(cluster), pid_cpu_seconds(load.pid), time.monotonic()
            time.sleep(args.steady)  # The measurement window itself.
            dt = time.monotonic() - t0
            r["steady_etcd_cores"] = (etcd_cpu(cluster) - e0) / dt
            r["steady_load_cores"] = (pid_cpu_seconds(load.pid) - l0) / dt
            load.stdin.write(b"lose %d\n" % lose)
            load.stdin.flush()
            lost_at = float(out.expect(lambda f: f[0] == "lost", "lost", args.timeout)[2])
            reformed = out.expect(lambda f: f[0] == "formed" and int(f[1]) > r["round"],
                                  "re-formation", args.timeout)
            r["reform_s"] = float(reformed[2]) - lost_at
            r["survivors"] = int(reformed[3])
            r["ok"] = True
        except Stalled as e:
            r["error"] = str(e)
        finally:
            if load is not None:
                r["etcd_rss_mib"] = etcd_rss(cluster)
                r["load_rss_mib"] = peak_rss_mib(load.pid)
                r["load_threads"] = threads(load.pid)
                if "etcd_cpu_s" not in r:  # How much it took to get as far as it got.
                    r["etcd_cpu_s"] = etcd_cpu(cluster) - cpu0
                    r["load_cpu_s"] = pid_cpu_seconds(load.pid)
                if load.poll() is None:
                    try:  # Every node leaves (revokes its lease); bounded, then killed.
                        load.stdin.write(b"quit\n")
                        load.stdin.flush()
                        t = time.monotonic()
                        load.wait(timeout=args.quit_timeout if r["ok"] else 10)
                        r["quit_s"] = time.monotonic() - t
                    except (OSError, subprocess.TimeoutExpired):
                        r["quit_s"] = None
                    if load.poll() is None:
                        kill_group(load.pid)
                        load.wait()
                r["progress"] = out.last_progress if load is not None else None
                r["ended"], r["notes"], r["end_reasons"] = out.ended, out.notes, out.reasons
                with open(err_path, "rb") as f:
                    r["stderr_tail"] = f.read()[-400:].decode(errors="replace")
    return r


def main():
    ap = runner.parser(BENCH, __doc__)
    ap.add_argument("--sizes", default="100,1000")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--members", type=int, default=1, help="etcd cluster members (1 or 3)")
    ap.add_argument("--lease-ms", type=int, default=5000,
                    help="lease TTL = heartbeat_timeout (elrun's default 5 s)")
    ap.add_argument("--last-call-ms", type=int, default=1000)
    ap.add_argument("--open-threads", type=int, default=0,
                    help="threads opening the sessions in turn (0: one per node, all at once)")
    ap.add_argument("--connections", type=int, default=32,
                    help="client ports per etcd member, so TCP connections per member from etcd_load "
                         "(1: gRPC shares one among all nodes)")
    ap.add_argument("--steady", type=float, default=10.0, help="seconds of the steady window")
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="bound on each phase: formation, lost, re-formation (default %(default)s)")
    ap.add_argument("--quit-timeout", type=float, default=60.0,
                    help="bound on etcd_load leaving cleanly before it is killed")
    ap.add_argument("--load", default=LOAD)
    args = runner.parse(ap, SMOKE)
    # SIGTERM / SIGHUP: unwind through the finally blocks that stop etcd and etcd_load.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signo, _frame: sys.exit(128 + signo))
    if not os.access(args.load, os.X_OK):
        sys.exit("no %s; run bazel build //tests/load:etcd_load" % args.load)
    sizes = [int(s) for s in args.sizes.split(",")]
    runs = {n: [] for n in sizes}
    with tempfile.TemporaryDirectory(prefix="etcd_scale_bench.") as tmp:
        for run in range(args.runs):
            wait_idle(args.wait_idle)
            for n in sizes:  # Interleaved: a slow moment of the machine hits every size.
                r = run_once(n, args, tmp)
                if r["ok"]:
                    log("run %d N=%d: open %.2f s, formation %.2f s (round %d), etcd CPU %.2f s, "
                        "agents CPU %.2f s, steady etcd %.3f / agents %.3f cores, re-formation "
                        "%.3f s, etcd RSS %.1f MiB, etcd_load RSS %.1f MiB"
                        % (run + 1, n, r["open_s"], r["formation_s"], r["round"], r["etcd_cpu_s"],
                           r["load_cpu_s"], r["steady_etcd_cores"], r["steady_load_cores"],
                           r["reform_s"], r["etcd_rss_mib"], r["load_rss_mib"]))
                else:
                    log("run %d N=%d FAILED: %s; last progress: %s; %d sessions ended; %s"
                        % (run + 1, n, r["error"], r["progress"], r["ended"], r["notes"][:2]))
                runs[n].append(r)
    etcd_version = sh_out([etcd_cluster.ETCD, "--version"]).splitlines()
    record = dict(results.stamp(BENCH), machine=dict(machine_info([("etcd_load", args.load)])),
                  options=runner.options_record(args), load=f"loadavg at the end {loadavg()}",
                  etcd="%s (%s)" % (etcd_version[0] if etcd_version else "?", etcd_cluster.ETCD),
                  sizes=sizes, **{str(n): rs for n, rs in runs.items()})
    results.publish(args, record, etcd_scale_report)
    return 1 if any(not r["ok"] for rs in runs.values() for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())

