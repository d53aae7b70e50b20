#!/usr/bin/python3
"""Rendezvous benchmark: elrun's gRPC rendezvous against torchrun's c10d rendezvous (torch 2.11, the .venv's)."""
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid

from bench import rdzv_report, results, runner
from bench.machine import (
    ForeignCpu,
    binary_id,
    load_text,
    loadavg,
    machine_info,
    mem_available_mib,
    wait_idle,
)
from bench.rdzv_report import (
    ELRUN_DAEMON,
    ELRUN_EMBEDDED,
    FLOOR,
    TORCHRUN,
    TORCHRUN_AGENT_MIB,
    TORCHRUN_BUDGET_MIB,
)
from bench.rdzv_runs import (
    FIFO_VAR,
    TAG_VAR,
    WORKER,
    Daemon,
    formation_run,
    free_port,
    recovery_run,
)
from bench.runner import RunError, with_retries
from tests.support import paths
from tests.support.paths import PYTHON, REPO, TORCHRUN_COMPAT
from tests.support.procs import clean_env, kill_tagged, log

BENCH = "rdzv_bench"
SMOKE = ["--sizes", "4", "--runs", "1", "--warmup", "0", "--torchrun-runs", "1", "--torchrun-recovery-runs", "1",
         "--torchrun-max-n", "4", "--recovery-cap", "5"]


# --- the benchmark ---------------------------------------------------------------------------

class Case(runner.CaseState):
    """samples: formation: seconds; recovery: result dicts."""

    def __init__(self, key, launcher, n, runs, timeout, run, cmd, missing=None, warm=False):
        super().__init__(missing)
        self.key, self.launcher, self.n, self.runs, self.timeout = key, launcher, n, runs, timeout
        self.run, self.cmd, self.warm = run, cmd, warm


class Bench:
    def __init__(self, args, tmp):
        self.args, self.tmp = args, tmp
        self.tag = uuid.uuid4().hex[:12]
        self.count = 0
        self.env = clean_env(("LAUNCHER_BENCH_LOG", "ELRUN_RDZV_TOKEN", TAG_VAR, FIFO_VAR,
                              "LOGLEVEL"))
        self.daemon = Daemon(args.rdzv, self.env, f"{self.tag}:daemon", tmp)

    def run_tag(self):
        self.count += 1
        return f"{self.tag}:{self.count}"

    def run_id(self, slug):
        return f"rdzvbench-{self.tag}-{slug}-{self.count}"

    # argv builders; port and run id are per run.
    def elrun_argv(self, nnodes, port, run_id, worker):
        return [self.args.elrun, "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--no-python", *worker]

    def torchrun_argv(self, nnodes, port, run_id, worker):
        return [PYTHON, TORCHRUN_COMPAT, "--nnodes", nnodes, "--nproc_per_node", "1",
                "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id",
                run_id, "--monitor_interval", "0.1", "--no_python", *worker]

    def formation(self, launcher, n, timeout):
        tag = self.run_tag()
        if launcher == FLOOR:
            return formation_run([["/bin/true"]] * n, timeout, self.env, tag)
        if launcher == ELRUN_DAEMON:
            port, build, slug = self.daemon.ensure(), self.elrun_argv, "daemon"
        elif launcher == ELRUN_EMBEDDED:
            port, build, slug = free_port(), self.elrun_argv, "embedded"
        else:
            port, build, slug = free_port(), self.torchrun_argv, "torchrun"
        argv = build(str(n), port, self.run_id(f"{slug}{n}"), ["/bin/true"])
        return formation_run([argv] * n, timeout, self.env, tag)

    def recovery(self, launcher, timeout):
        tag = self.run_tag()
        worker = ["sh", "-c", WORKER]
        if launcher == ELRUN_DAEMON:
            port, build, slug, host_port = self.daemon.ensure(), self.elrun_argv, "rdaemon", None
        elif launcher == ELRUN_EMBEDDED:
            port, build, slug = free_port(), self.elrun_argv, "rembedded"
            host_port = port
        else:
            port, build, slug = free_port(), self.torchrun_argv, "rtorchrun"
            host_port = port
        argv = build("3:4", port, self.run_id(slug), worker)
        return recovery_run(lambda i: argv, host_port, timeout, self.args.recovery_cap,
                            self.args.settle, self.env, tag, self.tmp)

    def build_cases(self):
        a = self.args
        missing_e = None if os.access(a.elrun, os.X_OK) else f"missing ({a.elrun} not found)"
        missing_d = missing_e or (None if os.access(a.rdzv, os.X_OK)
                                  else f"missing ({a.rdzv} not found)")
        avail = mem_available_mib()
        rel = lambda p: p.replace(REPO + "/", "")  # noqa: E731
        e_cmd = lambda nn, ep, w: shlex.join(  # noqa: E731
            [rel(a.elrun), "--nnodes", nn, "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", ep,
             "--rdzv-id", "JOB_i", "--no-python", *w])
        t_cmd = lambda nn, w: shlex.join(  # noqa: E731
            [PYTHON, rel(TORCHRUN_COMPAT), "--nnodes", nn, "--nproc_per_node", "1",
             "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:PORT", "--rdzv_id", "JOB_i",
             "--monitor_interval", "0.1", "--no_python", *w])
        cases = []
        for n in a.sizes:
            cases.append(Case("formation", FLOOR, n, a.runs, a.timeout,
                              lambda c: self.formation(FLOOR, c.n, c.timeout),
                              f"/bin/true  # x {n}", warm=True))
            cases.append(Case("formation", ELRUN_DAEMON, n, a.runs, a.timeout,
                              lambda c: self.formation(ELRUN_DAEMON, c.n, c.timeout),
                              e_cmd(str(n), "127.0.0.1:DAEMON_PORT", ["/bin/true"]) + f"  # x {n}",
                              missing=missing_d, warm=True))
            if not a.no_embedded:
                cases.append(Case("formation", ELRUN_EMBEDDED, n, a.runs, a.timeout,
                                  lambda c: self.formation(ELRUN_EMBEDDED, c.n, c.timeout),
                                  e_cmd(str(n), "127.0.0.1:PORT", ["/bin/true"]) + f"  # x {n}",
                                  missing=missing_e, warm=True))
            need = n * TORCHRUN_BUDGET_MIB
            skip = None
            if n > a.torchrun_max_n or avail is None or need > avail / 2:
                why = [f"N > --torchrun-max-n {a.torchrun_max_n}"] if n > a.torchrun_max_n else []
                if avail is None:
                    why.append("MemAvailable unknown")
                elif need > avail / 2:
                    why.append(f"more than half of the {avail / 1024:.1f} GiB available")
                skip = (f"not run (memory: {n} x {TORCHRUN_AGENT_MIB} MiB = "
                        f"{n * TORCHRUN_AGENT_MIB / 1024:.1f} GiB; {', '.join(why)})")
            cases.append(Case("formation", TORCHRUN, n, a.torchrun_runs, a.torchrun_timeout,
                              lambda c: self.formation(TORCHRUN, c.n, c.timeout),
                              t_cmd(str(n), ["/bin/true"]) + f"  # x {n}", missing=skip,
                              warm=(n == min(a.sizes))))
        if not a.no_recovery:
            worker = ["sh", "-c", WORKER]
            cases.append(Case("recovery", ELRUN_DAEMON, 4, a.runs, a.timeout,
                              lambda c: self.recovery(ELRUN_DAEMON, c.timeout),
                              e_cmd("3:4", "127.0.0.1:DAEMON_PORT", worker) + "  # x 4",
                              missing=missing_d))
            if not a.no_embedded:
                cases.append(Case("recovery", ELRUN_EMBEDDED, 4, a.runs, a.timeout,
                                  lambda c: self.recovery(ELRUN_EMBEDDED, c.timeout),
                                  e_cmd("3:4", "127.0.0.1:PORT", worker) + "  # x 4",
                                  missing=missing_e))
            cases.append(Case("recovery", TORCHRUN, 4, a.torchrun_recovery_runs,
                              a.torchrun_timeout, lambda c: self.recovery(TORCHRUN, c.timeout),
                              t_cmd("3:4", worker) + "  # x 4"))
        return cases

    def attempt(self, c):
        return with_retries(c, self.args.retries, lambda: c.run(c))

    def run_cases(self, cases):
        active = [c for c in cases if not c.missing]
        foreign = ForeignCpu(own_pids=self.daemon.pids)
        wait_idle(self.args.wait_idle)
        if any(c.launcher == ELRUN_DAEMON for c in active):
            try:
                self.daemon.ensure()
            except RunError as ex:
                for c in active:
                    if c.launcher == ELRUN_DAEMON:
                        c.error = str(ex)

        def warm():
            for c in active:
                if c.warm and not c.error:
                    log(f"warm-up: {c.key} / {c.launcher} / N={c.n}")
                    for _ in range(self.args.warmup):
                        try:
                            self.attempt(c)
                        except (RunError, subprocess.TimeoutExpired) as ex:
                            c.error = str(ex)
                            break

        foreign.phase(warm)

        def one(c):
            r = c.run(c)
            if c.key == "formation":
                log(f"  {c.key} / {c.launcher} / N={c.n}: {r:.3f} s")
            else:
                log(f"  {c.key} / {c.launcher}: " + (
                    f"new round in {r['recovered_s']:.3f} s" if r["recovered_s"] is not None
                    else f"no new round within {self.args.recovery_cap:g} s"))
            return r

        runner.case_rounds(active, self.args.retries, one, self.args.wait_idle, foreign)
        return foreign.share


def main():
    ap = runner.parser(BENCH, __doc__)
    ap.add_argument("--elrun", default=paths.binary("elrun"), help="elrun binary (default: %(default)s)")
    ap.add_argument("--rdzv", default=paths.binary("elrun-rdzv"),
                    help="elrun-rdzv binary (default: %(default)s)")
    ap.add_argument("--sizes", default="4,8,32,128",
                    help="agent counts N for formation, comma-separated (default %(default)s)")
    ap.add_argument("--runs", type=int, default=5, help="measured runs per elrun case (default 5)")
    ap.add_argument("--torchrun-runs", type=int, default=3,
                    help="measured runs per torchrun formation case (~5-10 s each; default 3)")
    ap.add_argument("--torchrun-recovery-runs", type=int, default=2,
                    help="measured runs of torchrun recovery (up to ~5 s + --recovery-cap each; "
                         "default 2)")
    ap.add_argument("--torchrun-max-n", type=int, default=16,
                    help="largest N to run torchrun for (each agent ~235 MiB; default 16); N is "
                         "also skipped when N x 250 MiB exceeds half of MemAvailable")
    ap.add_argument("--warmup", type=int, default=1,
                    help="unmeasured runs per elrun/floor case and for the smallest torchrun "
                         "case (default 1)")
    ap.add_argument("--recovery-cap", type=float, default=30,
                    help="seconds to wait for the survivors' new round after the kill (default 30)")
    ap.add_argument("--settle", type=float, default=0.5,
                    help="seconds between all workers running and the kill (default 0.5)")
    ap.add_argument("--no-embedded", action="store_true",
                    help="skip the elrun cases with the coordinator embedded in an agent")
    ap.add_argument("--no-recovery", action="store_true", help="skip the recovery cases")
    runner.add_run_options(ap, timeout=30, torchrun_timeout=120, retries=2)
    args = runner.parse(ap, SMOKE)
    runner.require_in_smoke(ap, args, args.elrun, args.rdzv)
    try:
        args.sizes = sorted({int(x) for x in args.sizes.split(",") if x.strip()})
    except ValueError:
        ap.error("--sizes takes comma-separated integers")
    if not args.sizes or min(args.sizes) < 1:
        ap.error("--sizes must be >= 1")
    if min(args.runs, args.torchrun_runs, args.torchrun_recovery_runs) < 1 or args.warmup < 0 \
            or args.retries < 0 or args.recovery_cap <= 0:
        ap.error("run counts must be >= 1, --warmup and --retries >= 0, --recovery-cap > 0")

    # SIGTERM unwinds like Ctrl-C, so that the finally clauses kill what was started.
    signal.signal(signal.SIGTERM, lambda signo, frame: sys.exit(128 + signo))
    with runner.private_copies(args, BENCH, {}) as tmp:
        bench = Bench(args, tmp)
        try:
            return run(bench)
        finally:
            bench.daemon.stop()
            kill_tagged(TAG_VAR, bench.tag + ":")


def run(bench):
    args = bench.args
    t0 = time.monotonic()
    load_start = loadavg()
    ids_before = (binary_id(args.elrun), binary_id(args.rdzv))
    cases = bench.build_cases()
    for c in cases:
        if c.missing:
            log(f"{c.key} / {c.launcher} / N={c.n}: {c.missing}")
    info = machine_info([("elrun", args.elrun), ("elrun-rdzv", args.rdzv)])
    mem = mem_available_mib()
    info.insert(1, ("memory", f"{mem / 1024:.1f} GiB available at start" if mem else "?"))
    share = bench.run_cases(cases)
    load = load_text(share, load_start, own="this benchmark's, its children's and the daemon's")
    if (binary_id(args.elrun), binary_id(args.rdzv)) != ids_before:
        load += " — **an elrun binary changed during the run (rebuilt?); the elrun rows mix builds**"
        log("warning: an elrun binary changed during the run; the elrun rows mix builds")
    record = dict(results.stamp(BENCH), machine=dict(info), options=runner.options_record(args),
                  load=load, elapsed_s=time.monotonic() - t0,
                  cases=[{"key": c.key, "launcher": c.launcher, "n": c.n, "cmd": c.cmd,
                          "samples": c.samples, "failures": c.failures, "status": c.status,
                          "missing": c.missing} for c in cases])
    results.publish(args, record, rdzv_report)
    return 1 if any(c.error for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
