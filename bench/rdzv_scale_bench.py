#!/usr/bin/python3
"""Rendezvous at scale: one elrun-rdzv daemon against N simulated nodes (tests/load/rdzv_load)."""
import os
import subprocess
import sys
import tempfile
import time

from bench import rdzv_scale_report, results, runner
from bench.machine import (
    loadavg,
    machine_info,
    peak_rss_mib,
    pid_cpu_seconds,
    wait_idle,
)
from tests.support import paths
from tests.support.procs import log

BENCH = "rdzv_scale_bench"
RDZV = paths.binary("elrun-rdzv")
LOAD = paths.binary("rdzv_load")
SMOKE = ["--sizes", "100", "--runs", "1", "--steady", "2", "--settle", "1"]
TOKEN = "scale-bench-token"


def run_once(n, args, tmp):
    env = dict(os.environ, ELRUN_RDZV_TOKEN=TOKEN)
    port_file = os.path.join(tmp, "port.%d" % n)
    if os.path.exists(port_file):
        os.remove(port_file)
    daemon = subprocess.Popen([args.rdzv, "--listen", "127.0.0.1:0", "--port-file", port_file],
                              stdout=subprocess.DEVNULL, env=env, start_new_session=True)
    load = None
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(port_file):  # Bounded: the daemon writes it once listening.
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise RuntimeError("elrun-rdzv did not start")
            time.sleep(0.02)
        port = open(port_file).read().strip()
        lose = max(1, n // 100)
        load = subprocess.Popen([args.load, "--endpoint", "127.0.0.1:" + port, "--nodes", str(n),
                                 "--min-nodes", str(n - lose), "--channels", str(args.channels),
                                 "--heartbeat-ms", "1000", "--run-id", "scale%d" % n],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                start_new_session=True)
        lines = runner.Lines(load, "rdzv_load")
        formed = lines.expect(lambda f: f[:2] == ["formed", "1"], "'formed 1 ' line", args.timeout)
        formation_s = float(formed[2])
        formation_cpu = pid_cpu_seconds(daemon.pid)
        time.sleep(args.settle)  # Let the post-formation burst pass before the steady window.
        cpu0, t0 = pid_cpu_seconds(daemon.pid), time.monotonic()
        time.sleep(args.steady)  # The measurement window itself.
        heartbeat_cores = (pid_cpu_seconds(daemon.pid) - cpu0) / (time.monotonic() - t0)
        load.stdin.write(b"lose %d\n" % lose)
        load.stdin.flush()
        lost_at = float(lines.expect(lambda f: f[0] == "lost", "'lost ' line", args.timeout)[2])
        reformed = lines.expect(lambda f: f[:2] == ["formed", "2"], "'formed 2 ' line", args.timeout)
        reform_s = float(reformed[2]) - lost_at
        rss = peak_rss_mib(daemon.pid)
        load.stdin.write(b"quit\n")
        load.stdin.flush()
        load.wait(timeout=60)
        return {"formation_s": formation_s, "formation_cpu_s": formation_cpu, "heartbeat_cores": heartbeat_cores,
                "reform_s": reform_s, "rss_mib": rss, "lost": lose, "survivors": int(reformed[3])}
    finally:
        for proc in (load, daemon):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


def main():
    ap = runner.parser(BENCH, __doc__)
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--channels", type=int, default=16, help="TCP connections of rdzv_load")
    ap.add_argument("--steady", type=float, default=10.0, help="seconds of the heartbeat window")
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--rdzv", default=RDZV)
    ap.add_argument("--load", default=LOAD)
    runner.add_run_options(ap, timeout=120)
    args = runner.parse(ap, SMOKE)
    sizes = [int(s) for s in args.sizes.split(",")]
    runs = {n: [] for n in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            wait_idle(args.wait_idle)
            for n in sizes:  # Interleaved: a slow moment of the machine hits every size.
                r = run_once(n, args, tmp)
                log("run %d N=%d: formation %.3f s, heartbeats %.3f cores, re-formation %.3f s, RSS %.1f MiB"
                    % (run + 1, n, r["formation_s"], r["heartbeat_cores"], r["reform_s"], r["rss_mib"]))
                runs[n].append(r)
    record = dict(results.stamp(BENCH),
                  machine=dict(machine_info([("elrun-rdzv", args.rdzv), ("rdzv_load", args.load)])),
                  options=runner.options_record(args), load=f"loadavg at the end {loadavg()}",
                  sizes=sizes, results={str(n): rs for n, rs in runs.items()})
    results.publish(args, record, rdzv_scale_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
