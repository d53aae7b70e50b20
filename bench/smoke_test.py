"""Runs every benchmark's --smoke mode (its README's smoke-sized options, outputs in a temporary
directory, no figure asserted) one after the other, each under a timeout; exits 1 when one failed.
A benchmark this machine cannot run is skipped with its reason printed.

  /usr/bin/python3 -m bench.smoke_test [NAME ...]     # from the repository root; default: all
  bazel test //bench:smoke_test
"""
import os
import subprocess
import sys
import time

from tests.support import netlab, paths
from tests.support.procs import log

# In the order of docs/benchmarks.md; seconds each may take before it counts as failed.
BENCHMARKS = {
    "launcher_bench": 60, "recovery_bench": 120, "regroup_bench": 120, "rdzv_bench": 120,
    "rdzv_scale_bench": 60, "etcd_scale_bench": 60, "net_cut_bench": 120, "wheel_bench": 120,
    "train_bench": 120, "scaling_bench": 120, "fsdp_bench": 120, "gpt_bench": 120,
}


def skip_reason(name):
    """Why `name` cannot run here, or None."""
    if name == "net_cut_bench":
        reason = netlab.unavailable()
        return f"needs network namespaces (root): {reason}" if reason else None
    return None


def smoke(name, timeout):
    """(passed, seconds) of one --smoke run; its output goes to ours."""
    t0 = time.monotonic()
    try:
        rc = subprocess.run([sys.executable, "-m", "bench." + name, "--smoke"], cwd=paths.REPO,
                            stdout=sys.stderr, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        log(f"{name}: --smoke still running after {timeout} s")
        rc = None
    return rc == 0, time.monotonic() - t0


def main(names):
    unknown = set(names) - set(BENCHMARKS)
    if unknown:
        sys.exit(f"smoke_test: no benchmark {', '.join(sorted(unknown))}; expected some of {', '.join(BENCHMARKS)}")
    failed, lines = [], []
    for name, timeout in BENCHMARKS.items():
        if names and name not in names:
            continue
        reason = skip_reason(name)
        if reason:
            lines.append(f"{name}: skipped ({reason})")
            continue
        log(f"=== {name} --smoke")
        passed, seconds = smoke(name, timeout)
        lines.append(f"{name}: {'passed' if passed else 'FAILED'} in {seconds:.0f} s")
        if not passed:
            failed.append(name)
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
