"""The launcher benchmark's report, from its result (docs/results/launcher_bench.json): the
markdown table of medians against targets, the notes and commands, and the bar chart.
"""
import shlex
import statistics
from types import SimpleNamespace

from bench import render
from bench.render import (
    failed_runs,
    fmt,
    namespaces,
    pyplot,
    report_head,
    save_figure,
    stats,
    target_row,
)
from tests.support.paths import REPO

TITLE = "Launcher: elrun vs torchrun"
TARGET_LAUNCH_MS = 50.0
TARGET_RESTART_MS = 20.0
TARGET_RSS_MIB = 15.0


def cases_of(result):
    """The result's cases as objects with the fields the report reads."""
    return namespaces(result["cases"], missing=None, check_result=None, slow=False)


def markdown(result):
    """The report of one result, as launcher_bench.py prints it."""
    cases = cases_of(result)
    args = SimpleNamespace(**result["options"])
    return report(cases, summarize(cases), args, list(result["machine"].items()),
                  result["load"], result["elapsed_s"])


def plot_result(result, path):
    plot(summarize(cases_of(result)), path)


def find(cases, key, launcher):
    return next((c for c in cases if c.key == key and c.launcher == launcher), None)


LAUNCHERS = ["elrun", "torchrun (--monitor_interval 5, default)", "torchrun --monitor_interval 0.1"]


def summarize(cases):
    """{(metric, launcher): (median, min, max, runs, failed_runs) or a status string}"""
    out = {}

    def entry(c, xs):
        return c.status or (*stats(xs), len(xs), len(c.failures))

    for launcher in LAUNCHERS:
        c = find(cases, "launch", launcher)
        if c:
            out[("launch", launcher)] = entry(c, c.samples)
        f, ok = find(cases, "restart_fail", launcher), find(cases, "restart_ok", launcher)
        if f and ok:
            out[("restart_fail", launcher)] = entry(f, f.samples)
            out[("restart_ok", launcher)] = entry(ok, ok.samples)
            if f.status or ok.status:
                out[("restart", launcher)] = f.status or ok.status
            else:
                out[("restart", launcher)] = (statistics.median(f.samples)
                                              - statistics.median(ok.samples), None, None,
                                              min(len(f.samples), len(ok.samples)),
                                              len(f.failures) + len(ok.failures))
        r = find(cases, "rss", launcher)
        if r:
            if r.status:
                out[("vmhwm", launcher)] = out[("maxrss", launcher)] = r.status
            else:
                hwm = [a / 1024 for a, _ in r.samples if a is not None]
                out[("vmhwm", launcher)] = (entry(r, hwm) if hwm else
                                            "no sample: exited before the first /proc read")
                out[("maxrss", launcher)] = entry(r, [b / 1024 for _, b in r.samples])
    fl = find(cases, "floor", "harness floor: /bin/true directly")
    if fl:
        out[("floor", fl.launcher)] = entry(fl, fl.samples)
    return out


ROWS = [
    # metric, label, unit, target, digits
    ("launch", "1. launch 2 × /bin/true, wall", "ms", TARGET_LAUNCH_MS, 1),
    ("restart", "2. one failure + restart, ADDED wall (median fail-once − median ok)", "ms",
     TARGET_RESTART_MS, 1),
    ("restart_fail", "2a. wall, workers fail on attempt 0, succeed on attempt 1", "ms", None, 1),
    ("restart_ok", "2b. wall, workers succeed at once (same flags, `sh -c true`)", "ms", None, 1),
    ("vmhwm", "3. peak RSS of the launcher process (VmHWM) [a]", "MiB", TARGET_RSS_MIB, 2),
    ("maxrss", "3b. peak RSS, launcher + reaped descendants (wait4 ru_maxrss) [b]", "MiB",
     TARGET_RSS_MIB, 2),
]


def table(summary):
    lines = render.prose("launcher_bench", "table")
    for metric, label, unit, target, digits in ROWS:
        lines += [target_row(label, launcher, summary[(metric, launcher)], target, unit, digits)
                  for launcher in LAUNCHERS if (metric, launcher) in summary]
    fl = summary.get(("floor", "harness floor: /bin/true directly"))
    if fl is not None:
        cells = (f"{fl} | | | |" if isinstance(fl, str) else
                 f"{fmt(fl[0], 2)} ms | {fmt(fl[1], 2)} | {fmt(fl[2], 2)} | {fl[3]} |")
        lines.append(f"| 0. harness floor: spawn /bin/true directly, wall | — | {cells} | |")
    return lines


def report(cases, summary, args, info, load, elapsed):
    wait = render.prose("launcher_bench", "wait", vars(args))[0] if args.wait_idle > 0 else ""
    out = report_head("Launcher benchmark: elrun vs torchrun", info,
                      render.prose("launcher_bench", "how", vars(args), wait=wait, elapsed=elapsed)[0],
                      load)
    out += table(summary)
    attempts = "; ".join(f"{c.launcher}: {' '.join(c.check_result)}" for c in cases if c.check_result)
    out += render.prose("launcher_bench", "notes", attempts=attempts)
    out += failed_runs(cases, lambda c: f"{c.key} / {c.launcher}")
    out += render.prose("launcher_bench", "commands")
    seen = set()
    for c in cases:
        cmd = shlex.join(c.argv)
        if cmd in seen:
            continue
        seen.add(cmd)
        note = f"  # {c.key}: {c.launcher}"
        if c.missing:
            note += " (missing)"
        out.append(cmd.replace(REPO + "/", "") + note)
    out += ["```", ""]
    return "\n".join(out)


def plot(summary, path):
    plt = pyplot()

    short = {"elrun": "elrun", "torchrun (--monitor_interval 5, default)": "torchrun\n(interval 5)",
             "torchrun --monitor_interval 0.1": "torchrun\n(interval 0.1)"}
    colors = {"elrun": "#2a7ab0", "torchrun (--monitor_interval 5, default)": "#c0504d",
              "torchrun --monitor_interval 0.1": "#e8a33d"}
    panels = [("launch", "1. launch 2 workers: wall (ms)", TARGET_LAUNCH_MS, "ms"),
              ("restart", "2. one failure + restart: added wall (ms)", TARGET_RESTART_MS, "ms"),
              ("vmhwm", "3. launcher peak RSS, VmHWM (MiB)", TARGET_RSS_MIB, "MiB")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.8))
    for ax, (metric, title, target, unit) in zip(axes, panels):
        bars = []  # (name, color, value or None, lo, hi, note)
        for launcher in LAUNCHERS:
            v = summary.get((metric, launcher))
            if v is None:
                continue
            if isinstance(v, str):
                bars.append((short[launcher], colors[launcher], None, None, None,
                             "missing" if v.startswith("missing") else "failed"))
            else:
                bars.append((short[launcher], colors[launcher], *v[:3], None))
        # Log scale (torchrun is 10-1000x elrun); bars start at the bottom of the axis, and values
        # at or below it (e.g. an added wall <= 0) are labelled with their real value.
        positive = [b[2] for b in bars if b[2] is not None and b[2] > 0]
        bottom = min(positive + [target]) / 5
        top = max([b[4] if b[4] is not None else (b[2] or 0) for b in bars] + [target]) * 4
        for i, (name, color, val, lo, hi, note) in enumerate(bars):
            if val is None:
                ax.text(i, bottom * 1.5, note, ha="center", va="bottom", fontsize=9, color="gray")
                continue
            h = max(val, bottom * 1.01)
            err = None
            if lo is not None:
                err = [[max(h - max(lo, bottom), 0)], [max(hi - h, 0)]]
            ax.bar(i, h - bottom, bottom=bottom, color=color, yerr=err, capsize=4)
            label = f"{val:.0f}" if abs(val) >= 100 else f"{val:.1f}"
            ax.text(i, (hi if hi is not None else h) * 1.15, f"{label} {unit}", ha="center",
                    va="bottom", fontsize=9)
        ax.axhline(target, color="green", linestyle="--", linewidth=1,
                   label=f"elrun target ≤ {target:g} {unit}")
        ax.set_yscale("log")
        ax.set_ylim(bottom, top)
        ax.set_xlim(-0.6, len(bars) - 0.4)
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels([b[0] for b in bars], fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("elrun vs torchrun 2.11 (medians; whiskers min/max)", fontsize=11)
    save_figure(fig, path)
