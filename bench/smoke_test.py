"""Runs the benchmarks' --smoke mode (each one's smoke-sized options, outputs in a temporary
directory, no figure asserted) one after the other, each under a timeout; exits 1 when one failed.
A benchmark this machine cannot run, or one too slow for CI's few minutes even when tiny, is
skipped with its reason printed; --all (or naming it) runs the slow ones too.

  /usr/bin/python3 -m bench.smoke_test [--all | NAME ...]     # from the repository root
  bazel test //bench:smoke_test
"""
import os
import signal
import subprocess
import sys
import time

from tests.support import netlab, paths
from tests.support.procs import kill_group, log

# In the order of docs/benchmarks.md: seconds each may take, and why CI skips it (None: it runs).
TORCH_JOBS = "about a minute even when tiny (%s); run it by name or with --all"
BENCHMARKS = {
    "launcher_bench": (90, None),
    "recovery_bench": (180, TORCH_JOBS % "three PyTorch DDP jobs, each killed and recovered"),
    "regroup_bench": (300, TORCH_JOBS % "four 250-step elrun-train jobs, the step of the fault fixed"),
    "rdzv_bench": (120, None),
    "rdzv_scale_bench": (60, None),
    "etcd_scale_bench": (60, None),
    "net_cut_bench": (120, None),
    "wheel_bench": (120, None),
    "train_bench": (300, TORCH_JOBS % "nine training jobs, PyTorch twins among them"),
    "scaling_bench": (180, None),
    "fsdp_bench": (180, None),
    "gpt_bench": (180, None),
}


def skip_reason(name, named):
    """Why `name` does not run here, or None."""
    if name == "net_cut_bench":
        reason = netlab.unavailable()
        if reason:
            return f"needs network namespaces (root): {reason}"
    return None if named else BENCHMARKS[name][1]


def smoke(name, timeout):
    """(passed, seconds) of one --smoke run in a session of its own; its output goes to ours. On
    timeout its whole process group gets SIGTERM (the benchmarks unwind and stop what they
    started), then SIGKILL after 15 s."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "bench." + name, "--smoke"], cwd=paths.REPO,
                            stdout=sys.stderr, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"{name}: --smoke still running after {timeout} s; stopping it")
        rc = None
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        kill_group(proc.pid)
        proc.wait()
    return rc == 0, time.monotonic() - t0


def main(argv):
    everything = "--all" in argv
    names = [a for a in argv if a != "--all"]
    unknown = set(names) - set(BENCHMARKS)
    if unknown:
        sys.exit(f"smoke_test: no benchmark {', '.join(sorted(unknown))}; expected --all or some of "
                 f"{', '.join(BENCHMARKS)}")
    failed, lines, t0 = [], [], time.monotonic()
    for name, (timeout, _) in BENCHMARKS.items():
        if names and name not in names:
            continue
        reason = skip_reason(name, everything or name in names)
        if reason:
            lines.append(f"{name}: skipped ({reason})")
            continue
        log(f"=== {name} --smoke")
        passed, seconds = smoke(name, timeout)
        lines.append(f"{name}: {'passed' if passed else 'FAILED'} in {seconds:.0f} s")
        if not passed:
            failed.append(name)
    print("\n".join(lines + [f"{len(failed)} failed; {time.monotonic() - t0:.0f} s in all"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
