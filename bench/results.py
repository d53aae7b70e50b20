"""Benchmark results as JSON: one file per benchmark, stamped with the commit, the date and the
machine, read back by the reports (bench/report.py).

A result is a dict: the benchmark's own fields (its samples, runs and summary) plus "bench",
"commit", "dirty", "date" (UTC, ISO 8601), "host" (machine, kernel, OS; the benchmark's full
machine description stays in its "machine" field) and "command" (the argv it ran with, relative to
the repository root). Paths into the checkout are written relative to the repository root, and a
benchmark's private temporary directory as $TMPDIR. Files under docs/results/ are committed; a new
run overwrites its file and the history stays in git.
"""
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time

from bench.machine import machine_line
from tests.support.paths import REPO, relative
from tests.support.procs import log

# The checkout whose commit a result names and where results go: under `bazel run` the workspace
# (REPO is then the runfiles tree), else REPO.
CHECKOUT = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or REPO
# Committed results, one JSON per benchmark (overwritten by each run), and their report.
RESULTS_DIR = os.path.join(CHECKOUT, "docs", "results")


def default_path(bench):
    """docs/results/<bench>.json."""
    return os.path.join(RESULTS_DIR, bench + ".json")


def git(*args):
    try:
        return subprocess.run(["git", "-C", CHECKOUT, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def uncommitted_changes():
    """Tracked files changed and not committed (staged or not), outside docs/ (where results and
    plots go); [] where git cannot tell (no checkout, as in Bazel's runfiles)."""
    return git("diff", "--name-only", "HEAD", "--", ".", ":!docs").splitlines()


def repo_relative(value):
    """value (a result or part of one) with every path into the checkout relative to its root and
    every benchmark's private temporary directory (tempfile.mkdtemp's /tmp/<name>.XXXXXXXX) as
    $TMPDIR, so that a result does not carry one machine's directory layout."""
    if isinstance(value, dict):
        return {k: repo_relative(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [repo_relative(v) for v in value]
    if isinstance(value, str):
        for root in (CHECKOUT, REPO):
            value = "." if value == root else value.replace(root + "/", "")
        return re.sub(r"/tmp/[\w-]+\.[\w]{8}/", "$TMPDIR/", value)
    return value


def module_name(script):
    """bench.launcher_bench for .../bench/launcher_bench.py: how the command is run again from the
    repository root (python3 -m puts it on the path for `from tests.support import ...`)."""
    return os.path.splitext(relative(os.path.abspath(script)))[0].replace("/", ".")


def stamp(bench, argv=None):
    """The fields every result carries: which benchmark, code, time, machine and command."""
    argv = sys.argv if argv is None else argv
    return {
        "bench": bench,
        "commit": git("rev-parse", "--short=12", "HEAD") or "unknown",
        # Uncommitted changes outside docs/ (where results and plots are written).
        "dirty": bool(uncommitted_changes()),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"machine": machine_line(), "kernel": f"{platform.system()} {platform.release()}",
                 "node": platform.node()},
        "command": ["/usr/bin/python3", "-m", module_name(argv[0])] + list(argv[1:]),
    }


def write(path, record):
    """Writes record (stamp() fields first) to path as indented JSON, paths made relative
    (repo_relative); logs where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(repo_relative(record), f, indent=1)
        f.write("\n")
    log(f"wrote {path}")


def read(path):
    with open(path) as f:
        return json.load(f)


def header_lines(result):
    """Markdown bullets naming a result's commit, date, machine and command."""
    dirty = " (with uncommitted changes)" if result.get("dirty") else ""
    return [f"- **commit**: {result.get('commit', '?')}{dirty}",
            f"- **date**: {result.get('date', '?')}",
            f"- **machine**: {result.get('host', {}).get('machine', '?')}",
            "- **command**: `" + shlex.join(result.get("command", [])) + "`"]


def publish(args, record, report):
    """The end of every benchmark: the result written to args.json (when set), its markdown
    (report.markdown of the result as written) on stdout, its plot (report.plot_result) drawn to
    args.png where this Python has matplotlib (Debian's /usr/bin/python3 has; `bazel run` takes
    the python3 on PATH)."""
    if args.json:
        write(args.json, record)
    print(report.markdown(repo_relative(record)), flush=True)
    if args.png:
        try:
            report.plot_result(record, args.png)
            log(f"wrote {args.png}")
        except ImportError as ex:
            log(f"no plot: {ex}")
