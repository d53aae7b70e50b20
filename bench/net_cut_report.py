"""The link-cut benchmark's report, from its result (docs/results/net_cut_bench.json): per cut
length, how many trials cost nothing and how many lost the cut-off node (a new round), and the
plot of that share."""
from bench import render
from bench.render import fmt, pyplot, report_head, save_figure

TITLE = "Link cuts: how long a node may be cut off from elrun-rdzv without costing a round"


FAULT_WORDS = {"link": "link down at the switch", "drop": "packets dropped on the way (nftables)"}


def by_cut(result):
    """[((fault, cut_s), [runs])], sorted; results from before --faults are link cuts."""
    cuts = {}
    for run in result["runs"]:
        cuts.setdefault((run.get("fault", "link"), run["cut_s"]), []).append(run)
    return sorted(cuts.items())


def markdown(result):
    o = result["options"]
    h = o["heartbeat_timeout"]
    how = render.prose("net_cut_bench", "how", h=fmt(h))[0]
    lines = report_head(TITLE, list(result["machine"].items()), how, "see the command")
    lines += render.prose("net_cut_bench", "table")
    for (fault, cut), runs in by_cut(result):
        kept = sum(r["kept"] for r in runs)
        problems = sum(bool(r["history_problems"]) for r in runs)
        lines.append(f"| {FAULT_WORDS.get(fault, fault)} | {fmt(cut)} | {len(runs)} | {kept} | {len(runs) - kept} | "
                     f"{'held' if not problems else f'{problems} with problems'} |")
    lines.append("")
    for fault in dict.fromkeys(f for (f, _), _ in by_cut(result)):
        rows = [(cut, runs) for (f, cut), runs in by_cut(result) if f == fault]
        longest = 0.0
        for cut, runs in rows:  # The longest cut up to which every trial cost nothing.
            if not all(r["kept"] for r in runs):
                break
            longest = cut
        lines.append(f"- {FAULT_WORDS.get(fault, fault)}: every trial of every cut up to {fmt(longest)} s cost "
                     f"nothing ({fmt(100 * longest / h, 0)}% of heartbeat_timeout).")
    lines += ["", f"Elapsed: {fmt(result['elapsed_s'], 0)} s."]
    return "\n".join(lines)


def plot_result(result, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    colors = {"link": "#4c72b0", "drop": "#dd8452"}
    styles = {"link": ("o", "-"), "drop": ("s", "--")}  # The two lines may coincide.
    for fault in dict.fromkeys(f for (f, _), _ in by_cut(result)):
        rows = [(cut, runs) for (f, cut), runs in by_cut(result) if f == fault]
        ys = [100.0 * sum(r["kept"] for r in runs) / len(runs) for _, runs in rows]
        marker, line = styles.get(fault, ("o", "-"))
        ax.plot([cut for cut, _ in rows], ys, marker=marker, linestyle=line, color=colors.get(fault),
                label=FAULT_WORDS.get(fault, fault), markerfacecolor="none" if fault == "drop" else None)
    h = result["options"]["heartbeat_timeout"]
    ax.axvline(h, color="#c44e52", linestyle="--", label=f"heartbeat_timeout ({h:g} s)")
    ax.axvline(h - 0.5, color="#8c8c8c", linestyle=":", label="the node gives up (minus heartbeat_interval 0.5 s)")
    ax.set_xlabel("link cut, s")
    ax.set_ylabel("trials that cost nothing, %")
    ax.set_ylim(-5, 105)
    ax.set_title("A node cut off from the coordinator, then healed")
    ax.legend(fontsize=8)
    save_figure(fig, path)
