"""Benchmark results as JSON: one file per benchmark, stamped with the commit, the date and the
machine, read back by the reports (scripts/bench/report.py).

A result is a dict: the benchmark's own fields (its samples, runs and summary) plus "bench",
"commit", "dirty", "date" (UTC, ISO 8601), "host" (machine, kernel, OS; the benchmark's full
machine description stays in its "machine" field) and "command" (the argv it ran with, relative to
the repository root). Files under docs/results/ are committed; a new run overwrites its file and
the history stays in git.
"""
import json
import os
import platform
import shlex
import subprocess
import sys
import time

from tests.support.machine import machine_line
from tests.support.paths import REPO, RESULTS_DIR, relative
from tests.support.procs import log


def default_path(bench):
    """docs/results/<bench>.json."""
    return os.path.join(RESULTS_DIR, bench + ".json")


def git(*args):
    try:
        return subprocess.run(["git", "-C", REPO, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def stamp(bench, argv=None):
    """The fields every result carries: which benchmark, code, time, machine and command."""
    argv = sys.argv if argv is None else argv
    return {
        "bench": bench,
        "commit": git("rev-parse", "--short=12", "HEAD") or "unknown",
        # Uncommitted changes outside docs/ (where results and plots are written).
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs")),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"machine": machine_line(), "kernel": f"{platform.system()} {platform.release()}",
                 "node": platform.node()},
        "command": ["/usr/bin/python3", relative(os.path.abspath(argv[0]))] + list(argv[1:]),
    }


def write(path, record):
    """Writes record (stamp() fields first) to path as indented JSON; logs where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
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
    (report.markdown(record)) on stdout, its plot (report.plot_result) drawn to args.png."""
    if args.json:
        write(args.json, record)
    print(report.markdown(record), flush=True)
    if args.png:
        report.plot_result(record, args.png)
        log(f"wrote {args.png}")
