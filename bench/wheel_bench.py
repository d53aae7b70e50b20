#!/usr/bin/python3
"""Wheel benchmark: elrun as pip installs it, against the build tree's elrun and torchrun."""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench import results, runner, wheel_report
from bench.machine import loadavg, machine_info, wait_idle
from tests.support import paths
from tests.support.procs import clean_env, log

BENCH = "wheel_bench"
SMOKE = ["--runs", "3", "--installs", "1"]
# auditwheel's environment (scripts/setup.sh; Bazel tests get it as ELRUN_WHEEL_TOOLS).
TOOLS = os.environ.get("ELRUN_WHEEL_TOOLS") or os.path.join(
    os.environ.get("ELRUN_CACHE") or os.path.expanduser("~/.cache/elrun"), "wheel-tools")


def build_wheel(out_dir):
    made = subprocess.run(
        ["/usr/bin/python3", os.path.join(paths.REPO, "release", "wheel.py"),
         "--elrun", paths.binary("elrun"), "--elrun-rdzv", paths.binary("elrun-rdzv"),
         "--dist", out_dir, "--auditwheel", os.path.join(TOOLS, "bin", "auditwheel")],
        capture_output=True, text=True, check=True)
    return json.loads(made.stdout.strip().splitlines()[-1])


def tree_bytes(root):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files
               if not os.path.islink(os.path.join(d, f)))


def install(wheel, venv):
    """A fresh environment with the wheel; returns (pip's wall seconds, bytes the wheel added)."""
    subprocess.run(["/usr/bin/python3", "-m", "venv", venv], check=True)
    before = tree_bytes(venv)
    start = time.monotonic()
    subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", "--no-index",
                    "--disable-pip-version-check", wheel], check=True)
    return time.monotonic() - start, tree_bytes(venv) - before


def timed(argv, env):
    start = time.monotonic()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=120)
    elapsed = (time.monotonic() - start) * 1000.0
    if done.returncode != 0:
        raise RuntimeError("%s exited %d: %s" % (argv, done.returncode, done.stderr[-400:]))
    return elapsed


def main():
    ap = runner.parser(BENCH, __doc__)
    ap.add_argument("--runs", type=int, default=20, help="runs of each start-up case")
    ap.add_argument("--installs", type=int, default=3, help="fresh environments to time pip install in")
    ap.add_argument("--wheel", help="a built wheel (default: build one from bazel-bin)")
    args = runner.parse(ap, SMOKE)

    work = tempfile.mkdtemp(prefix="wheel_bench.")
    try:
        built = {"wheel": args.wheel} if args.wheel else build_wheel(os.path.join(work, "dist"))
        wheel = built["wheel"]
        installs = []
        for i in range(args.installs):
            seconds, added = install(wheel, os.path.join(work, "venv%d" % i))
            installs.append({"seconds": seconds, "added_bytes": added})
            log("pip install %d: %.2f s" % (i, seconds))
        venv = os.path.join(work, "venv0")
        env = clean_env()
        env["PATH"] = os.path.join(venv, "bin") + ":/usr/bin:/bin"
        true_job = ["--standalone", "--nproc-per-node", "2", "--no-python", "true"]
        cases = {
            "installed elrun --version": [os.path.join(venv, "bin", "elrun"), "--version"],
            "python3 -m elrun --version": [os.path.join(venv, "bin", "python3"), "-m", "elrun", "--version"],
            "installed elrun, 2 workers": [os.path.join(venv, "bin", "elrun")] + true_job,
            "build tree's elrun, 2 workers": [paths.binary("elrun")] + true_job,
            "torchrun 2.11, 2 workers": [paths.PYTHON, paths.TORCHRUN_COMPAT] + true_job,
        }
        samples = {name: [] for name in cases}
        for run in range(args.runs):  # Round robin: drift in the machine's load hits every case alike.
            wait_idle(args.wait_idle)
            for name, argv in cases.items():
                samples[name].append(timed(argv, env))
        summary = {name: {"median_ms": statistics.median(xs), "min_ms": min(xs), "max_ms": max(xs)}
                   for name, xs in samples.items()}
        record = results.stamp(BENCH)
        record.update({
            "machine": machine_info([("elrun", paths.binary("elrun"))]),
            "load": loadavg(),
            "options": {"runs": args.runs, "installs": args.installs},
            "wheel": {"name": os.path.basename(wheel), "bytes": os.path.getsize(wheel),
                      "tag": built.get("tag"), "glibc_floor": built.get("glibc_floor"),
                      "auditwheel_show": built.get("auditwheel_show")},
            "installs": installs,
            "commands": {name: argv for name, argv in cases.items()},
            "samples_ms": samples,
            "summary": summary,
        })
        results.publish(args, record, wheel_report)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
