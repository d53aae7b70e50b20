#!/usr/bin/python3
"""Regroup benchmark: what one fault costs elrun-train, group restart against --keep-survivors."""
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench import regroup_report, results, runner
from bench.machine import machine_info
from tests.support import paths
from tests.support.paths import PYTHON, TORCHRUN_COMPAT
from tests.support.procs import clean_env, kill_and_reap

BENCH = "regroup_bench"
MAX_STEPS, CHECKPOINT_EVERY, FAULT_AT = 250, 25, 110
STEP_LINE = re.compile(rb"^(?:\[default0\]:)?epoch \d+\s+step (\d+)\s", re.M)
ACCURACY = re.compile(rb"test accuracy (\d\.\d+)")
FAULTS = ("kill-1", "kill-0", "stop-1")
SMOKE = ["--runs", "1", "--faults", "kill-1"]


def launchers(elrun):
    restart = [elrun, "--straggler-factor", "0"]
    return {
        "elrun (group restart)": restart,
        "elrun --keep-survivors": restart + ["--keep-survivors"],
        "elrun --keep-survivors, no spare (--tee 3)": restart + ["--keep-survivors", "--tee", "3"],
        "torchrun --monitor_interval 0.1": [PYTHON, TORCHRUN_COMPAT, "--monitor_interval", "0.1"],
    }


def descendants(root):
    """The pids below `root` now."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack += children.get(pid, [])
    return found


def workers(root):
    """{rank: pid} of the elrun-train workers below `root` (standby spares left out)."""
    found = {}
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"elrun-train" not in f.read().split(b"\0")[0]:
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if b"RANK" in env and env.get(b"ELRUN_STANDBY") != b"1":
            found[int(env[b"RANK"])] = pid
    return found


def one_run(argv, nproc, fault, timeout, trainer_extra=(), fault_at=FAULT_AT):
    """Runs the job once; returns {resume_s, recovery_s, step_before, step_ms, wall_s, accuracy} or
    raises."""
    work = tempfile.mkdtemp(prefix="regroup_bench.")
    flag = "--no_python" if "torchrun" in " ".join(argv) else "--no-python"
    extra = ["--worker-timeout", "2"] if fault == "stop-1" else []
    cmd = argv + extra + ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1", flag,
                          paths.binary("elrun-train"), "--log-every", "1", "--checkpoint-every",
                          str(CHECKPOINT_EVERY), "--max-steps", str(MAX_STEPS), "--checkpoint-dir",
                          os.path.join(work, "ckpt")] + list(trainer_extra)
    env = clean_env()
    env.update(OMP_NUM_THREADS="1")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    output, high, faulted, out, stepped = b"", -1, None, {}, []
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    try:
        while True:
            if time.monotonic() - start > timeout:
                raise RuntimeError("no end within %d s" % timeout)
            ready, _, _ = select.select([fd], [], [], 0.2)
            if not ready:
                continue
            now = time.monotonic()
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            before = len(output)
            output += chunk
            start_of_line = output.rfind(b"\n", 0, before) + 1
            for match in STEP_LINE.finditer(output, start_of_line):
                if match.end() <= before:
                    continue
                step = int(match.group(1))
                if faulted is None:
                    stepped.append(now)
                    high = max(high, step)
                    if high >= fault_at:
                        target = workers(proc.pid).get(0 if fault == "kill-0" else 1)
                        if target is None:
                            raise RuntimeError("no worker of the rank to fault")
                        os.kill(target, signal.SIGSTOP if fault == "stop-1" else signal.SIGKILL)
                        faulted, out["step_before"] = now, high
                    continue
                out.setdefault("resume_s", now - faulted)
                if step > out["step_before"]:
                    out.setdefault("recovery_s", now - faulted)
        rc = proc.wait(timeout=timeout)
        if rc != 0 or "recovery_s" not in out:
            with open(os.path.join(tempfile.gettempdir(), "regroup_bench_failed.log"), "wb") as f:
                f.write(output)
            raise RuntimeError("the job %s: %s" % ("failed (rc %d)" % rc if rc else "never passed its step",
                                                  output.decode(errors="replace")[-1500:]))
        accuracy = ACCURACY.findall(output)
        out["accuracy"] = float(accuracy[-1]) if accuracy else None
        out["wall_s"] = time.monotonic() - start
        gaps = sorted(b - a for a, b in zip(stepped[10:], stepped[11:]))  # Past the first steps' warm-up.
        out["step_ms"] = gaps[len(gaps) // 2] * 1e3 if gaps else None
        return out
    finally:
        if proc.poll() is None:
            # torchrun's workers lead process groups of their own: a launcher that did not end
            # must not leave them running into the next run.
            for pid in descendants(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os.killpg(proc.pid, signal.SIGKILL)
        kill_and_reap(proc)
        proc.stdout.close()
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = runner.parser(BENCH, __doc__)
    ap.add_argument("--runs", type=int, default=5, help="runs per launcher and fault")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--faults", default=",".join(FAULTS), help="which faults, of " + ", ".join(FAULTS))
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds for one run")
    ap.add_argument("--elrun", default=paths.binary("elrun"))
    ap.add_argument("--fault-at", type=int, default=FAULT_AT,
                    help="fault once rank 0 reported this step (with copies every 10 steps, 115 lands between two)")
    ap.add_argument("--strategy", default="ddp", choices=("ddp", "no_shard", "zero1", "zero2", "fsdp"))
    ap.add_argument("--shard-copy-every", type=int, default=10,
                    help="elrun-train's --shard-copy-every for a sharded --strategy")
    args = runner.parse(ap, SMOKE)
    if args.strategy != "ddp" and args.json == results.default_path(BENCH):
        args.json = results.default_path(f"{BENCH}_{args.strategy}")
        args.png = os.path.join(paths.BENCH, f"{BENCH}_{args.strategy}.png")
    trainer_extra = [] if args.strategy == "ddp" else ["--strategy", args.strategy, "--shard-copy-every",
                                                        str(args.shard_copy_every)]
    started = time.monotonic()
    cases = []
    for fault in args.faults.split(","):
        group = [{"launcher": name, "fault": fault, "nproc": args.nproc, "argv": argv, "runs": [], "errors": []}
                 for name, argv in launchers(args.elrun).items()
                 if not (fault == "stop-1" and "torchrun" in name)]
        runner.round_robin(
            group, args.runs,
            lambda case: one_run(case["argv"], args.nproc, fault, args.timeout, trainer_extra, args.fault_at),
            lambda case, i, sample: f"{case['launcher']} {fault} run {i}" + (
                f": resume {sample['resume_s']:.3f} s, recovery {sample['recovery_s']:.3f} s, "
                f"accuracy {sample['accuracy']}" if sample else ""), args.wait_idle)
        for case in group:
            del case["argv"]
        cases += group
    record = results.stamp(BENCH)
    record.update(machine=dict(machine_info([("elrun", args.elrun), ("elrun-train", paths.binary("elrun-train"))])),
                  cases=cases,
                  options={"runs": args.runs, "nproc": args.nproc, "max_steps": MAX_STEPS,
                           "checkpoint_every": CHECKPOINT_EVERY, "fault_at": args.fault_at, "strategy": args.strategy,
                           "shard_copy_every": args.shard_copy_every if args.strategy != "ddp" else None},
                  elapsed_s=time.monotonic() - started)
    results.publish(args, record, regroup_report)
    return 1 if any(c["errors"] and "torchrun" not in c["launcher"] for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
