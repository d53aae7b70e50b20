"""What every benchmark report is made of: the head of a report, its fixed prose and table headers
from bench/reports/<bench>.md, numbers and medians against targets, and matplotlib on Agg.

Standard library only; matplotlib is imported when a plot is drawn.
"""
import functools
import os
import re
import statistics
from types import SimpleNamespace

# --- markdown ---------------------------------------------------------------------------------

REPORTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reports")


@functools.cache
def sections(bench):
    """bench/reports/<bench>.md as {name: text}: each section starts at a `<!-- name -->` line."""
    with open(os.path.join(REPORTS, bench + ".md")) as f:
        parts = re.split(r"^<!-- (\w+) -->\n", f.read(), flags=re.M)
    return {name: text.removesuffix("\n") for name, text in zip(parts[1::2], parts[2::2])}


def prose(bench, section, /, *maps, **values):
    """A report's fixed prose: section `section` of bench/reports/<bench>.md with its
    {placeholders} (str.format) filled from the maps (e.g. a result's options) and values, the
    later ones winning, as lines."""
    return sections(bench)[section].format_map({k: v for m in maps + (values,) for k, v in m.items()}).split("\n")


def report_head(title, info, how, load):
    """The head every benchmark report opens with: its title, the machine facts in `info` (pairs),
    `how` (one bullet: what ran and how, the benchmark's own words) and the other processes' load."""
    return [f"## {title}", ""] + [f"- **{k}**: {v}" for k, v in info] + [how, f"- **load**: {load}", ""]


def target_row(label, who, v, target, unit, digits):
    """A row of the launcher and rendezvous tables (| Benchmark | Launcher | Median | Min | Max |
    Runs | Target | Meets |): v is (median, min, max, runs, failed runs), min and max None for a
    difference of medians, or the text that stands instead (a failure, a missing binary)."""
    tgt = f"≤ {target:g} {unit}" if target is not None else ""
    if isinstance(v, str):
        return f"| {label} | {who} | {v.replace('|', '/')} | | | | {tgt} | |"
    med, lo, hi, n, nfail = v
    meets = verdict(med, target) if target is not None else ""
    n = f"{n} (+{nfail} failed)" if nfail else n
    lo, hi = ("—" if x is None else fmt(x, digits) for x in (lo, hi))
    return f"| {label} | {who} | {fmt(med, digits)} {unit} | {lo} | {hi} | {n} | {tgt} | {meets} |"


def failed_runs(cases, name):
    """The list of runs that failed and were retried (c.failures), each named by name(c)."""
    failed = [c for c in cases if c.failures]
    if not failed:
        return []
    return (["Failed runs (retried, not counted in the statistics):", ""]
            + [f"- {name(c)}: {m}" for c in failed for m in c.failures] + [""])


def namespaces(records, **defaults):
    """Result records (dicts) as objects, with defaults for fields older results lack."""
    return [SimpleNamespace(**dict(defaults, **r)) for r in records]


def fmt(x, digits=1):
    return f"{x:.{digits}f}"


def stats(xs):
    return statistics.median(xs), min(xs), max(xs)


def verdict(value, target):
    return "yes" if value <= target else "NO"


def median_range(case, key):
    """(median, min, max) of case["runs"][*][key] where present, or None."""
    xs = [run[key] for run in case["runs"] if run.get(key) is not None]
    return stats(xs) if xs else None


def median_cell(s, digits=2):
    """A median_range as "median (min-max)", or "failed"."""
    return "failed" if s is None else f"{fmt(s[0], digits)} ({fmt(s[1], digits)}-{fmt(s[2], digits)})"


# --- plots ------------------------------------------------------------------------------------

def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path, dpi=110):
    """The plot epilogue: lay out, write `path`, free the figure."""
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def bar_labels(ax, bars, texts, fontsize=8):
    """Each bar's text just above (vertical bars) its top."""
    for bar, text in zip(bars, texts):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center", va="bottom",
                fontsize=fontsize)
