#!/usr/bin/env python3
"""Chaos soak: an elastic elrun job training FashionNet while faults rain on it.

An elastic elrun-train job (--nnodes MIN:MAX on loopback, elrun-rdzv or a 3-member etcd cluster,
shared checkpoints, a length in samples) takes a seeded fault every --interval MIN:MAX seconds
for --duration seconds: kill9_worker, sigstop_worker, kill9_agent, add_node, kill9_etcd_leader
(etcd-v3), and with --network (every node in a test host of its own; root) cut_node, lossy_node,
drop_one_way. Then the same job runs uninterrupted for the reference accuracy. The checks (resumes
from committed steps, the final checkpoint loads, no process left, nothing new in /dev/shm, agents
exit 0, the nodes' histories agree, accuracy within --accuracy-points) fail the run with exit 1.
What it runs, checks and reports, and the measured soaks: docs/chaos_soak.md.

  /usr/bin/python3 -m bench.chaos_soak --seed 1 [--duration 600 --epochs 20]   # the soak
  /usr/bin/python3 -m bench.chaos_soak --seed 1 --duration 100 --interval 6:12 --epochs 5   # CI
(Debian's Python for matplotlib; --python, default .venv/bin/python3, loads the checkpoint.)
"""
import argparse
import glob
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench import render, runner
from tests.support import paths, procs

TAG_VAR = "ELRUN_SOAK_TAG"
LOG_EVERY = 10  # elrun-train's --log-every in the soak.
KINDS = ("kill9_worker", "sigstop_worker", "kill9_agent", "add_node")
ETCD_KINDS = KINDS + ("kill9_etcd_leader",)
NETWORK_KINDS = ("cut_node", "lossy_node", "drop_one_way")
HEARTBEAT_TIMEOUT_S = 3.0
# --network: host 1 holds elrun-rdzv (hosts 1-3 the etcd members); node N runs in host NODE_HOST0 + N.
NODE_HOST0 = 3
PROGRESS = re.compile(r"epoch \d+\s+step (\d+)\s+loss .* ETA (\d+) s")
RESUMED = re.compile(r"resumed from \S+: epoch \d+, step (\d+)")
# --keep-survivors: the job regrouped around workers that kept their processes (no checkpoint).
REGROUPED = re.compile(r"regrouped in place \(generation \d+\): \d+ ranks, \d+ restarted; the live state of rank "
                       r"\d+ at step (\d+)")
DONE = re.compile(r"done: (\d+) steps, .* test accuracy ([0-9.]+)")
ROUND = re.compile(r"round (\d+): group rank \d+ of \d+, world size \d+, restart count (\d+)")


class Agent:
    """One elrun agent (a node), its output read by threads that timestamp each line."""

    def __init__(self, soak, node):
        self.node = node
        self.lines = []  # (monotonic time, stream, text)
        self.report_file = os.path.join(soak.workdir, "goodput_node%d.json" % node)  # elrun's own measure.
        args = soak.args
        lab = soak.lab
        conf = "join_timeout=60,last_call_timeout=2,heartbeat_timeout=%g" % HEARTBEAT_TIMEOUT_S
        self.history_file = os.path.join(soak.workdir, "history_node%d.jsonl" % node)
        if lab is not None:  # A node cut off for longer than heartbeat_timeout comes back.
            conf += ",rejoin_timeout=60"
        argv = [soak.elrun, "--nnodes", "%d:%d" % (args.min_nodes, args.max_nodes), "--nproc-per-node", "1",
                "--rdzv-backend", args.rdzv_backend, "--rdzv-endpoint", soak.endpoint, "--rdzv-id", soak.run_id,
                "--local-addr", lab.addr(NODE_HOST0 + node) if lab else "127.0.0.%d" % node] + (
                ["--keep-survivors"] if args.keep_survivors else []) + [
                "--max-restarts", "1000", "--worker-timeout",
                str(args.worker_timeout), "--shutdown-timeout", "5", "--history-file", self.history_file,
                "--rdzv-conf", conf,
                "--report-file", self.report_file, "--no-python", soak.train,
                "--epochs", str(args.epochs), "--batch-size", "64", "--threads", "1",
                "--lr-schedule", "cosine", "--seed", "0", "--log-every", str(LOG_EVERY), "--collective-timeout", "20",
                "--checkpoint-dir", soak.checkpoints, "--checkpoint-every", str(args.checkpoint_every)]
        env = dict(soak.env, LOGLEVEL="info", GLOO_SOCKET_IFNAME="eth0" if lab else "lo")
        if lab is not None:
            argv = lab.command(NODE_HOST0 + node, argv)
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.started = time.monotonic()
        self.readers = [threading.Thread(target=self._read, args=(stream, name), daemon=True)
                        for stream, name in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for reader in self.readers:
            reader.start()

    def _read(self, stream, name):
        for raw in iter(stream.readline, b""):
            self.lines.append((time.monotonic(), name, raw.decode(errors="replace").rstrip("\n")))

    def alive(self):
        return self.proc.poll() is None

    def text(self):
        return "\n".join("%s %s" % (name, line) for _, name, line in self.lines)


class Soak:
    def __init__(self, args, workdir, label):
        self.args = args
        self.label = label
        self.elrun, self.rdzv, self.train = args.elrun, args.elrun_rdzv, args.elrun_train
        self.tag = "%s-%d-%s" % (label, os.getpid(), int(time.time()))
        self.env = dict(procs.clean_env(), **{TAG_VAR: self.tag})
        self.env["TMPDIR"] = workdir
        self.workdir = workdir
        self.checkpoints = os.path.join(workdir, "checkpoints")
        self.run_id = "soak-%s" % label
        self.agents = []
        self.faults = []  # {t, kind, target, step}
        self.daemon = None
        self.etcd = None
        self.etcd_down = None  # The member kill9_etcd_leader killed last, until restarted.
        self.endpoint = None
        self.kinds = (ETCD_KINDS if args.rdzv_backend == "etcd-v3" else KINDS) + (NETWORK_KINDS if args.network else ())
        self.lab = None
        if args.network:
            from tests.support import netlab
            self.lab = netlab.NetLab(NODE_HOST0 + args.max_nodes)
        self.t0 = time.monotonic()

    def start(self):
        if self.args.rdzv_backend == "etcd-v3":
            self.etcd = etcd_cluster().EtcdCluster(self.env["TMPDIR"], members=3, lab=self.lab,
                                                   lab_hosts=(1, 2, 3) if self.lab else None)
            self.endpoint = self.etcd.endpoints
            self.t0 = time.monotonic()
            for _ in range(self.args.start_nodes):
                self.add_agent()
            return
        port_file = os.path.join(self.env["TMPDIR"], "rdzv.port")
        host = self.lab.addr(1) if self.lab else "127.0.0.1"
        argv = [self.rdzv, "--listen", "%s:0" % host, "--port-file", port_file]
        self.daemon = subprocess.Popen(self.lab.command(1, argv) if self.lab else argv,
                                       env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (os.path.exists(port_file) and open(port_file).read().strip()):
            if self.daemon.poll() is not None:
                raise runner.RunError("elrun-rdzv exited with %s" % self.daemon.returncode)
            time.sleep(0.05)
        self.endpoint = "%s:%d" % (host, int(open(port_file).read()))
        self.t0 = time.monotonic()
        for _ in range(self.args.start_nodes):
            self.add_agent()

    def add_agent(self):
        node = len(self.agents) + 1
        self.agents.append(Agent(self, node))
        return node

    def live_agents(self):
        return [a for a in self.agents if a.alive()]

    def progress(self):
        """(time since start, step) of every progress line so far, in time order."""
        points = []
        for agent in self.agents:
            for t, _, line in list(agent.lines):
                m = PROGRESS.search(line)
                if m:
                    points.append((t - self.t0, int(m.group(1))))
        return sorted(points)

    def step_now(self):
        points = self.progress()
        return max((s for _, s in points), default=0)

    def eta(self):
        """Rank 0's last estimate of the seconds left, or None before its first progress line."""
        latest = None
        for agent in self.agents:
            for t, _, line in list(agent.lines):
                m = PROGRESS.search(line)
                if m and (latest is None or t > latest[0]):
                    latest = (t, int(m.group(2)))
        return None if latest is None else latest[1]

    def workers(self):
        """The soak's elrun-train workers; not a standby spare of --keep-survivors (ELRUN_STANDBY=1,
        kept in its environment after it took a worker's place: such a worker is left out too)."""
        pids = []
        for pid in procs.tagged_pids(TAG_VAR, self.tag):
            try:
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    argv0 = f.read().split(b"\0")[0]
                with open("/proc/%d/environ" % pid, "rb") as f:
                    spare = b"ELRUN_STANDBY=1" in f.read().split(b"\0")
            except OSError:
                continue
            if argv0.endswith(b"elrun-train") and not spare:
                pids.append(pid)
        return pids

    def inject(self, kind, rng):
        """One fault of `kind`; returns what it hit, or None when the kind cannot apply now."""
        live = self.live_agents()
        if kind in ("kill9_worker", "sigstop_worker"):
            pids = self.workers()
            if not pids:
                return None
            pid = rng.choice(pids)
            os.kill(pid, signal.SIGKILL if kind == "kill9_worker" else signal.SIGSTOP)
            return "pid %d" % pid
        if kind == "kill9_etcd_leader":
            if self.etcd_down is not None:
                self.etcd.restart(self.etcd_down)
            self.etcd_down = self.etcd.leader()
            self.etcd.kill(self.etcd_down)
            return "etcd member %d" % self.etcd_down
        if kind in ("cut_node", "lossy_node"):
            if len(live) <= self.args.min_nodes:  # A node cut off for long is lost for a while.
                return None
            agent = rng.choice(live)
            host = NODE_HOST0 + agent.node
            if kind == "cut_node":
                seconds = rng.uniform(0.5, 2 * HEARTBEAT_TIMEOUT_S)
                self.lab.cut(host)
            else:
                seconds = 5.0
                self.lab.lose(host, 20)
            time.sleep(seconds)  # The fault's length; the driver holds it, then heals.
            self.lab.heal(host)
            return "node %d for %.1f s" % (agent.node, seconds)
        if kind == "drop_one_way":
            if len(live) < 2:
                return None
            src, dst = rng.sample(live, 2)
            self.lab.drop(NODE_HOST0 + src.node, NODE_HOST0 + dst.node)
            time.sleep(3.0)
            self.lab.heal(NODE_HOST0 + dst.node)
            return "node %d to node %d" % (src.node, dst.node)
        if kind == "kill9_agent":
            if len(live) <= self.args.min_nodes:
                return None
            agent = rng.choice(live)
            os.kill(agent.proc.pid, signal.SIGKILL)
            return "node %d" % agent.node
        if len(live) >= self.args.max_nodes:
            return None
        return "node %d" % self.add_agent()

    def wait_done(self, timeout):
        """Until every agent exited; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.live_agents():
                return True
            time.sleep(0.2)
        return False

    def stop(self):
        for agent in self.agents:
            if agent.alive():
                procs.kill_group(agent.proc.pid)
            agent.proc.wait()
            for reader in agent.readers:
                reader.join(timeout=5)
        if self.etcd is not None:
            self.etcd.close()
        if self.daemon and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                procs.kill_group(self.daemon.pid)
                self.daemon.wait()
        # Workers that elrun's guardians SIGKILLed may take a moment to die: poll, bounded.
        deadline = time.monotonic() + 5.0
        left = procs.tagged_pids(TAG_VAR, self.tag)
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = procs.tagged_pids(TAG_VAR, self.tag)
        procs.kill_tagged(TAG_VAR, self.tag)
        if self.lab is not None:
            self.lab.close()
        return left

    def history_problems(self):
        """What the history checker finds in every agent's --history-file."""
        from tests.support import history_check
        return history_check.check({a.node: history_check.read_jsonl(a.history_file) for a in self.agents})

    def final(self):
        """(steps, accuracy) from the rank-0 'done:' line, or (None, None)."""
        for agent in self.agents:
            for _, _, line in agent.lines:
                m = DONE.search(line)
                if m:
                    return int(m.group(1)), float(m.group(2))
        return None, None

    def resumes(self):
        """(t, step, from a checkpoint) of every resume: from a checkpoint, or a regroup in place."""
        out = []
        for agent in self.agents:
            for t, _, line in agent.lines:
                for pattern, from_checkpoint in ((RESUMED, True), (REGROUPED, False)):
                    m = pattern.search(line)
                    if m:
                        out.append((t - self.t0, int(m.group(1)), from_checkpoint))
        return sorted(out)

    def rounds(self):
        """(rounds started, restarts spent) from the agents' round lines."""
        seen = [(int(m.group(1)), int(m.group(2))) for a in self.agents for _, _, line in a.lines
                for m in [ROUND.search(line)] if m]
        return max((r for r, _ in seen), default=0), max((c for _, c in seen), default=0)


def etcd_cluster():
    """tests/support/etcd_cluster.py (a real etcd cluster on loopback), imported only when needed."""
    from tests.support import etcd_cluster as module
    return module


def chaos(soak, args, rng):
    kinds = list(soak.kinds)
    rng.shuffle(kinds)
    end = time.monotonic() + args.duration
    lo, hi = args.interval
    while time.monotonic() < end and soak.live_agents():
        time.sleep(rng.uniform(lo, hi))
        if not soak.live_agents() or time.monotonic() >= end:
            break
        if soak.eta() is not None and soak.eta() < hi:
            break  # The job is about to finish: a fault now would only test its end.
        # The kinds not yet injected first; otherwise any kind that applies now (no node to add
        # at MAX nodes, no agent to kill at MIN, no worker between rounds).
        pending = kinds + rng.sample([k for k in soak.kinds if k not in kinds], len(soak.kinds) - len(kinds))
        for kind in pending:
            # When it began: a link fault lasts seconds (the driver holds it, then heals).
            began, step = time.monotonic() - soak.t0, soak.step_now()
            target = soak.inject(kind, rng)
            if target is not None:
                soak.faults.append({"t": began, "kind": kind, "target": target, "step": step})
                procs.log("  %6.1f s  %-14s %s (step %d)" % (soak.faults[-1]["t"], kind, target,
                                                                   soak.faults[-1]["step"]))
                if kind in kinds:
                    kinds.remove(kind)
                break


def analyse(soak, args):
    points = soak.progress()
    resumes = soak.resumes()
    per_fault = []
    checks = []
    for i, fault in enumerate(soak.faults):
        after = [r for r in resumes if r[0] > fault["t"]]
        next_fault = soak.faults[i + 1]["t"] if i + 1 < len(soak.faults) else float("inf")
        recovered = next((t for t, s in points if t > fault["t"] and s > fault["step"]), None)
        entry = dict(fault, lost_s=None if recovered is None else recovered - fault["t"], redone=None)
        if after and after[0][0] < next_fault:
            resumed = after[0][1]
            entry["redone"] = max(0, fault["step"] - resumed)
            # Committed: rank 0 checkpoints every K steps (atomically), and on SIGTERM. A clean
            # stop (a node added: the round ends up to last_call_timeout later) checkpoints the
            # step it stopped at, so the ceiling is what rank 0 had reached before the resume
            # (it logs every 10 steps), not the step at the fault.
            floor = max(0, (fault["step"] // args.checkpoint_every - 1) * args.checkpoint_every)
            reached = max([s for t, s in points if t < after[0][0]] + [fault["step"]])
            ok = floor <= resumed <= max(fault["step"] + args.checkpoint_every, reached + LOG_EVERY)
            entry["resumed"] = resumed
            if not ok:
                checks.append("fault %d (%s at step %d) resumed at step %d, not in [%d, %d]"
                              % (i + 1, fault["kind"], fault["step"], resumed, floor,
                                 max(fault["step"] + args.checkpoint_every, reached + LOG_EVERY)))
        per_fault.append(entry)
    steps = [s for _, s, from_checkpoint in resumes if from_checkpoint]  # A regroup's live state is ahead.
    if steps != sorted(steps):
        checks.append("resumes went backwards: %s" % steps)
    return per_fault, checks


def run(args, label, with_chaos):
    workdir = tempfile.mkdtemp(prefix="elrun-soak-%s." % label)
    shm_before = set(glob.glob("/dev/shm/*"))
    soak = Soak(args, workdir, label)
    rng = random.Random(args.seed)
    result = {"label": label, "backend": args.rdzv_backend}
    try:
        soak.start()
        if with_chaos:
            chaos(soak, args, rng)
        finished = soak.wait_done(args.timeout)
        result["finished"] = finished
    finally:
        left = soak.stop()
    result["orphans"] = left
    result["shm_left"] = sorted(set(glob.glob("/dev/shm/*")) - shm_before)
    result["exit_codes"] = {a.node: a.proc.returncode for a in soak.agents}
    result["steps"], result["accuracy"] = soak.final()
    result["rounds"], result["restarts"] = soak.rounds()
    result["faults"] = soak.faults
    result["progress"] = soak.progress()
    per_fault, checks = analyse(soak, args)
    result["per_fault"] = per_fault
    checks += ["history: %s" % problem for problem in soak.history_problems()]
    # elrun's own goodput report (--report-file) of every node that exited 0: what elrun measured
    # from its workers' heartbeats, beside the soak's measure from rank 0's log above.
    result["goodput"] = {}
    for agent in soak.agents:
        if agent.proc.returncode != 0:
            continue
        try:
            with open(agent.report_file) as f:
                result["goodput"][agent.node] = json.load(f)
        except (OSError, ValueError) as error:
            checks.append("node %d exited 0 without its --report-file: %s" % (agent.node, error))
    killed = {int(f["target"].split()[1]) for f in soak.faults if f["kind"] == "kill9_agent"}
    bad_exits = {n: rc for n, rc in result["exit_codes"].items() if n not in killed and rc != 0}
    if not result["finished"]:
        checks.append("the job did not finish within %s s" % args.timeout)
    if bad_exits:
        checks.append("agents exited non-zero: %s" % bad_exits)
    if result["orphans"]:
        checks.append("processes of the soak left: %s" % result["orphans"])
    if result["shm_left"]:
        checks.append("files left in /dev/shm: %s" % result["shm_left"])
    if result["steps"] is None:
        checks.append("rank 0 never reported the end of its %d epochs" % args.epochs)
    checkpoint = os.path.join(soak.checkpoints, "checkpoint.pt")
    loaded = subprocess.run([args.python, "-c", "import sys, torch; torch.load(sys.argv[1]); print('ok')", checkpoint],
                            capture_output=True, text=True, timeout=120)
    if loaded.stdout.strip() != "ok":
        checks.append("the final checkpoint does not load: %s" % loaded.stderr.strip()[-300:])
    result["checks"] = checks
    if checks or args.keep:
        log_path = os.path.join(workdir, "agents.log")
        with open(log_path, "w") as f:
            for agent in soak.agents:
                f.write("=== node %d (exit %s)\n%s\n" % (agent.node, agent.proc.returncode, agent.text()))
        result["logs"] = log_path
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def plot(result, path):
    plt = render.pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    if result["progress"]:
        ts, ss = zip(*result["progress"])
        ax.plot(ts, ss, ".", markersize=3, color="#1f78b4", label="rank 0's step")
    colours = {"kill9_worker": "#e31a1c", "sigstop_worker": "#ff7f00", "kill9_agent": "#6a3d9a",
               "add_node": "#33a02c", "kill9_etcd_leader": "#000000", "cut_node": "#1b9e77",
               "lossy_node": "#a6761d", "drop_one_way": "#e7298a"}
    seen = set()
    for fault in result["faults"]:
        ax.axvline(fault["t"], color=colours[fault["kind"]], linewidth=1,
                   label=None if fault["kind"] in seen else fault["kind"])
        seen.add(fault["kind"])
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("training step")
    ax.set_title("elrun chaos soak (%s): progress and faults" % result.get("backend", "grpc"))
    ax.legend(fontsize=8, loc="upper left")
    render.save_figure(fig, path)


def report(args, chaos_result, reference):
    out = ["## elrun chaos soak", "",
           "- seed %d, %s rendezvous, nodes %d:%d (started with %d), %d epochs (cosine schedule), "
           "checkpoint every %d steps, --worker-timeout %g, faults every %g-%g s for %g s%s"
           % (args.seed, args.rdzv_backend, args.min_nodes, args.max_nodes, args.start_nodes, args.epochs,
              args.checkpoint_every, args.worker_timeout, args.interval[0], args.interval[1], args.duration,
              "; every node in a test host of its own (--network)" if args.network else ""), ""]
    kinds = (ETCD_KINDS if args.rdzv_backend == "etcd-v3" else KINDS) + (NETWORK_KINDS if args.network else ())
    counts = {k: sum(1 for f in chaos_result["faults"] if f["kind"] == k) for k in kinds}
    out.append("- faults: " + ", ".join("%s %d" % kv for kv in counts.items()) +
               "; rounds: %d; restarts spent (worker failures; membership changes spend none): %d"
               % (chaos_result["rounds"], chaos_result["restarts"]))
    acc, ref = chaos_result["accuracy"], reference["accuracy"] if reference else None
    if acc is not None and ref is not None:
        delta = 100 * (acc - ref)
        verdict = "within" if abs(delta) <= args.accuracy_points else "OUTSIDE"
        out.append("- test accuracy %.4f against %.4f uninterrupted (%+.2f points, %s %.1f)"
                   % (acc, ref, delta, verdict, args.accuracy_points))
        if verdict != "within":
            chaos_result["checks"].append("accuracy %+.2f points from the uninterrupted run" % delta)
    for node, g in sorted(chaos_result.get("goodput", {}).items()):
        lost = [f["recovery_s"] for f in g["faults"] if f["recovery_s"] is not None]
        goodput = "-" if g["goodput"] is None else "%.1f%%" % (100 * g["goodput"])
        out.append("- elrun's goodput report, node %s: goodput %s of %.1f s, %d faults seen, %.1f s lost (median "
                   "%s s per recovered fault)" % (node, goodput, g["wall_s"], len(g["faults"]), g["lost_s"],
                                                  "-" if not lost else "%.2f" % statistics.median(lost)))
    out += ["", "| # | t (s) | fault | target | step | resumed at | steps redone | time lost (s) |",
            "|---:|---:|---|---|---:|---:|---:|---:|"]
    for i, f in enumerate(chaos_result["per_fault"]):
        out.append("| %d | %.1f | %s | %s | %d | %s | %s | %s |" % (
            i + 1, f["t"], f["kind"], f["target"], f["step"], f.get("resumed", "-"),
            "-" if f["redone"] is None else f["redone"], "-" if f["lost_s"] is None else "%.1f" % f["lost_s"]))
    out.append("")
    checks = chaos_result["checks"] + (reference["checks"] if reference else [])
    out.append("- checks: " + ("all passed (resumes from committed steps, final checkpoint loads, no "
                                "process left, nothing new in /dev/shm, agents exited 0, the nodes' histories "
                                "agree)" if not checks
                                else "**FAILED**: " + "; ".join(checks)))
    if chaos_result.get("logs"):
        out.append("- agents' output: %s" % chaos_result["logs"])
    return "\n".join(out), not checks


def parse_interval(text):
    lo, hi = (float(v) for v in text.split(":"))
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError("expected MIN:MAX seconds, 0 < MIN <= MAX")
    return lo, hi


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--duration", type=float, default=600, help="seconds of fault injection")
    ap.add_argument("--interval", type=parse_interval, default=(10.0, 30.0), help="MIN:MAX seconds between faults")
    ap.add_argument("--epochs", type=int, default=20, help="epochs of Fashion-MNIST (the job's length)")
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--min-nodes", type=int, default=2)
    ap.add_argument("--max-nodes", type=int, default=4)
    ap.add_argument("--start-nodes", type=int, default=3)
    ap.add_argument("--worker-timeout", type=float, default=5)
    ap.add_argument("--rdzv-backend", choices=("grpc", "etcd-v3"), default="grpc",
                    help="grpc: elrun-rdzv; etcd-v3: a 3-member etcd cluster, and etcd leader kills")
    ap.add_argument("--accuracy-points", type=float, default=0.5)
    ap.add_argument("--timeout", type=float, default=900, help="seconds for the job to finish after the faults")
    ap.add_argument("--no-reference", action="store_true", help="skip the uninterrupted run")
    ap.add_argument("--keep-survivors", action="store_true",
                    help="run the agents with --keep-survivors (workers regroup in place after a fault)")
    ap.add_argument("--keep", action="store_true", help="keep the work directories and agents' output")
    ap.add_argument("--network", action="store_true",
                    help="every node in a test host of its own (network namespaces; root), and link faults too")
    ap.add_argument("--elrun", default=paths.binary("elrun"))
    ap.add_argument("--elrun-rdzv", default=paths.binary("elrun-rdzv"))
    ap.add_argument("--elrun-train", default=paths.binary("elrun-train"))
    ap.add_argument("--python", default=paths.PYTHON,
                    help="a Python with torch, to load the checkpoint (default: %(default)s)")
    ap.add_argument("--png", default=os.path.join(paths.BENCH, "chaos_soak.png"),
                    help="plot to write (default: %(default)s)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if not 1 <= args.min_nodes <= args.start_nodes <= args.max_nodes <= 200:
        ap.error("expected 1 <= --min-nodes <= --start-nodes <= --max-nodes <= 200")
    for path in (args.elrun, args.elrun_rdzv, args.elrun_train):
        if not os.access(path, os.X_OK):
            ap.error("%s is not an executable (build with bazel first)" % path)
    if args.network:
        from tests.support import netlab
        reason = netlab.unavailable()
        if reason:
            ap.error("--network: " + reason)
    procs.log("chaos run (seed %d):" % args.seed)
    chaos_result = run(args, "chaos", with_chaos=True)
    reference = None
    if not args.no_reference:
        procs.log("uninterrupted run:")
        reference = run(args, "reference", with_chaos=False)
    text, ok = report(args, chaos_result, reference)
    print(text)
    if args.png:
        plot(chaos_result, args.png)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"chaos": chaos_result, "reference": reference, "passed": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
