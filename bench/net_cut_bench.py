#!/usr/bin/python3
"""How long a link may be cut without costing the job a round (network namespaces; root)."""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from bench import net_cut_report, results, runner
from bench.machine import wait_idle
from tests.support import history_check, netlab, paths
from tests.support.procs import log

BENCH = "net_cut_bench"
LISTENING = re.compile(r"listening on [\d.]+:(\d+)")
WORKER = 'while [ ! -e "$STOP" ]; do sleep 0.1; done'
SMOKE = ["--cuts", "0.5,3", "--trials", "1"]


def wait_for(what, predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # Bounded poll of files another process writes.
        if predicate():
            return
        time.sleep(0.05)
    raise RuntimeError("no %s within %.0f s" % (what, timeout))


def trial(args, fault, cut_s, tmp):
    lab = netlab.NetLab(3)
    procs = []
    try:
        daemon = subprocess.Popen(lab.command(1, [args.rdzv, "--listen", "%s:0" % lab.addr(1)]),
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(daemon)
        port = LISTENING.search(daemon.stdout.readline()).group(1)
        stop = os.path.join(tmp, "stop")
        conf = "heartbeat_interval=0.5,heartbeat_timeout=%g,rejoin_timeout=30,last_call_timeout=1,join_timeout=30" % (
            args.heartbeat_timeout)
        histories = {h: os.path.join(tmp, "history_h%d.jsonl" % h) for h in (2, 3)}
        for h in (2, 3):
            argv = [args.elrun, "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", "%s:%s" % (lab.addr(1), port), "--rdzv-id", "bench", "--local-addr",
                    lab.addr(h), "--rdzv-conf", conf, "--history-file", histories[h], "--no-python", "sh", "-c",
                    WORKER]
            with open(os.path.join(tmp, "agent%d.log" % h), "w") as out:
                procs.append(subprocess.Popen(lab.command(h, argv), stdout=out, stderr=out,
                                              env=dict(os.environ, STOP=stop)))

        def events(h):
            return [e["event"] for e in history_check.read_jsonl(histories[h])]

        wait_for("round 1's workers", lambda: all("workers_started" in events(h) for h in (2, 3)), 30)
        if fault == "link":
            lab.cut(3)
        else:
            lab.partition([3], [1])
        time.sleep(cut_s)  # The fault's length, the quantity measured.
        lab.heal_all()
        time.sleep(args.heartbeat_timeout + 2)  # What the cut sets off happens within this.
        rounds = {h: [e["round"] for e in history_check.read_jsonl(histories[h]) if e["event"] == "round"]
                  for h in (2, 3)}
        lost = "coordinator_lost" in events(3)
        with open(stop, "w"):
            pass
        for p in procs[1:]:
            p.wait(timeout=30)
        problems = history_check.check({h: history_check.read_jsonl(histories[h]) for h in (2, 3)})
        return {"fault": fault, "cut_s": cut_s, "kept": rounds == {2: [1], 3: [1]} and not lost, "node_lost": lost,
                "rounds": {str(h): r for h, r in rounds.items()}, "history_problems": problems}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lab.close()


def main():
    ap = runner.parser(BENCH, __doc__)
    ap.add_argument("--cuts", default="0.5,1,1.5,2,2.5,3,3.5", help="cut lengths, seconds")
    ap.add_argument("--faults", default="link,drop", help="link, drop or both")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--heartbeat-timeout", type=float, default=4.0)
    args = runner.parse(ap, SMOKE)
    reason = netlab.unavailable()
    if reason:
        sys.exit("net_cut_bench: " + reason)
    args.elrun = os.environ.get("ELRUN_BIN") or paths.binary("elrun")
    args.rdzv = os.environ.get("ELRUN_RDZV_BIN") or paths.binary("elrun-rdzv")
    started = time.monotonic()
    runs = []
    for t in range(args.trials):
        wait_idle(args.wait_idle)
        for fault in args.faults.split(","):
            for cut in [float(c) for c in args.cuts.split(",")]:
                tmp = tempfile.mkdtemp(prefix="net_cut.")
                try:
                    run = trial(args, fault, cut, tmp)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                log("trial %d, %s cut %.1f s: %s" % (t + 1, fault, cut, "kept" if run["kept"] else
                                                     "node lost, rounds %s" % run["rounds"]))
                runs.append(run)
    record = results.stamp(BENCH)
    record.update({"options": runner.options_record(args), "runs": runs,
                   "machine": {"kernel": os.uname().release, "cpus": os.cpu_count()},
                   "elapsed_s": time.monotonic() - started})
    results.publish(args, record, net_cut_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
