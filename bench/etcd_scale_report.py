"""The report of etcd_scale_bench.py, from its result (docs/results/etcd_scale_bench.json): the
table of medians per N against the gRPC backend's targets, how far failed runs got, and the plot.
"""
import shlex
import statistics
from types import SimpleNamespace

from bench import render
from bench.render import pyplot, save_figure

TITLE = "Rendezvous at scale, etcd-v3 backend"
# The gRPC backend's targets (issue 15), which the etcd backend is held to at 1,000 nodes.
TARGETS = {"formation_s": 2.0, "etcd_rss_mib": 256.0, "steady_etcd_cores": 0.2, "reform_s": 1.0}
TARGET_N = 1000


def _unpack(result):
    args = SimpleNamespace(**result["options"])
    sizes = result["sizes"]
    return args, sizes, {n: result[str(n)] for n in sizes}


def prose(section, /, *maps, **values):
    return render.prose("etcd_scale_bench", section, *maps, **values)


def markdown(result):
    args, sizes, results = _unpack(result)
    out = prose("head", members=args.members)
    out += ["- **%s**: %s" % (key, text) for key, text in result["machine"].items()
            if key not in ("python", "torch")]
    opening = ("%d threads taking the nodes in turn" % args.open_threads if args.open_threads > 0
               else "all at once, a thread each")
    out += prose("tail", etcd=result["etcd"], load=result["load"], command=shlex.join(result["command"]),
                 opening=opening, runs=args.runs, lease_ms=args.lease_ms, connections=args.connections)

    def cell(n, key, unit, digits, target=None):
        xs = [r[key] for r in results[n] if r["ok"]]
        if not xs:
            # No run got through: what the runs had reached when they were stopped, if measured.
            got = [r[key] for r in results[n] if r.get(key) is not None]
            if key == "formation_s":
                return "✗ missed: none within %.0f s" % args.timeout
            if not got:
                return "not reached"
            med = statistics.median(got)
            text = ("%.*f %s" % (digits, med, unit)).rstrip() + " at the stop"
            if target is not None:
                text += " (%s so far)" % ("within target" if med <= target else "✗ over target")
            return text
        med = statistics.median(xs)
        text = ("%.*f %s" % (digits, med, unit)).rstrip()
        if len(xs) > 1:
            text += " (%.*f-%.*f)" % (digits, min(xs), digits, max(xs))
        if target is not None:
            text += " %s" % ("✓ met" if med <= target else "✗ missed (target %.*f %s)" % (digits, target, unit))
        return text

    for n in sizes:
        tgt = lambda k: TARGETS[k] if n == TARGET_N else None  # noqa: E731
        ok = [r for r in results[n] if r["ok"]]
        leave = [r.get("quit_s") for r in ok]
        leave_text = ("—" if not leave else "> %.0f s (killed)" % args.quit_timeout if None in leave
                      else "%.2f s" % statistics.median(leave))
        out.append("| %d | %d/%d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            n, len(ok), len(results[n]), cell(n, "open_s", "s", 2),
            cell(n, "formation_s", "s", 2, tgt("formation_s")), cell(n, "etcd_cpu_s", "s", 2),
            cell(n, "load_cpu_s", "s", 1), cell(n, "steady_etcd_cores", "", 3, tgt("steady_etcd_cores")),
            cell(n, "steady_load_cores", "", 3), cell(n, "reform_s", "s", 3, tgt("reform_s")),
            cell(n, "etcd_rss_mib", "MiB", 1, tgt("etcd_rss_mib")), cell(n, "load_rss_mib", "MiB", 1),
            leave_text))
    out += prose("notes", quit_timeout=args.quit_timeout, target_n=TARGET_N)
    failures = [r for n in sizes for r in results[n] if not r["ok"]]
    if failures:
        out.append("\nRuns that did not complete (how far they got):\n")
        for r in failures:
            out.append("- N=%d: %s. Last progress: `%s`. Sessions ended on their own: %d (%s). etcd CPU "
                       "%.1f s, agents CPU %.1f s, etcd RSS %.1f MiB, etcd_load RSS %.1f MiB, %d threads." % (
                           r["n"], r["error"], r["progress"], r["ended"],
                           "; ".join("%d × `%s`" % (c, why) for why, c in sorted(
                               r["end_reasons"].items(), key=lambda x: -x[1])) or "none",
                           r["etcd_cpu_s"], r["load_cpu_s"], r["etcd_rss_mib"], r["load_rss_mib"],
                           r["load_threads"]))
    notes = [r for n in sizes for r in results[n] if r["ok"] and (r["ended"] or r["round"] != 1)]
    for r in notes:
        out.append("\nN=%d formed in round %d with %d nodes; %d sessions ended on their own%s" % (
            r["n"], r["round"], r["formed_nodes"], r["ended"],
            (": " + "; ".join("`%s`" % x[:160] for x in r["notes"][:3])) if r["notes"] else "."))

    return "\n".join(out)


def plot_result(result, path):
    args, sizes, results = _unpack(result)
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, keys, title, target in zip(
            axes, [("formation_s", "open_s"), ("reform_s",), ("steady_etcd_cores", "steady_load_cores")],
            ["formation (s)", "re-formation after 1% lost (s)", "steady cost (cores)"],
            [TARGETS["formation_s"], TARGETS["reform_s"], TARGETS["steady_etcd_cores"]]):
        for key in keys:
            xs = [n for n in sizes if any(r["ok"] for r in results[n])]
            ys = [statistics.median(r[key] for r in results[n] if r["ok"]) for n in xs]
            label = {"open_s": "sessions open", "formation_s": "formation",
                     "steady_etcd_cores": "etcd", "steady_load_cores": "agents (etcd_load)",
                     "reform_s": "re-formation"}.get(key, key)
            ax.plot(xs, ys, "o-", label=label)
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label="target at %d" % TARGET_N)
        for n in sizes:
            if not any(r["ok"] for r in results[n]):
                ax.axvline(n, color="red", linestyle=":", linewidth=1)
                ax.text(n, ax.get_ylim()[1] * 0.9, " N=%d did not\n form" % n, color="red", fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("simulated nodes")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle("etcd-v3 rendezvous, %d-member etcd; %s" % (args.members, result["machine"].get("machine", "")),
            fontsize=9)
    save_figure(fig, path, dpi=100)
