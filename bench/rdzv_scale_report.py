"""The report of rdzv_scale_bench.py, from its result (docs/results/rdzv_scale_bench.json): the
table of medians (min-max) per N against the targets at 10,000 nodes, and the plot.
"""
import shlex
import statistics

from bench import render
from bench.render import pyplot, save_figure

TITLE = "Rendezvous at scale: one elrun-rdzv, N simulated nodes"
TARGETS = {"formation_s": 2.0, "rss_mib": 256.0, "heartbeat_cores": 0.2, "reform_s": 1.0}


def markdown(result):
    sizes, runs = result["sizes"], {int(n): rs for n, rs in result["results"].items()}
    out = render.prose("rdzv_scale_bench", "head") + ["- **%s**: %s" % kv for kv in result["machine"].items()]
    out += render.prose("rdzv_scale_bench", "tail", load=result["load"], command=shlex.join(result["command"]),
                        runs=result["options"]["runs"])

    def cell(n, key, unit, digits, target=None):
        xs = [r[key] for r in runs[n]]
        med = statistics.median(xs)
        text = "%.*f %s (%.*f-%.*f)" % (digits, med, unit, digits, min(xs), digits, max(xs))
        if target is not None:
            text += " %s" % ("✓" if med <= target else "✗ target %.*f" % (digits, target))
        return text

    for n in sizes:
        tgt = n >= 10000
        out.append("| %d | %s | %s | %s | %s | %s |" % (
            n, cell(n, "formation_s", "s", 3, TARGETS["formation_s"] if tgt else None),
            cell(n, "formation_cpu_s", "s", 2),
            cell(n, "heartbeat_cores", "", 3, TARGETS["heartbeat_cores"] if tgt else None),
            cell(n, "reform_s", "s", 3, TARGETS["reform_s"] if tgt else None),
            cell(n, "rss_mib", "MiB", 1, TARGETS["rss_mib"] if tgt else None)))
    out += render.prose("rdzv_scale_bench", "targets")
    return "\n".join(out)


def plot_result(result, path):
    sizes, runs = result["sizes"], {int(n): rs for n, rs in result["results"].items()}
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, title in zip(axes, ["formation_s", "reform_s", "heartbeat_cores"],
                              ["formation (s)", "re-formation after 1% lost (s)", "heartbeat cost (cores)"]):
        ax.plot(sizes, [statistics.median(r[key] for r in runs[n]) for n in sizes], "o-")
        ax.set_xscale("log")
        ax.set_xlabel("simulated nodes")
        ax.set_title(title)
    save_figure(fig, path, dpi=100)
