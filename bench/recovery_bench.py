#!/usr/bin/python3
"""Recovery benchmark: what one `kill -9` of a worker costs a Python PyTorch DDP job."""
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench import recovery_report, results, runner
from bench.machine import machine_info
from tests.support import paths
from tests.support.paths import PYTHON, REPO, TORCHRUN_COMPAT
from tests.support.procs import clean_env, kill_and_reap

BENCH = "recovery_bench"
WORKER = os.path.join(REPO, "tests", "integration", "workers", "torch_ddp_resume.py")
STEPS, EVERY, PAUSE, KILL_AT = 60, 10, 0.02, 30
SMOKE = ["--runs", "1", "--big-runs", "0"]


def launchers(elrun):
    return {
        "elrun": [elrun, "--straggler-factor", "0"],
        "elrun --start-method forkserver": [elrun, "--straggler-factor", "0", "--start-method", "forkserver"],
        "torchrun --monitor_interval 0.1": [PYTHON, TORCHRUN_COMPAT, "--monitor_interval", "0.1"],
    }


def one_run(argv, nproc, timeout):
    """Runs the job once; returns {resume_s, recovery_s, step_before, wall_s} or raises."""
    work = tempfile.mkdtemp(prefix="recovery_bench.")
    fifo = os.path.join(work, "beats")
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # RDWR: no EOF between attempts.
    env = clean_env()
    env.update(PYTHON_EXEC=PYTHON, ELRUN_HEARTBEAT_FILE=fifo, OMP_NUM_THREADS="1")
    cmd = argv + ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1", WORKER,
                  os.path.join(work, "ckpt"), str(STEPS), str(EVERY), str(PAUSE)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    pending, high, killed, victim, first_pids = b"", -1, None, None, set()
    output, rank_pids, out = b"", {}, {}
    out_fd = proc.stdout.fileno()
    os.set_blocking(out_fd, False)
    try:
        while "recovery_s" not in out:
            if time.monotonic() - start > timeout:
                raise RuntimeError("no recovery within %d s" % timeout)
            ready, _, _ = select.select([reader, out_fd], [], [], 0.2)
            now = time.monotonic()
            if out_fd in ready:
                chunk = os.read(out_fd, 65536)
                output += chunk
                # "rank R starts at step S pid P": which pid is which rank (/proc/PID/environ is the
                # forkserver's for a forked worker).
                for rank, pid in re.findall(rb"rank (\d+) starts at step \d+ pid (\d+)", output):
                    rank_pids.setdefault(int(pid), int(rank))
                if not chunk and proc.poll() is not None:
                    with open(os.path.join(tempfile.gettempdir(), "recovery_bench_failed.log"), "wb") as f:
                        f.write(output)
                    raise RuntimeError("the job ended (rc %s) before it recovered: %s"
                                       % (proc.returncode, output.decode(errors="replace")[-1500:]))
            if reader not in ready:
                continue
            pending += os.read(reader, 65536)
            *lines, pending = pending.split(b"\n")
            for line in lines:
                fields = line.split()
                pid, step = int(fields[0]), int(fields[1])
                if killed is None:
                    first_pids.add(pid)
                    high = max(high, step)
                    victim = next((p for p, r in rank_pids.items() if r == 1 and p in first_pids), None)
                    if high >= KILL_AT and victim is not None:
                        os.kill(victim, signal.SIGKILL)
                        killed, out["step_before"] = now, high
                    continue
                if pid not in first_pids and "resume_s" not in out:
                    out["resume_s"] = now - killed
                if step > out["step_before"]:
                    out.setdefault("resume_s", now - killed)
                    out["recovery_s"] = now - killed
        os.set_blocking(out_fd, True)
        output += proc.stdout.read()
        rc = proc.wait(timeout=timeout)
        if rc != 0:
            raise RuntimeError("the job failed (rc %d): %s" % (rc, output.decode(errors="replace")[-1500:]))
        out["wall_s"] = time.monotonic() - start
        return out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kill_and_reap(proc)
        proc.stdout.close()
        os.close(reader)
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = runner.parser(BENCH, __doc__)
    ap.add_argument("--runs", type=int, default=5, help="runs per launcher with --nproc-per-node 2")
    ap.add_argument("--big-runs", type=int, default=3, help="runs per launcher with --big-nproc workers")
    ap.add_argument("--big-nproc", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds for one run")
    ap.add_argument("--elrun", default=paths.binary("elrun"))
    args = runner.parse(ap, SMOKE)
    started = time.monotonic()
    cases = []
    for nproc, runs in ((2, args.runs), (args.big_nproc, args.big_runs)):
        group = [{"launcher": name, "nproc": nproc, "argv": argv, "runs": [], "errors": []}
                 for name, argv in launchers(args.elrun).items()]
        runner.round_robin(group, runs, lambda case: one_run(case["argv"], nproc, args.timeout),
                           lambda case, i, sample: f"{case['launcher']} x{nproc} run {i}" + (
                               f": resume {sample['resume_s']:.3f} s, recovery {sample['recovery_s']:.3f} s"
                               if sample else ""), args.wait_idle)
        for case in group:
            del case["argv"]
        cases += group if runs > 0 else []
    record = results.stamp(BENCH)
    record.update(machine=dict(machine_info([("elrun", args.elrun)])), cases=cases,
                  options={"runs": args.runs, "big_runs": args.big_runs, "big_nproc": args.big_nproc,
                           "steps": STEPS, "every": EVERY, "pause": PAUSE, "kill_at": KILL_AT},
                  elapsed_s=time.monotonic() - started)
    results.publish(args, record, recovery_report)
    return 1 if any(c["errors"] and "torchrun" not in c["launcher"] for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
