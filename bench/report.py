#!/usr/bin/python3
"""Renders docs/benchmarks.md from the latest result of each benchmark (docs/results/<bench>.json),
with each result's commit, date, machine and command, and its plot (docs/benchmarks/<bench>.png).

  /usr/bin/python3 -m bench.report [--results DIR] [--out FILE] [--plots DIR] [--note TEXT]

A benchmark with no result is listed as not run. Debian's python3 (matplotlib) draws the plots.
"""
import argparse
import os
import re
import shlex
import sys

from bench import (
    etcd_scale_report,
    fsdp_report,
    gpt_report,
    launcher_report,
    net_cut_report,
    rdzv_report,
    rdzv_scale_report,
    recovery_report,
    regroup_report,
    results,
    scaling_report,
    train_report,
    wheel_report,
)
from bench.render import prose
from tests.support.procs import log

# The last commit that had the one-off measurement scripts (scripts/bench/setup_packages_bench.sh,
# scripts/bench/rdzv_cpu.sh), named in the preamble.
ONE_OFF_COMMIT = "ef7baf9"

# (benchmark, its report module[, its heading]), in the order of docs/benchmarks.md; what each
# measures is in bench/reports/benchmarks.md.
BENCHMARKS = [
    ("launcher_bench", launcher_report),
    ("recovery_bench", recovery_report),
    ("regroup_bench", regroup_report),
    ("regroup_bench_fsdp", regroup_report, regroup_report.TITLE + ", fsdp"),
    ("rdzv_bench", rdzv_report),
    ("rdzv_scale_bench", rdzv_scale_report),
    ("etcd_scale_bench", etcd_scale_report),
    ("net_cut_bench", net_cut_report),
    ("wheel_bench", wheel_report),
    ("train_bench", train_report),
    ("scaling_bench", scaling_report),
    ("fsdp_bench", fsdp_report),
    ("gpt_bench", gpt_report),
    ("gpt_bench_mlp", gpt_report, gpt_report.MLP_TITLE),
]


def measures():
    """{benchmark: what it measures}, from the "measures" section of bench/reports/benchmarks.md."""
    return dict(line.split(": ", 1) for line in prose("benchmarks", "measures"))


def title(module, *override):
    """A benchmark's heading: its report's TITLE, or the entry's own (one report, two results)."""
    return override[0] if override else module.TITLE


def checkout_relative(text):
    """Paths into the measuring checkout (its bazel-bin, its .venv) written from its root, so that
    the document does not carry one machine's directory layout (results.write stores them so)."""
    return re.sub(r"/[^\s`'\"()]*?/(bazel-bin|\.venv)/", r"\1/", text)


def demote(text):
    """The report's markdown headings one level down (they sit under a benchmark's heading)."""
    return "\n".join("#" + line if line.startswith("#") else line for line in text.split("\n"))


def render(results_dir, plots_dir, out_path, note):
    out_dir = os.path.dirname(os.path.abspath(out_path))
    found = {}
    for bench, *_ in BENCHMARKS:
        path = os.path.join(results_dir, bench + ".json")
        if os.path.exists(path):
            found[bench] = results.repo_relative(results.read(path))
    lines = prose("benchmarks", "preamble", one_off=ONE_OFF_COMMIT)
    if note:
        lines += [f"> {note}", ""]
    lines += prose("benchmarks", "table")
    what = measures()
    for bench, module, *override in BENCHMARKS:
        r = found.get(bench)
        if r is None:
            lines.append(f"| {title(module, *override)} | {what[bench]} | — | not run | | |")
            continue
        dirty = " (+ changes)" if r.get("dirty") else ""
        lines.append(f"| [{title(module, *override)}](#{bench.replace('_', '-')}) | {what[bench]} | "
                     f"{r.get('commit', '?')}{dirty} | {r.get('date', '?')} | "
                     f"{r.get('host', {}).get('machine', '?')} | "
                     f"`{shlex.join(r.get('command', []))}` |")
    lines.append("")
    for bench, module, *override in BENCHMARKS:
        r = found.get(bench)
        if r is None:
            continue
        lines += [f'<a id="{bench.replace("_", "-")}"></a>', "", f"## {title(module, *override)}", ""]
        lines += results.header_lines(r) + [""]
        png = os.path.join(plots_dir, bench + ".png")
        try:
            os.makedirs(plots_dir, exist_ok=True)
            module.plot_result(r, png)
            if os.path.exists(png):
                lines += [f"![{bench}]({os.path.relpath(png, out_dir)})", ""]
        except ImportError as ex:  # No matplotlib: the tables still render.
            log(f"{bench}: no plot ({ex})")
        lines += [checkout_relative(demote(module.markdown(r))), ""]
    with open(out_path, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    log(f"wrote {out_path} ({len(found)} of {len(BENCHMARKS)} benchmarks have results)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=results.RESULTS_DIR,
                    help="directory of <bench>.json results (default: %(default)s)")
    ap.add_argument("--out", default=os.path.join(results.CHECKOUT, "docs", "benchmarks.md"),
                    help="markdown to write (default: %(default)s)")
    ap.add_argument("--plots", default=os.path.join(results.CHECKOUT, "docs", "benchmarks"),
                    help="where the plots go (default: %(default)s)")
    ap.add_argument("--note", help="a line quoted under the preamble (e.g. that these are smoke runs)")
    args = ap.parse_args()
    render(args.results, args.plots, args.out, args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
